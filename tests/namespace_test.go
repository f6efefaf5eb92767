package tests

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"
)

// statLoop stats paths until stop is closed. With entry timeouts of 0 the
// kernel revalidates each name with a LOOKUP that is not serialized with
// UNLINK or RENAME: the race a name map must survive.
func statLoop(stop <-chan struct{}, wg *sync.WaitGroup, paths ...string) {
	defer wg.Done()
	for {
		select {
		case <-stop:
			return
		default:
		}
		for _, p := range paths {
			var st unix.Stat_t
			unix.Stat(p, &st)
		}
	}
}

// TestCreateUnlinkRacingStat: a name unlinked while others stat it goes
// away and can be created again; nothing stays registered.
func TestCreateUnlinkRacingStat(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	p := d.path("z")
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go statLoop(stop, &wg, p)
	go statLoop(stop, &wg, p)
	for i := range 1500 {
		fd, err := unix.Open(p, unix.O_CREAT|unix.O_RDWR, 0o600)
		if err != nil {
			close(stop)
			wg.Wait()
			t.Fatalf("iteration %d: create after unlink: %v", i, err)
		}
		unix.Close(fd)
		if err := unix.Unlink(p); err != nil {
			close(stop)
			wg.Wait()
			t.Fatalf("iteration %d: unlink: %v", i, err)
		}
	}
	close(stop)
	wg.Wait()
	if names, err := os.ReadDir(d.mnt); err != nil || len(names) != 0 {
		t.Errorf("readdir after the loop: %v, %v; want an empty directory", names, err)
	}
	if s := readStats(t, d.mnt); s.Buffers != 0 || s.PinnedBytes != 0 {
		t.Errorf("stats after the loop: %+v, want no buffer and nothing pinned", s)
	}
}

// TestRenameOverRacingStat: renaming over a name others stat, across PDs,
// never leaves a registered buffer without a name, and everything can be
// removed afterwards.
func TestRenameOverRacingStat(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	if err := os.Mkdir(d.path("sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	src, dst := d.path("a"), d.path("sub", "b")
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go statLoop(stop, &wg, src, dst)
	go statLoop(stop, &wg, dst, src)
	var failures atomic.Int32
	data := make([]byte, 4096)
	for range 1000 {
		if err := os.WriteFile(src, data, 0o600); err != nil {
			failures.Add(1)
			continue
		}
		if err := os.Rename(src, dst); err != nil {
			failures.Add(1)
		}
	}
	close(stop)
	wg.Wait()
	if n := failures.Load(); n != 0 {
		t.Errorf("%d write or rename calls failed", n)
	}
	s := readStats(t, d.mnt)
	if s.Buffers != 1 || s.RegisteredBytes != 4096 {
		t.Errorf("stats after the loop: %+v, want exactly the one buffer at sub/b", s)
	}
	if err := os.Remove(dst); err != nil {
		t.Fatalf("rm sub/b: %v", err)
	}
	if err := os.Remove(d.path("sub")); err != nil {
		t.Fatalf("rmdir sub: %v", err)
	}
	if _, err := os.Stat(src); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stat a: %v, want ENOENT", err)
	}
	if s := readStats(t, d.mnt); s.Buffers != 0 || s.PinnedBytes != 0 || s.PDs != 1 {
		t.Errorf("stats after cleanup: %+v, want nothing left but the root PD", s)
	}
	if names, err := os.ReadDir(d.mnt); err != nil || len(names) != 0 {
		t.Errorf("readdir after cleanup: %v, %v; want an empty mount", names, err)
	}
}

// TestUnlinkedOpenFile: a file unlinked while open is deregistered at
// once, yet the opener keeps a working file: writes past EOF show in
// fstat, ftruncate works, nlink is 0, as on any filesystem.
func TestUnlinkedOpenFile(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	p := d.path("f")
	fd, err := unix.Open(p, unix.O_CREAT|unix.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, err := unix.Pwrite(fd, []byte("0123456789"), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unlink(p); err != nil {
		t.Fatal(err)
	}
	if s := readStats(t, d.mnt); s.Buffers != 0 || s.PinnedBytes != 0 {
		t.Errorf("stats after unlink: %+v, want the buffer gone at once", s)
	}
	if _, err := unix.Pwrite(fd, []byte("x"), 100000); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Size != 100001 || st.Nlink != 0 {
		t.Errorf("fstat after a write past EOF: %v, size %d nlink %d; want 100001, 0", err, st.Size, st.Nlink)
	}
	if err := unix.Ftruncate(fd, 5); err != nil {
		t.Fatalf("ftruncate of the unlinked file: %v", err)
	}
	buf := make([]byte, 16)
	n, _ := unix.Pread(fd, buf, 0)
	if err := unix.Fstat(fd, &st); err != nil || st.Size != 5 || string(buf[:n]) != "01234" {
		t.Errorf("after ftruncate(5): size %d, data %q", st.Size, buf[:n])
	}
}
