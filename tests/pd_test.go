package tests

import (
	"bytes"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestMkdirNewPD: every directory is its own PD; files carry their dir's pd.
func TestMkdirNewPD(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	s0 := readStats(t, d.mnt)
	for _, p := range []string{"a", "b", "a/nested"} {
		if err := os.Mkdir(d.path(p), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if s := readStats(t, d.mnt); s.PDs != s0.PDs+3 {
		t.Errorf("pds after 3 mkdirs = %d, want %d", s.PDs, s0.PDs+3)
	}
	seen := map[string]string{}
	for _, p := range []string{"", "a", "b", "a/nested"} {
		pd := mustXattr(t, d.path(p), xPD)
		if !decRe.MatchString(pd) {
			t.Errorf("%q: pd %q not decimal", p, pd)
		}
		if other, dup := seen[pd]; dup {
			t.Errorf("dirs %q and %q share pd %s", other, p, pd)
		}
		seen[pd] = p
		f := d.path(p, "f")
		makeBuffer(t, f, 4096)
		if got := mustXattr(t, f, xPD); got != pd {
			t.Errorf("%s: pd %q, want its dir's %q", f, got, pd)
		}
		if got := mustXattr(t, d.path(p), xDevice); got != backend.device {
			t.Errorf("%q: device %q", p, got)
		}
	}
}

// TestRmdir: ENOTEMPTY while the PD holds buffers (nothing changes); empty
// rmdir deallocates the PD.
func TestRmdir(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	dir := d.path("tenant")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	f := dir + "/buf"
	makeBuffer(t, f, 64<<10)
	pd := mustXattr(t, dir, xPD)
	before := takeSnapshot(t, d.mnt, f)
	wantErrno(t, unix.Rmdir(dir), unix.ENOTEMPTY, "rmdir of a dir holding a registered buffer")
	before.requireSame(t, takeSnapshot(t, d.mnt, f), "failed rmdir")
	if got := mustXattr(t, dir, xPD); got != pd {
		t.Errorf("pd changed after failed rmdir: %s -> %s", pd, got)
	}

	// An empty (unregistered) buffer still makes the dir non-empty.
	if err := os.Truncate(f, 0); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, unix.Rmdir(dir), unix.ENOTEMPTY, "rmdir of a dir holding an empty file")

	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	s1 := readStats(t, d.mnt)
	if err := unix.Rmdir(dir); err != nil {
		t.Fatalf("rmdir of an empty dir: %v", err)
	}
	if s := readStats(t, d.mnt); s.PDs != s1.PDs-1 {
		t.Errorf("pds after rmdir = %d, want %d", s.PDs, s1.PDs-1)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("dir still there: %v", err)
	}
}

// TestRenameWithinDir: only renames; stays registered in the same PD with
// the same content.
func TestRenameWithinDir(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	a, b := d.path("a"), d.path("b")
	data := patternBytes(20000)
	if err := os.WriteFile(a, data, 0o600); err != nil {
		t.Fatal(err)
	}
	pd := mustXattr(t, a, xPD)
	s0 := readStats(t, d.mnt)
	mustRun(t, "mv", a, b)
	if _, err := os.Lstat(a); !os.IsNotExist(err) {
		t.Errorf("old name still there: %v", err)
	}
	requireRegistered(t, b, int64(len(data)))
	if got := mustXattr(t, b, xPD); got != pd {
		t.Errorf("pd %s -> %s on a rename within the dir", pd, got)
	}
	if got, _ := os.ReadFile(b); !bytes.Equal(got, data) {
		t.Errorf("content changed by rename")
	}
	if s := readStats(t, d.mnt); s.Buffers != s0.Buffers || s.RegisteredBytes != s0.RegisteredBytes {
		t.Errorf("stats %+v -> %+v on a rename", s0, s)
	}
}

// TestRenameAcrossDirs: mv to another dir re-registers in that dir's PD (new
// keys), keeps content, access and length.
func TestRenameAcrossDirs(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	if err := os.Mkdir(d.path("tenant"), 0o700); err != nil {
		t.Fatal(err)
	}
	src := d.path("msg")
	data := patternBytes(3*4096 + 17)
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	mustSetxattr(t, src, xAccess, "local_write,remote_read")
	oldKey, oldRkey := mustXattr(t, src, xLkey), mustXattr(t, src, xRkey)
	s0 := readStats(t, d.mnt)
	mustRun(t, "mv", src, d.path("tenant")+"/")
	dst := d.path("tenant", "msg")
	if _, err := os.Lstat(src); !os.IsNotExist(err) {
		t.Errorf("source still there: %v", err)
	}
	requireRegistered(t, dst, int64(len(data)))
	if got, want := mustXattr(t, dst, xPD), mustXattr(t, d.path("tenant"), xPD); got != want {
		t.Errorf("pd after mv = %s, want the new dir's %s", got, want)
	}
	if got := mustXattr(t, dst, xLkey); got == oldKey {
		t.Errorf("lkey unchanged (%s) after a move to another PD", got)
	}
	if got := mustXattr(t, dst, xRkey); got == oldRkey {
		t.Errorf("rkey unchanged (%s) after a move to another PD", got)
	}
	if got := mustXattr(t, dst, xAccess); got != "local_write,remote_read" {
		t.Errorf("access after mv = %q, want local_write,remote_read kept", got)
	}
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Errorf("content changed by the move")
	}
	if s := readStats(t, d.mnt); s.Buffers != s0.Buffers || s.RegisteredBytes != s0.RegisteredBytes || s.PinnedBytes != s0.PinnedBytes {
		t.Errorf("stats %+v -> %+v after the move (old registration leaked?)", s0, s)
	}
	// The buffer now belongs to the new dir's PD.
	wantErrno(t, unix.Rmdir(d.path("tenant")), unix.ENOTEMPTY, "rmdir of the target dir")
}

// TestRenameOverExisting frees the replaced buffer.
func TestRenameOverExisting(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	a, b := d.path("a"), d.path("b")
	data := patternBytes(1 << 20)
	if err := os.WriteFile(a, data, 0o600); err != nil {
		t.Fatal(err)
	}
	makeBuffer(t, b, 2<<20)
	s0 := readStats(t, d.mnt)
	if err := os.Rename(a, b); err != nil {
		t.Fatalf("rename over an existing file: %v", err)
	}
	s1 := readStats(t, d.mnt)
	if s1.Buffers != s0.Buffers-1 || s1.RegisteredBytes != s0.RegisteredBytes-2<<20 || s1.PinnedBytes != s0.PinnedBytes-2<<20 {
		t.Errorf("stats %+v -> %+v; want the replaced 2 MiB buffer freed", s0, s1)
	}
	requireRegistered(t, b, 1<<20)
	if got, _ := os.ReadFile(b); !bytes.Equal(got, data) {
		t.Errorf("b does not hold a's data")
	}
	// Across directories too.
	if err := os.Mkdir(d.path("t"), 0o700); err != nil {
		t.Fatal(err)
	}
	makeBuffer(t, d.path("t", "b"), 64<<10)
	s2 := readStats(t, d.mnt)
	if err := os.Rename(b, d.path("t", "b")); err != nil {
		t.Fatalf("rename over an existing file in another dir: %v", err)
	}
	s3 := readStats(t, d.mnt)
	if s3.Buffers != s2.Buffers-1 || s3.RegisteredBytes != s2.RegisteredBytes-64<<10 {
		t.Errorf("stats %+v -> %+v; want the replaced 64 KiB buffer freed", s2, s3)
	}
	if got, want := mustXattr(t, d.path("t", "b"), xPD), mustXattr(t, d.path("t"), xPD); got != want {
		t.Errorf("pd %s, want %s", got, want)
	}
}

// TestSpecialFilesEPERM: hard links, FIFOs, device nodes and sockets are
// refused with EPERM, a symlink to what is not shared memory (a file of
// the mount itself, by a relative or an absolute path) with EINVAL, and
// nothing appears.
func TestSpecialFilesEPERM(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	makeBuffer(t, f, 4096)
	before := takeSnapshot(t, d.mnt, f)
	wantErrno(t, unix.Symlink("f", d.path("sym")), unix.EINVAL, "symlink")
	wantErrno(t, unix.Symlink(f, d.path("sym3")), unix.EINVAL, "symlink to a file of the mount")
	wantErrno(t, unix.Link(f, d.path("hard")), unix.EPERM, "link")
	wantErrno(t, unix.Mkfifo(d.path("fifo"), 0o600), unix.EPERM, "mkfifo")
	wantErrno(t, unix.Mknod(d.path("chr"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3))), unix.EPERM, "mknod char device")
	wantErrno(t, unix.Mknod(d.path("blk"), unix.S_IFBLK|0o600, int(unix.Mkdev(7, 0))), unix.EPERM, "mknod block device")
	wantErrno(t, unix.Mknod(d.path("sock"), unix.S_IFSOCK|0o600, 0), unix.EPERM, "mknod socket")
	_, _, err := run(t, "ln", "-s", "f", d.path("sym2"))
	if err == nil {
		t.Errorf("ln -s succeeded")
	}
	for _, n := range []string{"sym", "hard", "fifo", "chr", "blk", "sock", "sym2", "sym3"} {
		if _, err := os.Lstat(d.path(n)); !os.IsNotExist(err) {
			t.Errorf("%s exists after a refused create: %v", n, err)
		}
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, f), "refused special files")
	ents, err := os.ReadDir(d.mnt)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != "f" {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("readdir = %v, want [f]", names)
	}
}
