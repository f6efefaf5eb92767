package tests

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// POSIX corners (DESIGN.md, "POSIX behaviour"): modes are shown exactly,
// long names are ENAMETOOLONG on every call, directories count their
// subdirectories, set-id bits are never stored.
func TestModesExact(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	makeBuffer(t, f, 0)
	if err := os.Chmod(f, 0); err != nil {
		t.Fatal(err)
	}
	if out := strings.TrimSpace(mustRun(t, "stat", "-c", "%a", f)); out != "0" {
		t.Errorf("chmod 000; stat -c %%a = %s, want 0", out)
	}
	// O_CREAT with 0070 under the default umask (077) is 0000.
	fd, err := unix.Open(d.path("g"), unix.O_CREAT|unix.O_RDWR, 0o070)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Stat(d.path("g"), &st); err != nil || st.Mode&0o7777 != 0 {
		t.Errorf("open(O_CREAT, 0070) under umask 077: mode %o (%v), want 0", st.Mode&0o7777, err)
	}
	// A 0000 directory is 0000 too.
	if err := os.Mkdir(d.path("dz"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(d.path("dz"), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(d.path("dz"), &st); err != nil || st.Mode&0o7777 != 0 {
		t.Errorf("chmod 000 of a directory: mode %o (%v)", st.Mode&0o7777, err)
	}
	// Set-id bits are never stored; the sticky bit is.
	if err := os.Chmod(f, 0o6755|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(f, 0o7755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(f, &st); err != nil || st.Mode&0o7777 != 0o1755 {
		t.Errorf("chmod 7755: mode %o (%v), want 1755 (no set-id bits)", st.Mode&0o7777, err)
	}
}

func TestLongNames(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	long := d.path(strings.Repeat("n", 256))
	max := d.path(strings.Repeat("m", 255))
	makeBuffer(t, max, 4096)
	if err := os.Mkdir(d.path("dir"), 0o700); err != nil {
		t.Fatal(err)
	}
	for name, err := range map[string]error{
		"stat":     func() error { _, err := os.Stat(long); return err }(),
		"open":     func() error { _, err := os.Open(long); return err }(),
		"create":   func() error { _, err := os.Create(long); return err }(),
		"unlink":   os.Remove(long),
		"truncate": os.Truncate(long, 1),
		"rmdir":    unix.Rmdir(long),
		"mkdir":    os.Mkdir(long, 0o700),
		"rename":   os.Rename(max, long),
		"getxattr": func() error { _, err := getxattr(long, xState); return err }(),
		"nested":   func() error { _, err := os.Stat(filepath.Join(long, "x")); return err }(),
	} {
		wantErrno(t, err, unix.ENAMETOOLONG, name+" of a 256-byte name")
	}
	requireRegistered(t, max, 4096)
}

func TestDirectoryLinkCount(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	mustRun(t, "mkdir", "-p", d.path("n", "a"), d.path("n", "b"))
	makeBuffer(t, d.path("n", "f"), 0)
	nlink := func(p string) string { return strings.TrimSpace(mustRun(t, "stat", "-c", "%h", p)) }
	if got := nlink(d.path("n")); got != "4" {
		t.Errorf("mkdir -p n/a n/b; stat -c %%h n = %s, want 4", got)
	}
	if got := nlink(d.path("n", "a")); got != "2" {
		t.Errorf("an empty directory's link count %s, want 2", got)
	}
	if got := nlink(d.mnt); got != "3" {
		t.Errorf("the root's link count %s, want 3", got)
	}
	if err := os.Rename(d.path("n", "a"), d.path("a")); err != nil {
		t.Fatal(err)
	}
	if nlink(d.path("n")) != "3" || nlink(d.mnt) != "4" {
		t.Errorf("after mv n/a a: n %s, root %s; want 3, 4", nlink(d.path("n")), nlink(d.mnt))
	}
	if err := os.Remove(d.path("n", "b")); err != nil {
		t.Fatal(err)
	}
	if got := nlink(d.path("n")); got != "2" {
		t.Errorf("after rmdir n/b: %s, want 2", got)
	}
}

// TestUnlinkedOpenFileSeekAllocate: a file that is open but unlinked answers fstat, ftruncate, fallocate
// and SEEK_DATA/SEEK_HOLE from its own handle, on both kinds of open.
func TestUnlinkedOpenFileSeekAllocate(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		mount string
	}{{"zero-copy", ""}, {"degraded", "zero_copy = false"}} {
		t.Run(c.name, func(t *testing.T) {
			d := startDaemon(t, daemonConfig{Mount: c.mount})
			p := d.path("f")
			fh, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			if _, err := fh.WriteAt([]byte("data"), 8192); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			fi, err := fh.Stat()
			if err != nil || fi.Size() != 8196 {
				t.Fatalf("fstat of the unlinked file: %v, %v; want 8196 bytes", fi, err)
			}
			// The bytes written are data up to the end of the file (the
			// first pages are holes, or data once pinned by a
			// registration: either is the file's truth).
			fd := int(fh.Fd())
			if off, err := unix.Seek(fd, 8192, unix.SEEK_DATA); err != nil || off != 8192 {
				t.Errorf("SEEK_DATA from 8192: %d %v, want 8192", off, err)
			}
			if off, err := unix.Seek(fd, 8192, unix.SEEK_HOLE); err != nil || off != 8196 {
				t.Errorf("SEEK_HOLE from 8192: %d %v, want 8196 (the end)", off, err)
			}
			if off, err := unix.Seek(fd, 0, unix.SEEK_DATA); err != nil || off != 0 && off != 8192 {
				t.Errorf("SEEK_DATA from 0: %d %v, want 0 or 8192", off, err)
			}
			if _, err := unix.Seek(fd, 9000, unix.SEEK_DATA); !errors.Is(err, syscall.ENXIO) {
				t.Errorf("SEEK_DATA past the end: %v, want ENXIO", err)
			}
			if err := unix.Fallocate(fd, 0, 0, 16384); err != nil {
				t.Errorf("fallocate of the unlinked file: %v", err)
			}
			if fi, _ := fh.Stat(); fi.Size() != 16384 {
				t.Errorf("size %d after fallocate to 16 KiB", fi.Size())
			}
			if err := fh.Truncate(100); err != nil {
				t.Errorf("ftruncate of the unlinked file: %v", err)
			}
			b := make([]byte, 4)
			if _, err := fh.ReadAt(b, 0); err != nil || string(b) != "\x00\x00\x00\x00" {
				t.Errorf("read of the unlinked file: %q %v", b, err)
			}
			if fi, _ := fh.Stat(); fi.Size() != 100 {
				t.Errorf("size %d after ftruncate to 100", fi.Size())
			}
		})
	}
}

// Truncating past what a process can even map (pjdfstest's truncate/12 and
// ftruncate/12 ask for 999999999999999 bytes, about 909 TiB) is EFBIG, as
// any size past the budget is, and changes nothing.
func TestTruncatePastAddressSpace(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	const huge = 999999999999999
	k := keepBuffer(t, d, "keep", 8192)
	wantErrno(t, unix.Truncate(k.path, huge), unix.EFBIG, "truncate of a registered file to 909 TiB")
	fh, err := os.OpenFile(k.path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	wantErrno(t, fh.Truncate(huge), unix.EFBIG, "ftruncate of a registered file to 909 TiB")
	fh.Close()
	k.check(t, d, "truncates to 909 TiB")
	e := d.path("empty")
	makeBuffer(t, e, 0)
	wantErrno(t, unix.Truncate(e, huge), unix.EFBIG, "truncate of an empty file to 909 TiB")
	requireEmpty(t, e)
}

// A SETATTR's reply carries the inode number: the kernel takes it from
// every reply, so without it a stat that trusts the cached attributes
// (a directory's for a second; AT_STATX_DONT_SYNC always) shows inode 0.
// Inode numbers fit 32 bits, as tmpfs's do.
func TestSetattrKeepsInode(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f, dir := d.path("f"), d.path("d")
	makeBuffer(t, f, 0)
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path, what string
		setattr    func(string) error
	}{
		{dir, "chmod of a directory", func(p string) error { return os.Chmod(p, 0o755) }},
		{dir, "chown of a directory", func(p string) error { return os.Chown(p, 123, 456) }},
		{f, "chmod of a file", func(p string) error { return os.Chmod(p, 0o644) }},
		{f, "truncate of a file", func(p string) error { return os.Truncate(p, 4096) }},
		{f, "utimes of a file", func(p string) error { return os.Chtimes(p, time.Unix(1, 0), time.Unix(2, 0)) }},
	} {
		var before, after unix.Statx_t
		if err := unix.Statx(unix.AT_FDCWD, c.path, 0, unix.STATX_INO, &before); err != nil {
			t.Fatal(err)
		}
		if err := c.setattr(c.path); err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		if err := unix.Statx(unix.AT_FDCWD, c.path, unix.AT_STATX_DONT_SYNC, unix.STATX_INO, &after); err != nil {
			t.Fatal(err)
		}
		if before.Ino == 0 || after.Ino != before.Ino {
			t.Errorf("%s: inode %d, then %d", c.what, before.Ino, after.Ino)
		}
		if before.Ino > math.MaxUint32 {
			t.Errorf("%s: inode %d does not fit a 32-bit stat (EOVERFLOW)", c.path, before.Ino)
		}
	}
}

// The creator's mode keeps the sticky bit (mkdir(2) of a shared directory
// with 01777, as on tmpfs) and loses set-id bits, masked by mount.umask
// (077 by default, which covers any process umask).
func TestCreateModeBits(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	fd, err := unix.Open(d.path("f"), unix.O_CREAT|unix.O_RDWR, 0o7777)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	if err := unix.Mkdir(d.path("shared"), 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkdir(d.path("setgid"), 0o2777); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]uint32{"f": 0o1700, "shared": 0o1700, "setgid": 0o700} {
		var st unix.Stat_t
		if err := unix.Stat(d.path(name), &st); err != nil || st.Mode&0o7777 != want {
			t.Errorf("%s: mode %o (%v), want %o", name, st.Mode&0o7777, err, want)
		}
	}
}
