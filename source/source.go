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
	"io"
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
	// CapEff is the calling thread's effective capabilities (a bit per
	// capability, as /proc/PID/status shows them): the open takes these
	// and no more, whatever the uid (root in a container may have none).
	CapEff uint64
}

// Kinds is what the refusal of another kind of file names.
const Kinds = "a file of tmpfs (/dev/shm) or hugetlbfs, or a memfd as /proc/PID/fd/N"

// procFd is the memfd's form, the one path that goes through a magic
// link (a memfd has no other name): /proc/PID/fd/N.
var procFd = regexp.MustCompile(`^/proc/([0-9]+)/fd/([0-9]+)$`)

// Open opens path for c, read-write when write is set (EACCES when c may
// not write it), and checks it is shared memory of a size > 0.
func Open(path string, c Caller, write bool) (*File, error) {
	if !strings.HasPrefix(path, "/") {
		return nil, fmt.Errorf("source %q: give an absolute path: %w", path, syscall.EINVAL)
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

// openAs opens path on a thread of its own that takes c's credentials:
// fsuid, fsgid and groups (the ones the kernel's permission checks use),
// and c's own effective capabilities, for root too (setfsuid drops only
// the filesystem ones, and only for a uid other than 0; CAP_SYS_PTRACE
// would pass the kernel's check on another process's /proc/PID/fd). The
// thread is never given back: it ends with its goroutine, so no other
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
	if err := takeCaps(c.CapEff); err != nil {
		return -1, err
	}
	return openIn(path, c.PID, flags)
}

// takeCaps makes the calling thread's capabilities eff, less what the
// daemon does not have: effective and permitted, none inheritable.
func takeCaps(eff uint64) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var have [2]unix.CapUserData
	if _, _, e := unix.RawSyscall(unix.SYS_CAPGET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&have[0])), 0); e != 0 {
		return fmt.Errorf("capget: %w", e)
	}
	var take [2]unix.CapUserData
	for i := range take {
		set := uint32(eff>>(32*i)) & have[i].Permitted
		take[i] = unix.CapUserData{Effective: set, Permitted: set}
	}
	if _, _, e := unix.RawSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&take[0])), 0); e != 0 {
		return fmt.Errorf("take the caller's capabilities %#x: %w", eff, e)
	}
	return nil
}

// openIn opens path as process pid resolves it: from its root, so in its
// mount namespace and chroot (through /proc/PID/root: the daemon never
// enters the namespace). The file is found by walk (or, for the memfd
// form, procFile) as an O_PATH descriptor, checked to be shared memory,
// and only then opened: nothing that blocks or acts on open (a FIFO, a
// device) is ever opened.
func openIn(path string, pid uint32, flags int) (int, error) {
	rootPath := "/"
	if pid != 0 {
		rootPath = "/proc/" + strconv.FormatUint(uint64(pid), 10) + "/root"
	}
	root, err := unix.Open(rootPath, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("the caller's root (%s): %w", rootPath, err)
	}
	defer unix.Close(root)
	var target int
	if m := procFd.FindStringSubmatch(path); m != nil {
		target, err = procFile(root, m[1], m[2])
	} else {
		target, err = walk(root, path)
	}
	if err != nil {
		return -1, err
	}
	defer unix.Close(target)
	if _, _, err := kindOf(target); err != nil {
		return -1, err
	}
	// Reopening the O_PATH descriptor checks the caller's permission on
	// the file itself, as an open by its path would.
	return unix.Open("/proc/self/fd/"+strconv.Itoa(target), flags|unix.O_CLOEXEC|unix.O_NOCTTY|unix.O_NONBLOCK, 0)
}

// maxLinks is the kernel's bound on the symlinks of one path (MAXSYMLINKS).
const maxLinks = 40

// oneStep looks up one name in a directory descriptor: no symlink
// followed (a trailing one is returned itself), no magic link.
var oneStep = unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_SYMLINKS}

// walk finds path below root a component at a time, each looked up in
// the descriptor of the directory before it (so a mount made meanwhile
// on a directory already passed cannot redirect it), following symlinks
// itself, and returns an O_PATH descriptor of the file. It refuses to
// look up anything in a directory of a FUSE filesystem: in this very
// mount, the request being served holds the lock of the directory where
// the new name goes, and a lookup there would wait for the daemon
// forever (and no source is on FUSE). It follows no link of /proc: those
// are how a path would reach the daemon's own descriptors and mappings
// (/proc/self/fd, map_files); a memfd has its own form.
func walk(root int, path string) (int, error) {
	stack := []int{root} // the directories passed; root is the caller's
	defer func() {
		for _, fd := range stack[1:] {
			unix.Close(fd)
		}
	}()
	rest := strings.Split(path, "/")
	links := 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(stack) > 1 {
				unix.Close(stack[len(stack)-1])
				stack = stack[:len(stack)-1]
			}
			continue
		}
		dir := stack[len(stack)-1]
		if err := notFuse(dir, path); err != nil {
			return -1, err
		}
		how := oneStep
		fd, err := unix.Openat2(dir, c, &how)
		if err != nil {
			return -1, fmt.Errorf("%s: %w", c, err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("fstat %s: %w", c, err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			stack = append(stack, fd)
			continue
		}
		target, err := readLink(fd, c)
		unix.Close(fd)
		if err != nil {
			return -1, err
		}
		if links++; links > maxLinks {
			return -1, fmt.Errorf("%s: %w", path, syscall.ELOOP)
		}
		if strings.HasPrefix(target, "/") {
			for _, fd := range stack[1:] {
				unix.Close(fd)
			}
			stack = stack[:1]
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	if len(stack) == 1 {
		return -1, fmt.Errorf("%s is the caller's root directory: %w", path, syscall.EINVAL)
	}
	fd := stack[len(stack)-1]
	stack = stack[:len(stack)-1]
	return fd, nil
}

// procFile finds the memfd form /proc/PID/fd/N in the caller's /proc:
// the file process PID has open as N, through its magic link, which the
// kernel lets only a caller allowed to trace PID follow. The daemon's own
// process is refused: its descriptors are other users' buffers, and the
// kernel lets a process follow its own.
func procFile(root int, pid, n string) (int, error) {
	dir, err := walk(root, "/proc/"+pid)
	if err != nil {
		return -1, err
	}
	defer unix.Close(dir)
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(dir, &sfs); err != nil || sfs.Type != unix.PROC_SUPER_MAGIC {
		return -1, fmt.Errorf("/proc/%s is not of a proc filesystem: %w", pid, syscall.EINVAL)
	}
	if err := notDaemon(dir); err != nil {
		return -1, err
	}
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC}
	return unix.Openat2(dir, "fd/"+n, &how)
}

// notDaemon refuses /proc/PID (dir, in the caller's /proc) when it is a
// thread of the daemon's. In the daemon's own /proc (the same proc
// instance) the thread group's id says it. PIDs differ between
// namespaces, so in another /proc it compares the start time of the
// thread group's leader with the daemon's own: the same moment is the
// daemon or, at worst, a process started in the same clock tick (10 ms),
// which is refused too.
func notDaemon(dir int) error {
	status, err := readAt(dir, "status")
	if err != nil {
		return err
	}
	tgid := ""
	for line := range strings.Lines(status) {
		if v, ok := strings.CutPrefix(line, "Tgid:"); ok {
			tgid = strings.TrimSpace(v)
		}
	}
	var st, self unix.Stat_t
	if unix.Fstat(dir, &st) == nil && unix.Stat("/proc/self/", &self) == nil && st.Dev == self.Dev {
		if tgid == "" || tgid == strconv.Itoa(os.Getpid()) {
			return fmt.Errorf("the daemon's own descriptors are not sources: %w", syscall.EACCES)
		}
		return nil
	}
	theirs, err := readAt(dir, "../"+tgid+"/stat")
	if err != nil {
		return err
	}
	ours, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return err
	}
	if t, o := startTime(theirs), startTime(string(ours)); t == "" || t == o {
		return fmt.Errorf("the daemon's own descriptors are not sources: %w", syscall.EACCES)
	}
	return nil
}

// readAt reads name below the directory descriptor dir.
func readAt(dir int, name string) (string, error) {
	how := unix.OpenHow{Flags: unix.O_RDONLY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_SYMLINKS}
	fd, err := unix.Openat2(dir, name, &how)
	if err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	b, err := io.ReadAll(f)
	return string(b), err
}

// startTime is field 22 of a /proc/PID/stat line (after the command,
// which may hold spaces and parentheses): when the process started.
func startTime(stat string) string {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return ""
	}
	f := strings.Fields(stat[i+1:])
	if len(f) < 20 {
		return ""
	}
	return f[19]
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

// notFuse refuses to look up anything in dir when it is on FUSE.
func notFuse(dir int, path string) error {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(dir, &sfs); err != nil {
		return fmt.Errorf("fstatfs on the way to %s: %w", path, err)
	}
	if sfs.Type == unix.FUSE_SUPER_MAGIC {
		return fmt.Errorf("%s goes through a FUSE filesystem (this mount, or another), where no source can be: %w", path, syscall.EINVAL)
	}
	return nil
}

// kindOf is "tmpfs" or "hugetlbfs", by the filesystem of fd, which must
// be a regular file of one of them: memory that stays put while pinned;
// and the file's stat.
func kindOf(fd int) (string, unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", st, fmt.Errorf("fstat: %w", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return "", st, fmt.Errorf("fstatfs: %w", err)
	}
	kind := ""
	switch sfs.Type {
	case unix.TMPFS_MAGIC:
		kind = "tmpfs"
	case unix.HUGETLBFS_MAGIC:
		kind = "hugetlbfs"
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || kind == "" {
		return "", st, fmt.Errorf("not memory that can stay pinned (filesystem 0x%x, mode 0%o); registration in place takes %s: %w", sfs.Type, st.Mode, Kinds, syscall.EINVAL)
	}
	return kind, st, nil
}

// check makes a File of fd, an open source, if it is shared memory of a
// size > 0. A memfd (tmpfs or hugetlbfs by its filesystem) is labelled
// so.
func check(fd int, path string) (*File, error) {
	kind, st, err := kindOf(fd)
	if err != nil {
		return nil, err
	}
	if st.Size <= 0 {
		return nil, fmt.Errorf("the source is empty: give it a size first: %w", syscall.EINVAL)
	}
	if link, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd)); err == nil && strings.HasPrefix(link, "/memfd:") {
		kind = "memfd"
	}
	return &File{fd: fd, path: path, kind: kind, size: uint64(st.Size), dev: st.Dev, ino: st.Ino}, nil
}

// Reopen opens again, after a restart of the daemon (DESIGN, Restart),
// the source a registration in place had open: path as the daemon
// resolves it, read-write when write is set, and only if it is still
// the file it was (dev, ino; ESTALE otherwise: a file put at the path
// since). It is opened with the daemon's credentials: being the same file, what
// the registration had open before, it gives no more than its
// registrant had. A source the daemon cannot reach by the path (a memfd
// of a process gone, a file removed, one in another mount namespace) is
// not found.
func Reopen(path string, dev, ino uint64, write bool) (*File, error) {
	flags := unix.O_RDONLY
	if write {
		flags = unix.O_RDWR
	}
	fd, err := openIn(path, 0, flags)
	if err != nil {
		return nil, fmt.Errorf("source %s: %w", path, err)
	}
	f, err := check(fd, path)
	if err == nil && (f.dev != dev || f.ino != ino) {
		err = fmt.Errorf("it is another file now (inode %d on %#x, was %d on %#x): %w", f.ino, f.dev, ino, dev, syscall.ESTALE)
	}
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("source %s: %w", path, err)
	}
	f.writable = write
	return f, nil
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
	dev, ino uint64 // which file it is
}

var _ store.File = (*File)(nil)

// Path is the source's path as the caller gave it; Kind "tmpfs",
// "hugetlbfs" or "memfd".
func (f *File) Path() string { return f.path }
func (f *File) Kind() string { return f.kind }

// Writable says whether the caller may write the source (it was opened
// read-write).
func (f *File) Writable() bool { return f.writable }

// ID is which file the source is, for Reopen.
func (f *File) ID() (dev, ino uint64) { return f.dev, f.ino }

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
	p, err := store.MapFd(f.fd, length, f.writable)
	if err != nil {
		return nil, fmt.Errorf("the source %s: %w", f.path, err)
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
