package tests

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Registration in place (DESIGN.md "Memory you bring"): a shared-memory
// file registered without a copy, as its caller may use it.

// shmSource makes a file of size bytes in /dev/shm, owned by uid with
// mode, filled with a pattern; it goes at the test's end.
func shmSource(t *testing.T, name string, size int, uid int, mode os.FileMode) (string, []byte) {
	t.Helper()
	p := filepath.Join("/dev/shm", fmt.Sprintf("mrfs-test-%d-%s", os.Getpid(), name))
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i*7 + len(name))
	}
	if err := os.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(p) })
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(p, uid, uid); err != nil {
		t.Fatal(err)
	}
	return p, data
}

// daemonMaps says whether the daemon maps a file whose /proc maps line
// holds name.
func daemonMaps(t *testing.T, d *daemon, name string) bool {
	t.Helper()
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", d.pid()))
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Contains(maps, []byte(name))
}

// A /dev/shm file registered with ln -s: a regular file of the mount, the
// source's very pages in the daemon's registration and in the mount
// file's mapping, counted against the budget; unlink deregisters and
// leaves the source as it was.
func TestRegisterInPlaceShm(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"64MiB\""})
	const size = 1 << 20
	src, data := shmSource(t, "shm", size, 0, 0o600)
	f := d.path("a")
	if err := os.Symlink(src, f); err != nil {
		t.Fatalf("ln -s %s: %v", src, err)
	}
	fi, err := os.Lstat(f)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() != size {
		t.Fatalf("the registered name: %v, %v; want a regular file of %d bytes", fi, err, size)
	}
	if _, err := os.Readlink(f); !errors.Is(err, unix.EINVAL) {
		t.Errorf("readlink of a file registered in place: %v, want EINVAL", err)
	}
	desc := readDesc(t, f)
	if desc.State != "registered in place" || mustXattr(t, f, xState) != "registered in place" {
		t.Errorf("state %q (desc %q), want \"registered in place\"", mustXattr(t, f, xState), desc.State)
	}
	if desc.Source == nil || desc.Source.Path != src || desc.Source.Kind != "tmpfs" {
		t.Errorf("desc source %+v, want %s (tmpfs)", desc.Source, src)
	}
	got, err := os.ReadFile(f)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("reading the mount's file: %d bytes (%v), not the source's", len(got), err)
	}
	// The same pages: the source's mapping, the mount file's, and the
	// daemon's registered one.
	daemonVA := uintptr(parseHex(t, mustXattr(t, f, xAddr)))
	_, sm := mapShared(t, src, size)
	faultIn(sm)
	requireSamePages(t, os.Getpid(), sliceAddr(sm), d.pid(), daemonVA, size/pageSize)
	ffh, fm := mapShared(t, f, size)
	faultIn(fm)
	requireSamePages(t, os.Getpid(), sliceAddr(fm), d.pid(), daemonVA, size/pageSize)
	copy(fm, "through the mount")
	if !bytes.HasPrefix(sm, []byte("through the mount")) {
		t.Errorf("a store through the mount file's mapping is not in the source's")
	}
	s := readStats(t, d.mnt)
	if s.ChargedBytes != size || s.RegisteredBytes != size || s.Buffers != 1 {
		t.Errorf("stats after registering 1 MiB in place: charged %d, registered %d, buffers %d", s.ChargedBytes, s.RegisteredBytes, s.Buffers)
	}
	// Its size is the source's: no resize through the mount.
	wantErrno(t, os.Truncate(f, 2*size), unix.EPERM, "truncate of a file registered in place")
	if fh, err := os.OpenFile(f, os.O_WRONLY|os.O_TRUNC, 0); err == nil {
		fh.Close()
		t.Errorf("open O_TRUNC of a file registered in place succeeded")
	}

	// Unlinked while a client has it open and mapped: its last close
	// frees nothing of the source.
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	munmap(fm)
	ffh.Close()
	deadline := time.Now().Add(5 * time.Second)
	for readStats(t, d.mnt).OpenUnlinked != 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // the kernel's release is on its way
	}
	after, err := os.ReadFile(src)
	if err != nil || len(after) != size || !bytes.HasPrefix(after, []byte("through the mount")) || !bytes.Equal(after[64:], data[64:]) {
		t.Errorf("the source after unlink: %d bytes (%v), not as it was", len(after), err)
	}
	if s := readStats(t, d.mnt); s.Buffers != 0 || s.ChargedBytes != 0 || s.RegisteredBytes != 0 {
		t.Errorf("stats after unlink: %+v", s)
	}
	if daemonMaps(t, d, filepath.Base(src)) {
		t.Errorf("the daemon still maps %s after unlink", src)
	}
}

// faultIn reads a byte of every page of m, so this process maps them all
// (into faultSink, or the compiler drops the reads).
func faultIn(m []byte) {
	var sum byte
	for i := 0; i < len(m); i += pageSize {
		sum += m[i]
	}
	faultMu.Lock()
	faultSink += sum
	faultMu.Unlock()
}

// faultMu guards faultSink for parallel tests.
var faultMu sync.Mutex

// notShm is a regular file of some size on a filesystem that is neither
// tmpfs nor hugetlbfs: a file of the test's own directory where that is
// a disk, else /etc/passwd (the qemu guest's /tmp is a tmpfs, its /etc
// the host's over 9p).
func notShm(t *testing.T) string {
	t.Helper()
	disk := filepath.Join(t.TempDir(), "disk")
	if err := os.WriteFile(disk, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{disk, "/etc/passwd"} {
		var sfs unix.Statfs_t
		if unix.Statfs(p, &sfs) == nil && sfs.Type != unix.TMPFS_MAGIC && sfs.Type != unix.HUGETLBFS_MAGIC {
			return p
		}
	}
	t.Fatalf("neither %s nor /etc/passwd is off tmpfs: no file for the case of a disk filesystem", disk)
	return ""
}

// A memfd, named as /proc/PID/fd/N by ln -s and by `mrfs register` (whose
// /proc/self is turned into its pid), is registered with its own pages.
func TestRegisterInPlaceMemfd(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	const size = 256 << 10
	fd, err := unix.MemfdCreate("mrfs-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	mfd := os.NewFile(uintptr(fd), "memfd")
	defer mfd.Close()
	if err := mfd.Truncate(size); err != nil {
		t.Fatal(err)
	}
	mm, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer munmap(mm)
	for i := 0; i < size; i += pageSize {
		mm[i] = byte(i / pageSize) // this process's mapping has every page
	}
	name := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)
	f := d.path("m")
	if err := os.Symlink(name, f); err != nil {
		t.Fatalf("ln -s %s: %v", name, err)
	}
	if desc := readDesc(t, f); desc.Source == nil || desc.Source.Kind != "memfd" {
		t.Errorf("desc source %+v, want kind memfd", desc.Source)
	}
	requireSamePages(t, os.Getpid(), sliceAddr(mm), d.pid(), uintptr(parseHex(t, mustXattr(t, f, xAddr))), size/pageSize)

	// mrfs register, with the memfd as its own descriptor 3.
	cmd := exec.Command(mrfsBin, "register", "--access", "local_write,remote_read", "/proc/self/fd/3", d.path("m2"))
	cmd.ExtraFiles = []*os.File{mfd}
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "registered in place") {
		t.Fatalf("mrfs register /proc/self/fd/3: %v\n%s", err, out)
	}
	if a := mustXattr(t, d.path("m2"), xAccess); a != "local_write,remote_read" {
		t.Errorf("mrfs register --access local_write,remote_read: access %q", a)
	}
	requireSamePages(t, os.Getpid(), sliceAddr(mm), d.pid(), uintptr(parseHex(t, mustXattr(t, d.path("m2"), xAddr))), size/pageSize)
}

// Huge pages are registered as they are: a hugetlb memfd's, and a file's
// of a hugetlbfs mount. The host may have none (its nr_hugepages is 0
// here): the qemu guest, which runs this suite too, reserves a few.
func TestRegisterInPlaceHugetlb(t *testing.T) {
	t.Parallel()
	const huge = 2 << 20
	mfd, err := unix.MemfdCreate("mrfs-test-huge", unix.MFD_CLOEXEC|unix.MFD_HUGETLB)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "hugetlbfs", "none", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount -t hugetlbfs: %v %s", err, out)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	ffd, err := unix.Open(filepath.Join(dir, "f"), unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ffd)
	d := startDaemon(t, daemonConfig{})
	for _, c := range []struct {
		kind, path string
		fd         int
	}{
		{"memfd", fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), mfd), mfd},
		{"hugetlbfs", filepath.Join(dir, "f"), ffd},
	} {
		err := unix.Ftruncate(c.fd, huge)
		var mm []byte
		if err == nil {
			mm, err = unix.Mmap(c.fd, 0, huge, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
		}
		if err != nil {
			if os.Getenv("MRFS_VM_GUEST") == "1" {
				t.Fatalf("a 2 MiB huge page (%s) in the guest, which reserves some: %v", c.kind, err)
			}
			t.Skipf("no 2 MiB huge page to be had on this host (%v); the qemu guest's run covers it", err)
		}
		defer munmap(mm)
		f := d.path(c.kind)
		if err := os.Symlink(c.path, f); err != nil {
			t.Fatalf("ln -s %s (%s): %v", c.path, c.kind, err)
		}
		desc := readDesc(t, f)
		if desc.PageSize != huge {
			t.Errorf("%s: page_size %d, want %d", c.kind, desc.PageSize, huge)
		}
		if s := desc.Source; s == nil || s.Kind != c.kind {
			t.Errorf("%s: desc source %+v", c.kind, s)
		}
		requireSamePages(t, os.Getpid(), sliceAddr(mm), d.pid(), uintptr(parseHex(t, mustXattr(t, f, xAddr))), 4)
	}
}

// The daemon opens a source as its caller would: another user's private
// file is EACCES, a read-only one is EACCES for access that writes and
// registers read-only otherwise (and stays read-only through the mount);
// the daemon's own descriptors, magic links, relative paths, empty files
// and disk files are refused.
func TestRegisterInPlaceOwnership(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true\numask = \"022\""})
	sh := sharedDir(t, d)
	private, _ := shmSource(t, "private", 8192, 0, 0o600)
	readable, _ := shmSource(t, "readable", 8192, 0, 0o644)
	own, _ := shmSource(t, "own", 8192, 65534, 0o600)

	run := func(argv ...string) error {
		out, err := asNobody(argv...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	wantExit := func(err error, errno unix.Errno, what string) {
		t.Helper()
		if err == nil || !strings.Contains(strings.ToLower(err.Error()), errno.Error()) {
			t.Errorf("%s: %v, want %s", what, err, unix.ErrnoName(errno))
		}
	}
	wantExit(run("ln", "-s", private, filepath.Join(sh, "p")), unix.EACCES, "ln -s of root's 0600 source as uid 65534")
	wantExit(run(mrfsBin, "register", "--access", "none", private, filepath.Join(sh, "p")), unix.EACCES, "mrfs register --access none of root's 0600 source as uid 65534")
	wantExit(run("ln", "-s", readable, filepath.Join(sh, "r")), unix.EACCES, "ln -s (local_write) of root's 0644 source as uid 65534")
	wantExit(run(mrfsBin, "register", "--access", "local_write,remote_write", readable, filepath.Join(sh, "r")), unix.EACCES, "mrfs register --access local_write,remote_write of root's 0644 source as uid 65534")
	if err := run(mrfsBin, "register", "--access", "remote_read", readable, filepath.Join(sh, "r")); err != nil {
		t.Fatalf("mrfs register --access remote_read of a source uid 65534 may read: %v", err)
	}
	if st, err := os.Stat(filepath.Join(sh, "r")); err != nil || st.Mode().Perm() != 0o400 || st.Sys().(*syscall.Stat_t).Uid != 65534 {
		t.Errorf("a read-only registration: %v (%v), want 0400 owned by 65534", st.Mode(), err)
	}
	// Read-only stays read-only, for root too.
	if fh, err := os.OpenFile(filepath.Join(sh, "r"), os.O_RDWR, 0); err == nil {
		fh.Close()
		t.Errorf("open O_RDWR of a source registered read-only succeeded")
	}
	wantErrno(t, setxattr(filepath.Join(sh, "r"), xAccess, "local_write"), unix.EACCES, "local_write on a source registered read-only")
	if err := run("ln", "-s", own, filepath.Join(sh, "o")); err != nil {
		t.Errorf("ln -s of uid 65534's own source: %v", err)
	}
	// Its registrant may not open it to others.
	wantExit(run("chmod", "0644", filepath.Join(sh, "r")), unix.EPERM, "chmod 0644 of a file registered in place")
	if err := run("chmod", "0400", filepath.Join(sh, "o")); err != nil {
		t.Errorf("chmod 0400 of a file registered in place: %v", err)
	}
	// A memfd of a process uid 65534 may not trace (it runs as 65534 with
	// root kept as its saved uid): the daemon's capabilities do not pass
	// the kernel's check for 65534.
	holder := exec.Command("python3", "-c", `import ctypes, os, sys, time
fd = os.memfd_create("secret"); os.write(fd, b"secret" * 1000)
os.setresuid(65534, 65534, 0); ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
print(os.getpid(), fd, flush=True); time.sleep(60)`)
	hout, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { holder.Process.Kill(); holder.Wait() }()
	var hpid, hfd int
	if _, err := fmt.Fscan(hout, &hpid, &hfd); err != nil {
		t.Fatalf("the memfd's holder: %v", err)
	}
	wantExit(run("ln", "-s", fmt.Sprintf("/proc/%d/fd/%d", hpid, hfd), filepath.Join(sh, "m")), unix.EACCES, "ln -s of a memfd of a process uid 65534 may not trace")
	if s := readStats(t, d.mnt); s.Users["65534"].Buffers != 2 {
		t.Errorf("uid 65534 owns %d buffers, want 2 (its registrations in place)", s.Users["65534"].Buffers)
	}

	// What no caller may name.
	disk := notShm(t)
	empty, _ := shmSource(t, "empty", 0, 0, 0o600)
	procLink := filepath.Join("/dev/shm", fmt.Sprintf("mrfs-test-%d-proclink", os.Getpid()))
	if err := os.Symlink("/proc/self/fd/0", procLink); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(procLink)
	for _, c := range []struct {
		target string
		want   unix.Errno
		what   string
	}{
		{disk, unix.EINVAL, "a file of a disk filesystem"},
		{empty, unix.EINVAL, "an empty source"},
		{"dev/shm/x", unix.EINVAL, "a relative path"},
		{"/proc/self/fd/0", unix.EINVAL, "/proc/self/fd/N (the daemon's own, through a magic link)"},
		{fmt.Sprintf("/proc/%d/fd/0", d.pid()), unix.EACCES, "the daemon's own descriptor"},
		{"/dev/shm/mrfs-test-absent", unix.ENOENT, "a source that does not exist"},
		{procLink, unix.EINVAL, "a symlink to /proc/self/fd/0"},
		// A lookup in the directory the link goes in would wait for the
		// very request that made it: refused before.
		{filepath.Join(sh, "absent"), unix.EINVAL, "a path into the directory being changed"},
		{filepath.Join(d.mnt, "sub", "x"), unix.EINVAL, "a path into the mount"},
	} {
		wantErrno(t, os.Symlink(c.target, filepath.Join(sh, "x")), c.want, "ln -s "+c.what)
	}
	if s := readStats(t, d.mnt); s.Buffers != 2 {
		t.Errorf("%d buffers after refusals, want the 2 registered", s.Buffers)
	}
}

// Budget and quota count what is registered in place.
func TestRegisterInPlaceLimits(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"8MiB\"\nmax_pinned_per_user = \"2MiB\"", Mount: "allow_other = true"})
	sh := sharedDir(t, d)
	big, _ := shmSource(t, "big", 4<<20, 65534, 0o600)
	small, _ := shmSource(t, "small", 1<<20, 65534, 0o600)
	out, err := asNobody("ln", "-s", big, filepath.Join(sh, "big")).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "quota") {
		t.Errorf("4 MiB in place past uid 65534's 2 MiB quota: %v %s, want EDQUOT", err, out)
	}
	if out, err := asNobody("ln", "-s", small, filepath.Join(sh, "small")).CombinedOutput(); err != nil {
		t.Fatalf("1 MiB in place within the quota: %v %s", err, out)
	}
	if out, err := asNobody("truncate", "-s", "2M", filepath.Join(sh, "buf")).CombinedOutput(); err == nil {
		t.Errorf("a 2 MiB buffer past what the 1 MiB in place left of the quota succeeded: %s", out)
	}

	// 3 MiB in place leave 1 MiB of a 4 MiB budget.
	d = startDaemon(t, daemonConfig{Buffers: "max_pinned = \"4MiB\""})
	three, _ := shmSource(t, "three", 3<<20, 0, 0o600)
	if err := os.Symlink(three, d.path("three")); err != nil {
		t.Fatalf("3 MiB in place within the budget: %v", err)
	}
	wantErrno(t, os.WriteFile(d.path("two"), make([]byte, 2<<20), 0o600), unix.ENOSPC, "a 2 MiB buffer past what registrations in place left of max_pinned")
}

// A source its owner resizes no longer matches the pinned pages: the
// daemon deregisters it within a second even when nobody looks, or at
// the next look at its attributes, and says so.
func TestRegisterInPlaceStale(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	grow, _ := shmSource(t, "grow", 64<<10, 0, 0o600)
	shrink, _ := shmSource(t, "shrink", 64<<10, 0, 0o600)
	for _, n := range []string{"grow", "shrink"} {
		src := map[string]string{"grow": grow, "shrink": shrink}[n]
		if err := os.Symlink(src, d.path(n)); err != nil {
			t.Fatal(err)
		}
	}
	// Nobody looks at "grow" after its source grows: the watch finds it.
	if err := os.Truncate(grow, 128<<10); err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`was resized .*source=` + regexp.QuoteMeta(grow))
	if _, ok := d.waitLog(re, 5*time.Second*slowFactor()); !ok {
		t.Fatalf("no log of the resized source %s within 5 s", grow)
	}
	if s := mustXattr(t, d.path("grow"), xState); s != "stale: source resized" {
		t.Errorf("state of a file whose source grew: %q", s)
	}
	if _, err := getxattr(d.path("grow"), xLkey); !errors.Is(err, unix.ENODATA) {
		t.Errorf("lkey of a stale file: %v, want ENODATA", err)
	}
	// "shrink" is looked at right after its source shrinks.
	if err := os.Truncate(shrink, 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d.path("shrink")); err != nil {
		t.Fatal(err)
	}
	if s := mustXattr(t, d.path("shrink"), xState); s != "stale: source resized" {
		t.Errorf("state of a file whose source shrank, at the next stat: %q", s)
	}
	if s := readStats(t, d.mnt); s.RegisteredBytes != 0 || s.ChargedBytes != 0 || s.Buffers != 2 {
		t.Errorf("stats with two stale files: registered %d, charged %d, buffers %d", s.RegisteredBytes, s.ChargedBytes, s.Buffers)
	}
	if daemonMaps(t, d, filepath.Base(grow)) || daemonMaps(t, d, filepath.Base(shrink)) {
		t.Errorf("the daemon still maps a stale source")
	}
	for _, n := range []string{"grow", "shrink"} {
		if err := os.Remove(d.path(n)); err != nil {
			t.Errorf("rm of a stale file: %v", err)
		}
	}
	if st, err := os.Stat(grow); err != nil || st.Size() != 128<<10 {
		t.Errorf("the grown source after rm: %v %v", st, err)
	}
}

// The source is found in its caller's mount namespace: a tmpfs mounted
// in a namespace of its own, which the daemon's does not see.
func TestRegisterInPlaceMountNamespace(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	dir := filepath.Join(t.TempDir(), "private")
	script := `set -e; mkdir -p "$1"; mount -t tmpfs none "$1"; printf 'in a namespace' > "$1/f"; truncate -s 4096 "$1/f"; ln -s "$1/f" "$2"`
	if out, err := exec.Command("unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", dir, d.path("ns")).CombinedOutput(); err != nil {
		t.Fatalf("a source in a mount namespace of its own: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "f")); err == nil {
		t.Fatalf("the namespace's tmpfs is visible outside it: the test proves nothing")
	}
	got, err := os.ReadFile(d.path("ns"))
	if err != nil || !bytes.HasPrefix(got, []byte("in a namespace")) {
		t.Errorf("the file registered from another mount namespace: %q, %v", got[:min(len(got), 20)], err)
	}
	if s := mustXattr(t, d.path("ns"), xState); s != "registered in place" {
		t.Errorf("state %q", s)
	}
}

// Registrations in place made, read, gone stale and unlinked by several
// threads and another user at once: registered never exceeds charged,
// nor charged the budget, while they race, and nothing is left after
// (no buffer, charge, region, mapping or descriptor of a source).
func TestRegisterInPlaceRace(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"64MiB\"", Mount: "allow_other = true"})
	sh := sharedDir(t, d)
	fds := func() int {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", d.pid()))
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	fdsBefore := fds()
	tag := fmt.Sprintf("mrfs-race-%d", os.Getpid())

	stop := make(chan struct{})
	sampled := make(chan int)
	go func() {
		n := 0
		defer func() { sampled <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			s := readStats(t, d.mnt)
			if s.RegisteredBytes > s.ChargedBytes || s.ChargedBytes > 64<<20 {
				t.Errorf("while racing: registered %d, charged %d (budget 64 MiB)", s.RegisteredBytes, s.ChargedBytes)
			}
			n++
			time.Sleep(5 * time.Millisecond)
		}
	}()

	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			for i := range 30 {
				src := filepath.Join("/dev/shm", fmt.Sprintf("%s-%d-%d", tag, w, i))
				if err := os.WriteFile(src, make([]byte, 4096*(1+(w+i)%16)), 0o600); err != nil {
					t.Error(err)
					return
				}
				f := filepath.Join(sh, fmt.Sprintf("r%d-%d", w, i))
				if err := os.Symlink(src, f); err != nil {
					t.Errorf("ln -s %s: %v", src, err)
				} else {
					if i%3 == 0 {
						os.Truncate(src, 1<<20) // goes stale: at once, or under the watch
					}
					os.ReadFile(f)
					if err := os.Remove(f); err != nil {
						t.Errorf("rm %s: %v", f, err)
					}
				}
				os.Remove(src)
			}
		})
	}
	script := `i=0; while [ $i -lt 30 ]; do s=/dev/shm/$2-u-$i; head -c $((4096*(i%7+1))) /dev/zero >$s || exit 1
ln -s $s "$1/u$i" || exit 1; [ $((i%3)) = 0 ] && truncate -s 1M $s; cat "$1/u$i" >/dev/null; rm "$1/u$i" || exit 1; rm $s; i=$((i+1)); done`
	if out, err := asUser(65534, script, sh, tag); err != nil {
		t.Errorf("uid 65534's registrations in place: %v\n%s", err, out)
	}
	wg.Wait()
	close(stop)
	if n := <-sampled; n == 0 {
		t.Errorf("no sample of the stats was taken while racing")
	}

	deadline := time.Now().Add(5 * time.Second)
	s := readStats(t, d.mnt)
	for (s.Buffers != 0 || s.ChargedBytes != 0 || fds() > fdsBefore) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // the kernel's releases are on their way
		s = readStats(t, d.mnt)
	}
	if s.Buffers != 0 || s.ChargedBytes != 0 || s.RegisteredBytes != 0 || s.Regions != 0 {
		t.Errorf("after the race: buffers %d, charged %d, registered %d, regions %d; want nothing", s.Buffers, s.ChargedBytes, s.RegisteredBytes, s.Regions)
	}
	if daemonMaps(t, d, tag) {
		t.Errorf("the daemon still maps a source after every file went")
	}
	if n := fds(); n > fdsBefore {
		t.Errorf("the daemon holds %d descriptors, %d before: sources leaked", n, fdsBefore)
	}
}

// A sparse source whose own filesystem cannot hold its pages is ENOSPC
// naming that filesystem, not the store or RLIMIT_MEMLOCK (which is what
// pinning would have said).
func TestRegisterInPlaceSourceFull(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	small := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "none", small).CombinedOutput(); err != nil {
		t.Fatalf("mount a 1 MiB tmpfs: %v %s", err, out)
	}
	defer unix.Unmount(small, unix.MNT_DETACH)
	sparse := filepath.Join(small, "sparse")
	if err := os.WriteFile(sparse, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(sparse, 8<<20); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, os.Symlink(sparse, d.path("sparse")), unix.ENOSPC, "a sparse 8 MiB source on a 1 MiB tmpfs")
	re := regexp.MustCompile(`source ` + regexp.QuoteMeta(sparse) + ` cannot all be made: its filesystem is full`)
	if _, ok := d.waitLog(re, 5*time.Second); !ok {
		t.Errorf("the log does not say the source's filesystem is full")
	}
	if s := readStats(t, d.mnt); s.Buffers != 0 || s.ChargedBytes != 0 {
		t.Errorf("after the refusal: %d buffers, %d bytes charged", s.Buffers, s.ChargedBytes)
	}
}

// Registration in place opens the source with the caller's own effective
// capabilities, for uid 0 too: root without capabilities (a container, a
// hardened service) cannot register another user's 0600 file, which it
// could not open itself; root with them can.
func TestRegisterInPlaceCaplessRoot(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	private, _ := shmSource(t, "capless", 8192, 4321, 0o600)
	capless := exec.Command("setpriv", "--securebits", "+noroot,+noroot_locked,+no_setuid_fixup",
		"--bounding-set", "-all", "--inh-caps", "-all", "ln", "-s", private, d.path("p"))
	out, err := capless.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "Permission denied") {
		t.Errorf("ln -s of uid 4321's 0600 source by uid 0 without capabilities: %v %q, want Permission denied", err, out)
	}
	if err := os.Symlink(private, d.path("p")); err != nil {
		t.Errorf("ln -s of the same by root with its capabilities: %v", err)
	}
}

// `mrfs register` works for anyone who may write a sticky directory it
// does not own (the kernel lets only the owner set the directory's
// user.* attributes: the request then goes as a link), with the access
// it asks.
func TestRegisterInStickyDir(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true\numask = \"022\""})
	sh := sharedDir(t, d)
	if err := unix.Chmod(sh, 0o1777); err != nil { // os.Chmod would drop the sticky bit
		t.Fatal(err)
	}
	readable, _ := shmSource(t, "sticky", 8192, 0, 0o644)
	r := filepath.Join(sh, "r")
	if out, err := asNobody(mrfsBin, "register", "--access", "remote_read", readable, r).CombinedOutput(); err != nil {
		t.Fatalf("mrfs register by uid 65534 in a sticky directory of root's: %v %s", err, out)
	}
	if got := mustXattr(t, r, xAccess); got != "remote_read" {
		t.Errorf("access %q, want the remote_read asked", got)
	}
	if st, err := os.Stat(r); err != nil || st.Sys().(*syscall.Stat_t).Uid != 65534 || st.Mode().Perm() != 0o400 {
		t.Errorf("the registration: %v, want 0400 owned by uid 65534", err)
	}
	// A refusal still says why: the source is root's 0600 file.
	private, _ := shmSource(t, "sticky-private", 8192, 0, 0o600)
	out, err := asNobody(mrfsBin, "register", private, filepath.Join(sh, "p")).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "permission denied") {
		t.Errorf("mrfs register of root's 0600 source by uid 65534: %v %q, want permission denied", err, out)
	}
}

// TestRegisterAfterAbsentLookup: a name looked up and found absent,
// which the kernel then trusts for a minute, is there at once after mrfs
// register makes it (a setxattr, whose reply gives the kernel no entry:
// the daemon tells the kernel to drop what it held of the name).
func TestRegisterAfterAbsentLookup(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	src, data := shmSource(t, "after-absent", 4096, 0, 0o600)
	if _, err := os.Stat(d.path("r")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("stat of a name not made yet: %v", err)
	}
	req := fmt.Sprintf(`{"name": "r", "source": %q}`, src)
	if err := unix.Setxattr(d.mnt, "user.mrfs.register", []byte(req), 0); err != nil {
		t.Fatal(err)
	}
	// The drop goes once the setxattr's reply has gone: a moment later.
	var err error
	for deadline := time.Now().Add(5 * time.Second * slowFactor()); ; time.Sleep(10 * time.Millisecond) {
		var b []byte
		if b, err = os.ReadFile(d.path("r")); err == nil {
			if !bytes.Equal(b, data) {
				t.Errorf("the registered file reads %d bytes, not its source's", len(b))
			}
			return
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Errorf("the name mrfs register made, 5 s later: %v (the kernel still holds it as absent)", err)
}
