package source

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// shmDir is a directory of /dev/shm (tmpfs) for one test.
func shmDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("/dev/shm", "mrfs-source-test-")
	if err != nil {
		t.Skipf("no /dev/shm to make sources in: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	if err := os.Chmod(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

var root = Caller{UID: 0, GID: 0, PID: uint32(os.Getpid()), CapEff: ^uint64(0)}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("opening as another user needs root (setfsuid)")
	}
}

func mustOpen(t *testing.T, path string, c Caller, write bool) *File {
	t.Helper()
	f, err := Open(path, c, write)
	if err != nil {
		t.Fatalf("Open(%s): %v", path, err)
	}
	t.Cleanup(func() { f.Remove() })
	return f
}

// The walk follows relative and absolute links and "..", as the kernel
// would, and lands on the file.
func TestOpenFollowsLinks(t *testing.T) {
	requireRoot(t)
	d := shmDir(t)
	for _, p := range []string{"a", "x"} {
		if err := os.Mkdir(filepath.Join(d, p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(d, "a", "f"), make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	links := map[string]string{
		"rel":   "a/f",                       // relative to its directory
		"abs":   filepath.Join(d, "rel"),     // absolute, to another link
		"up":    "x/../a/f",                  // ".." inside the target
		"dirln": "a",                         // a link to a directory
		"x/bk":  "../abs",                    // relative, from a subdirectory
		"chain": filepath.Join(d, "x", "bk"), // absolute, through both
	}
	for name, target := range links {
		if err := os.Symlink(target, filepath.Join(d, name)); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.Stat(filepath.Join(d, "a", "f"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"a/f", "rel", "abs", "up", "dirln/f", "x/../a/f", "chain", "./a/./f"} {
		f := mustOpen(t, filepath.Join(d, p), root, true)
		var st unix.Stat_t
		if err := unix.Fstat(f.fd, &st); err != nil {
			t.Fatal(err)
		}
		if st.Ino != want.Sys().(*syscall.Stat_t).Ino || f.Kind() != "tmpfs" || f.size != 4096 {
			t.Errorf("%s: inode %d, kind %s, size %d; want %s's", p, st.Ino, f.Kind(), f.size, filepath.Join(d, "a", "f"))
		}
	}
}

// What a source may not be, and what a path may not go through.
func TestOpenRefuses(t *testing.T) {
	requireRoot(t)
	d := shmDir(t)
	mk := func(name string, size int) string {
		p := filepath.Join(d, name)
		if err := os.WriteFile(p, make([]byte, size), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// This process stands for the daemon: its descriptor of a tmpfs file
	// is what no path may reach through /proc.
	held, err := os.Open(mk("f", 4096))
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	selfFd := fmt.Sprintf("/proc/self/fd/%d", held.Fd())
	empty := mk("empty", 0)
	fifo := filepath.Join(d, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Symlink(filepath.Join(d, "loop2"), filepath.Join(d, "loop1"))
	os.Symlink(filepath.Join(d, "loop1"), filepath.Join(d, "loop2"))
	os.Symlink(selfFd, filepath.Join(d, "proc"))
	disk := "/etc/passwd" // not shared memory, wherever this runs
	for _, c := range []struct {
		path string
		want syscall.Errno
	}{
		{filepath.Join(d, "loop1"), syscall.ELOOP},
		{filepath.Join(d, "proc"), syscall.EINVAL},
		{selfFd, syscall.EINVAL},
		{fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), held.Fd()), syscall.EACCES},
		{"dev/shm/f", syscall.EINVAL},
		{empty, syscall.EINVAL},
		{fifo, syscall.EINVAL}, // refused before an open, which would wait for a writer
		{"/dev/null", syscall.EINVAL},
		{d, syscall.EINVAL},
		{disk, syscall.EINVAL},
		{filepath.Join(d, "absent"), syscall.ENOENT},
		{filepath.Join(d, "f", "x"), syscall.ENOTDIR},
	} {
		f, err := Open(c.path, root, false)
		if err == nil {
			f.Remove()
		}
		if !errors.Is(err, c.want) {
			t.Errorf("Open(%s): %v, want %v", c.path, err, c.want)
		}
	}
}

// The caller's credentials decide: another user's private file is
// EACCES, a file it may only read opens read-only and stays so.
func TestOpenAsCaller(t *testing.T) {
	requireRoot(t)
	d := shmDir(t)
	priv := filepath.Join(d, "priv")
	pub := filepath.Join(d, "pub")
	for p, mode := range map[string]os.FileMode{priv: 0o600, pub: 0o644} {
		if err := os.WriteFile(p, make([]byte, 8192), mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode)
	}
	nobody := Caller{UID: 65534, GID: 65534, PID: uint32(os.Getpid())}
	if _, err := Open(priv, nobody, false); !errors.Is(err, syscall.EACCES) {
		t.Errorf("root's 0600 file for uid 65534: %v, want EACCES", err)
	}
	// uid 0 with no capability (a container, a hardened service) is held
	// to the file's mode as anyone: another user's 0600 file is EACCES.
	if err := os.Chown(priv, 4321, 4321); err != nil {
		t.Fatal(err)
	}
	capless := Caller{UID: 0, GID: 0, PID: uint32(os.Getpid())}
	if _, err := Open(priv, capless, false); !errors.Is(err, syscall.EACCES) {
		t.Errorf("uid 4321's 0600 file for uid 0 without capabilities: %v, want EACCES", err)
	}
	mustOpen(t, priv, root, true)
	if _, err := Open(pub, nobody, true); !errors.Is(err, syscall.EACCES) {
		t.Errorf("root's 0644 file for writing by uid 65534: %v, want EACCES", err)
	}
	f := mustOpen(t, pub, nobody, false)
	if f.Writable() {
		t.Errorf("a source opened for reading says it is writable")
	}
	fd, err := f.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, err := unix.Pwrite(fd, []byte("x"), 0); !errors.Is(err, syscall.EBADF) {
		t.Errorf("a client's open of a read-only source takes a write: %v", err)
	}
	if _, err := f.WriteAt([]byte("x"), 0); !errors.Is(err, syscall.EACCES) {
		t.Errorf("WriteAt on a read-only source: %v, want EACCES", err)
	}
}

// The buffer layer cannot resize a source, nor write past its end.
func TestFileKeepsItsSize(t *testing.T) {
	requireRoot(t)
	d := shmDir(t)
	p := filepath.Join(d, "f")
	if err := os.WriteFile(p, make([]byte, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	f := mustOpen(t, p, root, true)
	if err := f.Truncate(4096); !errors.Is(err, syscall.EPERM) {
		t.Errorf("Truncate: %v, want EPERM", err)
	}
	if err := f.Allocate(0, 0, 16384); !errors.Is(err, syscall.EPERM) {
		t.Errorf("Allocate past the end: %v, want EPERM", err)
	}
	if n, err := f.WriteAt(make([]byte, 100), 8150); n != 42 || err != nil {
		t.Errorf("WriteAt across the end: %d, %v; want the 42 bytes that fit", n, err)
	}
	if _, err := f.WriteAt([]byte("x"), 8192); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("WriteAt at the end: %v, want EFBIG", err)
	}
	if st, err := os.Stat(p); err != nil || st.Size() != 8192 {
		t.Errorf("the source after it all: %v, %v", st, err)
	}
	if size, held, err := f.Stat(); size != 8192 || held != 8192 || err != nil {
		t.Errorf("Stat: %d, %d, %v", size, held, err)
	}
}

// notDaemon knows the daemon in its own /proc by pid, and in another
// proc instance (a caller's pid namespace) by its start time.
func TestNotDaemon(t *testing.T) {
	requireRoot(t)
	other := t.TempDir()
	if err := unix.Mount("proc", other, "proc", 0, ""); err != nil {
		t.Skipf("cannot mount another proc instance here: %v", err)
	}
	defer unix.Unmount(other, unix.MNT_DETACH)
	// Two clock ticks after this process began: in another proc
	// instance only the start time tells the daemon apart.
	time.Sleep(20 * time.Millisecond)
	parent := exec.Command("sleep", "60")
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { parent.Process.Kill(); parent.Wait() }()
	for _, procRoot := range []string{"/proc", other} {
		for pid, daemon := range map[int]bool{os.Getpid(): true, parent.Process.Pid: false} {
			dir, err := unix.Open(fmt.Sprintf("%s/%d", procRoot, pid), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			err = notDaemon(dir)
			unix.Close(dir)
			if daemon != errors.Is(err, syscall.EACCES) {
				t.Errorf("%s/%d (the daemon: %v): %v", procRoot, pid, daemon, err)
			}
		}
	}
}
