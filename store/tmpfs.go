package store

import (
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
)

// TmpfsOptions are the instance's own options.
type TmpfsOptions struct {
	// Size bounds the memory its files hold (tmpfs size=, whole pages);
	// 0 is no bound.
	Size uint64
	// Files bounds the files (nr_inodes, less the root's own inode); 0 is
	// no bound.
	Files uint64
	// Huge is the huge= policy: never, within_size, always or advise.
	Huge string
}

// ErrNoTmpfs means the process may not make a tmpfs instance (fsopen
// needs CAP_SYS_ADMIN) or the kernel cannot (before Linux 5.2).
var ErrNoTmpfs = errors.New("cannot make a private tmpfs instance")

type tmpfs struct {
	root   int // the instance's root (fsmount), attached to no directory
	opt    TmpfsOptions
	closed atomic.Bool
	res    reserved // sealed.go
}

// NewTmpfs makes a private tmpfs instance with opt. Errors wrap
// ErrNoTmpfs when the process or kernel cannot make one at all.
func NewTmpfs(opt TmpfsOptions) (Store, error) {
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("%w: fsopen: %w", ErrNoTmpfs, err)
	}
	defer unix.Close(fsfd)
	set := func(key, value string) error {
		if err := unix.FsconfigSetString(fsfd, key, value); err != nil {
			return fmt.Errorf("tmpfs option %s=%s: %w", key, value, err)
		}
		return nil
	}
	if opt.Size > 0 {
		if err := set("size", strconv.FormatUint(opt.Size, 10)); err != nil {
			return nil, err
		}
	}
	if opt.Files > 0 {
		if err := set("nr_inodes", strconv.FormatUint(opt.Files+1, 10)); err != nil {
			return nil, err
		}
	}
	if opt.Huge != "" {
		if err := set("huge", opt.Huge); err != nil {
			return nil, err
		}
	}
	if err := set("mode", "0700"); err != nil {
		return nil, err
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return nil, fmt.Errorf("create the tmpfs instance: %w", err)
	}
	root, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOEXEC|unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV)
	if err != nil {
		return nil, fmt.Errorf("fsmount the tmpfs instance: %w", err)
	}
	return &tmpfs{root: root, opt: opt}, nil
}

func (s *tmpfs) Kind() string { return "tmpfs" }

func (s *tmpfs) Create(id uint64) (File, error) {
	name := fileName(id)
	fd, err := unix.Openat(s.root, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create %s in the tmpfs store: %w", name, err)
	}
	unix.Close(fd)
	return &tmpfsFile{s: s, id: id}, nil
}

func (s *tmpfs) Usage() (used, size uint64, ok bool) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(s.root, &st); err != nil {
		return 0, 0, false
	}
	bs := uint64(st.Bsize)
	return (st.Blocks - st.Bfree) * bs, st.Blocks * bs, s.opt.Size > 0
}

// Grain: with huge=within_size a fallocate may make huge pages of the
// blocks below the end of file or of its range, and with huge=always of
// any block it touches; with huge=advise, only a mapping that asked for
// them faults them in (none of the daemon's does).
func (s *tmpfs) Grain() (uint64, bool) {
	switch s.opt.Huge {
	case "always":
		return hugeSize(), true
	case "within_size":
		return hugeSize(), false
	}
	return pageSize, false
}

func (s *tmpfs) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	// The instance goes with its last reference: this descriptor, then
	// clients' descriptors and mappings of its files.
	return unix.Close(s.root)
}

// tmpfsFile is a file of the instance, reached by name.
type tmpfsFile struct {
	s       *tmpfs
	id      uint64 // its name is fileName(id): kept as a number, 16 B less per buffer
	removed atomic.Bool
}

// fileName is the name of buffer id's file in the store.
func fileName(id uint64) string { return "b" + strconv.FormatUint(id, 10) }

func (f *tmpfsFile) name() string { return fileName(f.id) }

// open opens the file for one operation.
func (f *tmpfsFile) open() (int, error) {
	if f.removed.Load() {
		return -1, errRemoved
	}
	fd, err := unix.Openat(f.s.root, f.name(), unix.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s of the tmpfs store: %w", f.name(), err)
	}
	return fd, nil
}

// with runs op on a descriptor of the file opened for it.
func (f *tmpfsFile) with(op func(fd int) error) error {
	fd, err := f.open()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return op(fd)
}

func (f *tmpfsFile) Stat() (size, held uint64, err error) {
	if f.removed.Load() {
		return 0, 0, errRemoved
	}
	var st unix.Stat_t
	if err := unix.Fstatat(f.s.root, f.name(), &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return 0, 0, fmt.Errorf("fstatat %s: %w", f.name(), err)
	}
	return uint64(st.Size), uint64(st.Blocks) * 512, nil
}

func (f *tmpfsFile) Truncate(size uint64) error {
	return f.with(func(fd int) error { return truncateFd(fd, size) })
}

func (f *tmpfsFile) Allocate(mode uint32, off, length uint64) error {
	return f.with(func(fd int) error { return allocateFd(fd, mode, off, length) })
}

func (f *tmpfsFile) Map(length uint64) (p unsafe.Pointer, err error) {
	err = f.with(func(fd int) error {
		p, err = MapFd(fd, length, true)
		return err
	})
	return p, err
}

func (f *tmpfsFile) Open() (int, error) { return f.open() }

func (f *tmpfsFile) ReadAt(p []byte, off int64) (n int, err error) {
	err = f.with(func(fd int) error {
		n, err = preadFd(fd, p, off)
		return err
	})
	return n, err
}

func (f *tmpfsFile) WriteAt(p []byte, off int64) (n int, err error) {
	err = f.with(func(fd int) error {
		n, err = pwriteFd(fd, p, off)
		return err
	})
	return n, err
}

func (f *tmpfsFile) Holes(from, to uint64) (n uint64, err error) {
	err = f.with(func(fd int) error {
		n, err = HolesFd(fd, from, to)
		return err
	})
	return n, err
}

func (f *tmpfsFile) Remove() error {
	if f.removed.Swap(true) {
		return errRemoved
	}
	if err := unix.Unlinkat(f.s.root, f.name(), 0); err != nil && err != syscall.ENOENT {
		return fmt.Errorf("unlink %s of the tmpfs store: %w", f.name(), err)
	}
	return nil
}

// String describes the instance for the log.
func (s *tmpfs) String() string {
	size := "unbounded"
	if s.opt.Size > 0 {
		size = bytesize.Format(s.opt.Size)
	}
	return fmt.Sprintf("private tmpfs (size %s, huge=%s)", size, s.opt.Huge)
}
