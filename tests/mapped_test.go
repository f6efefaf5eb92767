package tests

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A zero-copy mapping outlives its descriptor: FUSE passthrough maps the
// daemon's own file, so the kernel sends RELEASE at the close while the
// pages are still mapped. What a mapping still sees is not reused, freed,
// truncated or uncharged until the munmap (the kernel's FORGET of the
// file): DESIGN "Accounting".

// mapClosed maps size bytes of path shared and closes the descriptor: the
// most common way there is to use a mapping. It returns once d has the
// close's RELEASE, so that only the mapping holds the file. The mapping
// goes at the test's end, or before with unix.Munmap.
func mapClosed(t *testing.T, d *daemon, path string, size int) []byte {
	t.Helper()
	fh, m := mapShared(t, path, size)
	open := readStats(t, d.mnt).OpenFiles
	if err := fh.Close(); err != nil {
		t.Fatal(err)
	}
	// The kernel sends RELEASE after close returns: until the daemon has
	// it, the file is held by its open as well as by the mapping.
	for deadline := time.Now().Add(10 * time.Second * slowFactor()); readStats(t, d.mnt).OpenFiles >= open; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: the daemon still counts its descriptor 10 s after the close", path)
		}
	}
	return m
}

// readMapped copies m, or says that touching it faulted (SIGBUS: the file
// was truncated under the mapping).
func readMapped(m []byte) (got []byte, ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return bytes.Clone(m), true
}

// waitStats waits until the daemon's stats satisfy ok (a FORGET reaches
// the daemon after the munmap returns).
func waitStats(t *testing.T, d *daemon, what string, ok func(mrfsStats) bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second * slowFactor())
	for {
		s := readStats(t, d.mnt)
		if ok(s) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %+v", what, s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Unlinking a file mapped and closed leaves the mapping its pages (no
// SIGBUS), still charged; the munmap gives them back.
func TestUnlinkMappedClosed(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("rx")
	data := patternBytes(1 << 20)
	if err := os.WriteFile(f, data, 0o600); err != nil {
		t.Fatal(err)
	}
	m := mapClosed(t, d, f, 1<<20)
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	got, ok := readMapped(m)
	if !ok || !bytes.Equal(got, data) {
		t.Fatalf("the mapping of a file removed after its close: readable %v, same bytes %v", ok, bytes.Equal(got, data))
	}
	copy(m, "still mine")
	s := readStats(t, d.mnt)
	if s.OpenUnlinked != 1 || s.ChargedBytes != 1<<20 {
		t.Errorf("with the removed file still mapped: %+v, want it held and charged", s)
	}
	munmap(m)
	waitStats(t, d, "after the munmap", func(s mrfsStats) bool { return s.OpenUnlinked == 0 && s.ChargedBytes == 0 && s.StoreBytes == 0 })
}

// A pool slot that a mapping still sees is not given to the next file:
// another user's secret never shows in it, and a pool of one slot is full
// until the munmap, after which the slot comes back zeroed.
func TestPoolSlotMappedNotReused(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true"})
	sharedDir(t, d)
	for _, slots := range []int{1, 2} {
		p := makePool(t, d, "shared/pool"+strings.Repeat("s", slots-1), "4KiB", slots)
		if err := os.Chmod(p, 0o777); err != nil {
			t.Fatal(err)
		}
		a := filepath.Join(p, "a")
		if err := os.WriteFile(a, []byte("old"), 0o600); err != nil {
			t.Fatal(err)
		}
		m := mapClosed(t, d, a, pageSize)
		if err := os.Remove(a); err != nil {
			t.Fatal(err)
		}
		out, err := asUser(1000, `printf secret > "$1"`, filepath.Join(p, "b"))
		if slots == 1 {
			if err == nil || !strings.Contains(out, "No space left") {
				t.Fatalf("a file in a pool of one slot still mapped: %v %q, want ENOSPC", err, out)
			}
		} else if err != nil {
			t.Fatalf("uid 1000's file in the pool's other slot: %v %q", err, out)
		}
		if got, ok := readMapped(m); !ok || string(got[:3]) != "old" || bytes.Contains(got, []byte("secret")) {
			t.Fatalf("pool of %d: the mapping of a removed file reads %q (readable %v)", slots, got[:8], ok)
		}
		munmap(m)
		if slots == 1 {
			deadline := time.Now().Add(10 * time.Second * slowFactor())
			for {
				out, err = asUser(1000, `printf secret > "$1"`, filepath.Join(p, "b"))
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("a file once the mapping is gone: %v %q", err, out)
				}
				time.Sleep(20 * time.Millisecond)
			}
			got, err := os.ReadFile(filepath.Join(p, "b"))
			if err != nil || len(got) != pageSize || !bytes.Equal(got[6:], make([]byte, pageSize-6)) || string(got[:6]) != "secret" {
				t.Fatalf("the next file in the slot: %q... (%v), want the new bytes and zeros", got[:min(len(got), 8)], err)
			}
		}
	}
}

// Removing a pool while a slot of it is mapped keeps that slot charged to
// the pool's maker until the munmap: the memory is the mapping's.
func TestPoolRemovedWhileMapped(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	p := makePool(t, d, "pool", "1MiB", 4)
	a := filepath.Join(p, "a")
	if err := os.WriteFile(a, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	m := mapClosed(t, d, a, 1<<20)
	for i := 0; i < len(m); i += pageSize {
		m[i] = 1
	}
	if err := os.Remove(a); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if s := readStats(t, d.mnt); s.ChargedBytes != 1<<20 {
		t.Fatalf("the pool removed with a slot mapped: %d bytes charged, want the slot's 1 MiB", s.ChargedBytes)
	}
	munmap(m)
	waitStats(t, d, "after the munmap", func(s mrfsStats) bool { return s.ChargedBytes == 0 })
}

// One zero-copy write far past the end, then a mapping, then the close:
// what could not be registered is taken back at the close (which says
// so), so the mapping cannot fill 480 MiB that nobody is charged for.
func TestMappedAfterCloseWithinQuota(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"256MiB\"\nmax_pinned_per_user = \"64MiB\""})
	f := d.path("sparse")
	fh, err := os.OpenFile(f, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	const far = 480 << 20
	if _, err := fh.WriteAt([]byte("x"), far); err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(fh.Fd()), 0, far, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer munmap(m)
	err = fh.Close()
	if err == nil {
		t.Fatal("the close after a write of 480 MiB past a 64 MiB quota succeeded")
	}
	if size := fileSize(t, f); size != 0 {
		t.Fatalf("after the close the file is %d bytes, want what was registered (0)", size)
	}
	requireHeld(t, d, "after the close")
}

// What a mapping fills in a removed file it alone holds is charged: an
// ftruncate through the handle of a removed file, a mapping and the close
// leave a file of holes only the mapping holds; the mapping fills them,
// unseen. The next call the store cannot hold finds the store fuller
// than charged, and charges them to the owner (and the call is refused:
// the pages are the mapping's). The munmap gives all back.
func TestMappedRemovedFileFilledCharged(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: `max_pinned = "16MiB"`})
	const size = 8 << 20
	f, err := os.OpenFile(d.path("sparse"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(d.path("sparse")); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	track(t, m)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if s := readStats(t, d.mnt); s.StoreBytes >= size/2 {
		t.Fatalf("the removed file's holes are filled before the mapping touches them: %+v", s)
	}
	copy(m, patternBytes(size)) // the holes filled through the mapping
	makeBuffer(t, d.path("g"), 0)
	if err := os.Truncate(d.path("g"), 12<<20); err == nil {
		t.Fatal("12 MiB fit a 16 MiB budget beside 8 MiB a mapping holds")
	}
	if s := readStats(t, d.mnt); s.ChargedBytes < size || s.StoreBytes > s.ChargedBytes {
		t.Errorf("the mapping filled %d bytes of a removed file: %+v, want them charged", size, s)
	}
	munmap(m)
	if err := os.Remove(d.path("g")); err != nil {
		t.Fatal(err)
	}
	waitStats(t, d, "after the munmap", func(s mrfsStats) bool { return s.OpenUnlinked == 0 && s.ChargedBytes == 0 && s.StoreBytes == 0 })
}
