// Package source opens memory a client brings to be registered in place
// (DESIGN.md "Memory you bring"): a shared-memory file of tmpfs or
// hugetlbfs, or a memfd named as /proc/PID/fd/N. It opens the file as the
// calling user would, with the caller's credentials and in the caller's
// mount namespace, so the daemon's own privileges never reach memory the
// caller could not, and checks that the file is of a kind whose pages stay
// put while pinned. The File it returns is the buffer's file (a
// store.File) for the buffer layer, which never resizes or frees it: the
// memory stays its owner's.
package source

import (
	"errors"
	"fmt"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/store"
)

// Caller is who asks for the registration: the credentials the source is
// opened with, and the process whose mount namespace resolves its path.
type Caller struct {
	UID, GID uint32
	Groups   []uint32
	PID      uint32 // whose root (so mount namespace) resolves the path; 0: the daemon's
}

// Kinds is what the refusal of another kind of file names.
const Kinds = "a file of tmpfs (/dev/shm) or hugetlbfs, or a memfd as /proc/PID/fd/N"

// procFd is the one path form that may go through a magic link: a memfd
// has no other name.
var procFd = regexp.MustCompile(`^/proc/([0-9]+)/fd/[0-9]+$`)

// Open opens path for c, read-write when write is set (EACCES when c may
// not write it), and checks it is shared memory of a size > 0.
func Open(path string, c Caller, write bool) (*File, error) {
	if !strings.HasPrefix(path, "/") {
		return nil, fmt.Errorf("source %q: give an absolute path: %w", path, syscall.EINVAL)
	}
	if m := procFd.FindStringSubmatch(path); m != nil {
		if err := notDaemon(m[1]); err != nil {
			return nil, fmt.Errorf("source %s: %w", path, err)
		}
	}
	flags := unix.O_RDONLY
	if write {
		flags = unix.O_RDWR
	}
	fd, err := openAs(path, c, flags)
	if err != nil {
		if write && (errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EPERM)) {
			return nil, fmt.Errorf("source %s: uid %d may not write it, and the access asked writes (local_write or remote_write): %w", path, c.UID, syscall.EACCES)
		}
		return nil, fmt.Errorf("source %s: %w", path, err)
	}
	f, err := check(fd, path)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("source %s: %w", path, err)
	}
	f.writable = write
	return f, nil
}

// notDaemon refuses the daemon's own descriptors: its opens of other
// users' buffers. Any other process's the kernel checks (the caller must
// be allowed to trace it).
func notDaemon(pid string) error {
	status, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return nil // the open fails as the caller sees it
	}
	for line := range strings.Lines(string(status)) {
		if tgid, ok := strings.CutPrefix(line, "Tgid:"); ok && strings.TrimSpace(tgid) == strconv.Itoa(os.Getpid()) {
			return fmt.Errorf("the daemon's own descriptors are not sources: %w", syscall.EACCES)
		}
	}
	return nil
}

// openAs opens path on a thread of its own that takes c's credentials
// (fsuid, fsgid, groups: the ones the kernel's permission checks use).
// The thread is never given back: it ends with its goroutine, so no other
// goroutine ever runs with what it took.
func openAs(path string, c Caller, flags int) (int, error) {
	type result struct {
		fd  int
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // and never unlocked: see above
		fd, err := openOnThread(path, c, flags)
		done <- result{fd, err}
	}()
	r := <-done
	return r.fd, r.err
}

func openOnThread(path string, c Caller, flags int) (int, error) {
	if euid := unix.Geteuid(); euid != 0 {
		// An unprivileged daemon (the degraded mode) has only its own.
		if c.UID != uint32(euid) {
			return -1, fmt.Errorf("a daemon not run as root registers in place for its own uid only: %w", syscall.EACCES)
		}
		return openIn(path, c.PID, flags)
	}
	groups := c.Groups
	if len(groups) == 0 {
		groups = []uint32{c.GID}
	}
	// Raw calls: the libc and Go wrappers change every thread's.
	if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(groups)), uintptr(unsafe.Pointer(&groups[0])), 0); e != 0 {
		return -1, fmt.Errorf("setgroups: %w", e)
	}
	unix.RawSyscall(unix.SYS_SETFSGID, uintptr(c.GID), 0, 0)
	unix.RawSyscall(unix.SYS_SETFSUID, uintptr(c.UID), 0, 0)
	if got, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, ^uintptr(0), 0, 0); uint32(got) != c.UID {
		return -1, fmt.Errorf("setfsuid %d did not take: %w", c.UID, syscall.EPERM)
	}
	return openIn(path, c.PID, flags)
}

// openIn opens path as process pid resolves it: from its root, so in its
// mount namespace and chroot (through /proc/PID/root: the daemon never
// enters the namespace). The path is walked first (walk), and then opened
// with no symlink and no magic link on the way. The memfd form
// /proc/PID/fd/N is the one path that goes through a magic link: notDaemon
// checked it, and the kernel checks the caller may trace the process.
func openIn(path string, pid uint32, flags int) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC | unix.O_NOCTTY)}
	if procFd.MatchString(path) {
		return unix.Openat2(unix.AT_FDCWD, path, &how)
	}
	rootPath := "/"
	if pid != 0 {
		rootPath = "/proc/" + strconv.FormatUint(uint64(pid), 10) + "/root"
	}
	root, err := unix.Open(rootPath, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("the caller's root (%s): %w", rootPath, err)
	}
	defer unix.Close(root)
	resolved, err := walk(root, path)
	if err != nil {
		return -1, err
	}
	how.Resolve = inRoot | unix.RESOLVE_NO_SYMLINKS
	fd, err := unix.Openat2(root, resolved, &how)
	if err == syscall.ELOOP {
		return -1, fmt.Errorf("%s changed while it was opened: %w", path, syscall.EAGAIN)
	}
	return fd, err
}

// inRoot resolves below a root fd as the process whose root it is: ".."
// and absolute links stop at it, and no magic link is followed.
const inRoot = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS

// maxLinks is the kernel's bound on the symlinks of one path (MAXSYMLINKS).
const maxLinks = 40

// walk resolves path below root a component at a time, following
// symlinks itself, and returns it with none left. It refuses to look up
// anything in a directory of a FUSE filesystem: in this very mount, the
// request being served holds the lock of the directory where the new
// name goes, and a lookup there would wait for the daemon forever (and no
// source is on FUSE). It follows no link of /proc: those are how a path
// would reach the daemon's own descriptors and mappings (/proc/self/fd,
// map_files), and a memfd has its own form.
func walk(root int, path string) (string, error) {
	var done []string
	rest := strings.Split(path, "/")
	links := 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			done = done[:max(len(done)-1, 0)]
			continue
		}
		if err := notFuse(root, done, path); err != nil {
			return "", err
		}
		next := "/" + strings.Join(append(done[:len(done):len(done)], c), "/")
		fd, err := unix.Openat2(root, next, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: inRoot | unix.RESOLVE_NO_SYMLINKS})
		if err != nil {
			return "", fmt.Errorf("%s: %w", next, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return "", fmt.Errorf("fstat %s: %w", next, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			unix.Close(fd)
			done = append(done, c)
			continue
		}
		target, err := readLink(fd, next)
		unix.Close(fd)
		if err != nil {
			return "", err
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("%s: %w", path, syscall.ELOOP)
		}
		if strings.HasPrefix(target, "/") {
			done = nil
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	return "/" + strings.Join(done, "/"), nil
}

// readLink is the target of the symlink fd (an O_PATH descriptor of it),
// unless it is one of /proc's.
func readLink(fd int, name string) (string, error) {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return "", fmt.Errorf("fstatfs %s: %w", name, err)
	}
	if sfs.Type == unix.PROC_SUPER_MAGIC {
		return "", fmt.Errorf("%s is a link of /proc, which a source's path may not go through (name a memfd as /proc/PID/fd/N): %w", name, syscall.EINVAL)
	}
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(fd, "", buf)
	if err != nil {
		return "", fmt.Errorf("readlink %s: %w", name, err)
	}
	return string(buf[:n]), nil
}

// notFuse refuses to look up anything in the directory done (resolved
// below root) when it is on FUSE.
func notFuse(root int, done []string, path string) error {
	dir := root
	if len(done) > 0 {
		fd, err := unix.Openat2(root, "/"+strings.Join(done, "/"), &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: inRoot | unix.RESOLVE_NO_SYMLINKS})
		if err != nil {
			return fmt.Errorf("on the way to %s: %w", path, err)
		}
		defer unix.Close(fd)
		dir = fd
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(dir, &sfs); err != nil {
		return fmt.Errorf("fstatfs on the way to %s: %w", path, err)
	}
	if sfs.Type == unix.FUSE_SUPER_MAGIC {
		return fmt.Errorf("%s goes through a FUSE filesystem (this mount, or another), where no source can be: %w", path, syscall.EINVAL)
	}
	return nil
}

// check makes a File of fd if it is a regular file of shared memory.
func check(fd int, path string) (*File, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return nil, fmt.Errorf("fstatfs: %w", err)
	}
	kind := ""
	switch sfs.Type {
	case unix.TMPFS_MAGIC:
		kind = "tmpfs"
	case unix.HUGETLBFS_MAGIC:
		kind = "hugetlbfs"
	}
	if link, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd)); err == nil && strings.HasPrefix(link, "/memfd:") {
		kind = "memfd"
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG || kind == "":
		return nil, fmt.Errorf("not memory that can stay pinned (filesystem 0x%x, mode 0%o); registration in place takes %s: %w", sfs.Type, st.Mode, Kinds, syscall.EINVAL)
	case st.Size <= 0:
		return nil, fmt.Errorf("the source is empty: give it a size first: %w", syscall.EINVAL)
	}
	return &File{fd: fd, path: path, kind: kind, size: uint64(st.Size)}, nil
}

// File is an open source: the buffer's file for the buffer layer. It
// never changes the source's size or memory: Truncate and Allocate are
// refused, and Remove only closes it.
type File struct {
	fd       int // -1 once removed
	path     string
	kind     string
	size     uint64 // at open: the size registered
	writable bool
}

var _ store.File = (*File)(nil)

// Path is the source's path as the caller gave it; Kind "tmpfs",
// "hugetlbfs" or "memfd".
func (f *File) Path() string { return f.path }
func (f *File) Kind() string { return f.kind }

// Writable says whether the caller may write the source (it was opened
// read-write).
func (f *File) Writable() bool { return f.writable }

// Stat is the source's size now, and as held the whole of it: every page
// of a registration in place is pinned, so charged, whatever the source
// held before.
func (f *File) Stat() (size, held uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(f.fd, &st); err != nil {
		return 0, 0, fmt.Errorf("fstat the source %s: %w", f.path, err)
	}
	size = uint64(st.Size)
	return size, store.PageRound(size), nil
}

func (f *File) errResize() error {
	return fmt.Errorf("a file registered in place has its source's size (%s): resize %s instead: %w", bytesize.Format(f.size), f.path, syscall.EPERM)
}

func (f *File) Truncate(size uint64) error {
	if size == f.size {
		return nil
	}
	return f.errResize()
}

func (f *File) Allocate(mode uint32, off, length uint64) error {
	if mode&unix.FALLOC_FL_KEEP_SIZE != 0 && mode&^unix.FALLOC_FL_KEEP_SIZE == 0 && off+length <= f.size {
		return nil // every page is there already
	}
	return f.errResize()
}

// Map maps the source MAP_SHARED: read-write when writable, else
// read-only (the access given to such a source writes nothing).
func (f *File) Map(length uint64) (unsafe.Pointer, error) {
	prot := unix.PROT_READ
	if f.writable {
		prot |= unix.PROT_WRITE
	}
	n := store.PageRound(length)
	p, err := unix.MmapPtr(f.fd, 0, nil, uintptr(n), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s of the source %s: %w", bytesize.Format(n), f.path, err)
	}
	return p, nil
}

// Open reopens the source for a client's open, as the caller opened it
// (read-only sources stay read-only).
func (f *File) Open() (int, error) {
	flags := unix.O_RDONLY
	if f.writable {
		flags = unix.O_RDWR
	}
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(f.fd), flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("reopen the source %s: %w", f.path, err)
	}
	return fd, nil
}

func (f *File) ReadAt(p []byte, off int64) (int, error) {
	n, err := unix.Pread(f.fd, p, off)
	if err != nil {
		return 0, fmt.Errorf("pread the source at %d: %w", off, err)
	}
	return n, nil
}

// WriteAt writes what fits below the registered size: a write past it
// would resize the source (EFBIG, as past a file size limit).
func (f *File) WriteAt(p []byte, off int64) (int, error) {
	if !f.writable {
		return 0, fmt.Errorf("the source %s is registered read-only: %w", f.path, syscall.EACCES)
	}
	if off < 0 || len(p) > 0 && uint64(off) >= f.size {
		return 0, fmt.Errorf("write at %d: past the source's size (%s): %w", off, bytesize.Format(f.size), syscall.EFBIG)
	}
	n, err := unix.Pwrite(f.fd, p[:min(uint64(len(p)), f.size-uint64(off))], off)
	if err != nil {
		return n, fmt.Errorf("pwrite the source at %d: %w", off, err)
	}
	return n, nil
}

// Holes: none to count; Stat charges every page.
func (f *File) Holes(from, to uint64) (uint64, error) { return 0, nil }

// Remove closes the source, which stays as it is.
func (f *File) Remove() error {
	if f.fd < 0 {
		return nil
	}
	err := unix.Close(f.fd)
	f.fd = -1
	return err
}
