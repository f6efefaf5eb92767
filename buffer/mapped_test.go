package buffer_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/source"
	"mrfs/verbs"
)

// A zero-copy mapping outlives its descriptor (DESIGN "Accounting"): the
// kernel's inode of the file, held with HoldInode until its FORGET, keeps
// the memory, its charge and a pool slot, as a descriptor does.

// mapFd maps n bytes of a client's descriptor shared, as a client's
// mapping through a passthrough open does.
func mapFd(t *testing.T, fd *buffer.Fd, n int) []byte {
	t.Helper()
	m, err := unix.Mmap(fd.N, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	return m
}

// openZeroCopy is a client's zero-copy open of b: its descriptor, and
// the hold of the kernel's inode that the open takes (HoldInode), which
// release ends as the kernel's FORGET would.
func openZeroCopy(t *testing.T, b *buffer.Buffer) (fd *buffer.Fd, release func()) {
	t.Helper()
	fd, err := b.Open(true)
	if err != nil {
		t.Fatal(err)
	}
	hold := b.HoldInode()
	return fd, func() {
		if free := hold(); free != nil {
			free()
		}
	}
}

// readable says whether every byte of m can be read (a truncated file's
// mapping faults with SIGBUS), and returns them.
func readable(m []byte) (got []byte, ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return bytes.Clone(m), true
}

// An unlinked file that a mapping still holds keeps its pages and its
// charge after its last close, and gives both up at the release of the
// inode's hold (the munmap's FORGET).
func TestMappingKeepsUnlinkedFile(t *testing.T) {
	needTmpfs(t)
	for _, unlinkOpen := range []bool{false, true} {
		e := setup(t, buffer.Options{MaxPinned: 64 * page}, 0)
		b, err := e.m.Create(e.d, 4*page, 7)
		if err != nil {
			t.Fatal(err)
		}
		fd, release := openZeroCopy(t, b)
		m := mapFd(t, fd, 4*page)
		copy(m, pattern(4*page, 3))
		if unlinkOpen {
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
			fd.Close()
		} else {
			fd.Close()
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
		}
		if got, ok := readable(m); !ok || !bytes.Equal(got, pattern(4*page, 3)) {
			t.Fatalf("unlinked while open %v: the mapping lost its pages (readable %v)", unlinkOpen, ok)
		}
		if st := e.m.Stats(); st.Orphans != 1 || st.Users[7].Charged != 4*page {
			t.Fatalf("unlinked while open %v, still mapped: %+v", unlinkOpen, st)
		}
		unix.Munmap(m)
		release()
		release() // idempotent
		if st := e.m.Stats(); st.Orphans != 0 || st.ChargedBytes != 0 || st.StoreUsed != 0 || len(st.Users) != 0 {
			t.Fatalf("unlinked while open %v, after the munmap's release: %+v", unlinkOpen, st)
		}
	}
}

// A pool slot whose file a mapping still holds is not given again, nor
// uncharged when the pool goes: its pages are the mapping's.
func TestMappingKeepsSlot(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	newPool(t, e, page, 1)
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	fd, release := openZeroCopy(t, b)
	m := mapFd(t, fd, page)
	copy(m, "secret")
	fd.Close()
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	_, err = e.m.Create(e.d, 0, 0)
	errnoIs(t, err, syscall.ENOSPC)
	if string(m[:6]) != "secret" {
		t.Fatal("the slot was zeroed under its mapping")
	}
	release()
	c, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatalf("a create once the mapping's hold is released: %v", err)
	}
	if err := c.Free(); err != nil {
		t.Fatal(err)
	}

	// The pool goes while a slot is mapped: that slot stays charged.
	if b, err = e.m.Create(e.d, 0, 0); err != nil {
		t.Fatal(err)
	}
	fd, release = openZeroCopy(t, b)
	fd.Close()
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Close(); err != nil {
		t.Fatal(err)
	}
	if st := e.m.Stats(); st.Users[0].Charged != page {
		t.Fatalf("the pool removed while a slot is mapped: %+v, want the slot charged", st)
	}
	release()
	if st := e.m.Stats(); st.ChargedBytes != 0 {
		t.Fatalf("after the slot's release: %+v", st)
	}
}

// What a client wrote past the end through a zero-copy open and could
// not be registered does not outlive the writer's close: a mapping could
// fill its holes uncharged.
func TestFlushCutsUnregisteredTail(t *testing.T) {
	needTmpfs(t)
	e := setup(t, buffer.Options{MaxPinned: 64 * page, MaxPinnedPerUser: 8 * page}, 0)
	z, err := e.m.Create(e.d, 2*page, 5)
	if err != nil {
		t.Fatal(err)
	}
	f := outside(t, z)
	if _, err := f.WriteAt([]byte("z"), 40*page); err != nil {
		t.Fatal(err)
	}
	err = z.Flush()
	if err == nil || !errors.Is(err, syscall.EDQUOT) && !errors.Is(err, syscall.EFBIG) {
		t.Fatalf("a writer's close after a sparse write past the quota: %v", err)
	}
	check(t, e, z, 2*page, buffer.Registered)
	held(t, e)
}

// A chown that a removed file's release would make room for waits for
// it, as admission does: `rm f; chown g` works though the kernel's
// FORGET of f reaches the daemon after the rm returns.
func TestChownWaitsForRelease(t *testing.T) {
	needTmpfs(t)
	e := setup(t, buffer.Options{MaxPinned: 64 * page, MaxPinnedPerUser: 4 * page}, 0)
	a, err := e.m.Create(e.d, 3*page, 7)
	if err != nil {
		t.Fatal(err)
	}
	fd, release := openZeroCopy(t, a)
	fd.Close()
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	b := e.create(t, 2*page)
	time.AfterFunc(50*time.Millisecond, release)
	if err := b.SetOwner(7); err != nil {
		t.Fatalf("chown into the room of a file being released: %v", err)
	}
	// Nothing to wait for: refused at once.
	c := e.create(t, 3*page)
	errnoIs(t, c.SetOwner(7), syscall.EDQUOT)
}

// Lowering a pool's slots waits, briefly, for a slot whose removed file
// is being released.
func TestPoolShrinkWaitsForRelease(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	p := newPool(t, e, page, 1)
	if err := p.SetSlots(2, 0); err != nil {
		t.Fatal(err)
	}
	var bs []*buffer.Buffer
	for range 2 {
		b, err := e.m.Create(e.d, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		bs = append(bs, b)
	}
	last := bs[0] // the file of slot 1, in the chunk to free
	if bs[1].Info().Pool.Index == 1 {
		last = bs[1]
	}
	fd, release := openZeroCopy(t, last)
	fd.Close()
	if err := last.Free(); err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(50*time.Millisecond, release)
	if err := p.SetSlots(1, 0); err != nil {
		t.Fatalf("lowering the slots while the last one's file is being released: %v", err)
	}
	errnoIs(t, p.SetSlots(0, 0), syscall.EINVAL)
}

// The last close of an unlinked file registered in place leaves its
// source's bytes: they are its owner's, not the daemon's to free.
func TestInPlaceLastCloseKeepsSource(t *testing.T) {
	needTmpfs(t)
	e := setup(t, buffer.Options{}, 0)
	p := filepath.Join("/dev/shm", fmt.Sprintf("mrfs-buffer-test-%d", os.Getpid()))
	want := bytes.Repeat([]byte{7}, 2*page)
	if err := os.WriteFile(p, want, 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(p)
	src, err := source.Open(p, source.Caller{PID: uint32(os.Getpid()), CapEff: ^uint64(0)}, true)
	if err != nil {
		t.Fatal(err)
	}
	b, err := e.m.RegisterInPlace(e.d, src, 0, verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := b.Open(true)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	fd.Close()
	if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the source after the last close of its unlinked registration: %d bytes (%v)", len(got), err)
	}
}

// An unlinked file that only a mapping holds can still gain pages: the
// client fills its holes through the mapping, which the daemon never
// sees. When the store is found full, what such files hold is charged to
// their owners, as what writers wrote unseen is: the store holds no page
// that nobody is charged for.
func TestMappedOrphanFilledIsCharged(t *testing.T) {
	needTmpfs(t)
	e := setup(t, buffer.Options{MaxPinned: 20 * page}, 0)
	b, err := e.m.Create(e.d, 0, 7)
	if err != nil {
		t.Fatal(err)
	}
	fd, release := openZeroCopy(t, b)
	defer release()
	// A zero-copy write far past the end, unseen: one page of sixteen.
	if _, err := unix.Pwrite(fd.N, []byte{1}, 15*page); err != nil {
		t.Fatal(err)
	}
	m := mapFd(t, fd, 16*page)
	fd.Close()
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	copy(m, pattern(16*page, 5)) // every hole filled through the mapping
	if _, err := e.m.Create(e.d, 8*page, 8); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("a create the store has no room for: %v, want ENOSPC", err)
	}
	st := e.m.Stats()
	if u := st.Users[7]; u.Charged != 16*page || u.Orphaned != 16*page || st.StoreUsed > st.ChargedBytes {
		t.Errorf("the mapped orphan holds 16 pages, charged %+v; the store holds %d, charged %d", u, st.StoreUsed, st.ChargedBytes)
	}
}
