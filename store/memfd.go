package store

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

type memfd struct{}

// NewMemfd is the degraded store: a memfd per file, with no limit of its
// own. It needs no privilege.
func NewMemfd() Store { return &memfd{} }

func (*memfd) Kind() string                        { return "memfd" }
func (*memfd) Usage() (used, size uint64, ok bool) { return 0, 0, false }
func (*memfd) String() string                      { return "memfds" }

// Grain follows the kernel's setting for shmem outside a tmpfs mount
// (memfds), read at each call: an administrator may change it.
func (*memfd) Grain() (uint64, bool) {
	b, _ := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	return shmemGrain(string(b))
}

// shmemGrain is Grain for a shmem_enabled text ("always [never] ..."):
// huge pages wherever they fit for always and force, below the end of
// file for within_size; base pages otherwise (advise: the daemon does not
// ask for them).
func shmemGrain(setting string) (uint64, bool) {
	sel := setting
	if i := strings.IndexByte(setting, '['); i >= 0 {
		if j := strings.IndexByte(setting[i:], ']'); j > 0 {
			sel = setting[i+1 : i+j]
		}
	}
	switch strings.TrimSpace(sel) {
	case "always", "force":
		return hugeSize(), true
	case "within_size":
		return hugeSize(), false
	}
	return pageSize, false
}

func (*memfd) Close() error { return nil }

func (*memfd) Create(id uint64) (File, error) {
	fd, err := unix.MemfdCreate("mrfs:"+strconv.FormatUint(id, 10), unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	return &memfdFile{fd: fd}, nil
}

// memfdFile holds its memfd until Remove.
type memfdFile struct {
	mu sync.RWMutex // guards: fd (-1 once removed) against Remove
	fd int
}

func (f *memfdFile) with(op func(fd int) error) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.fd < 0 {
		return errRemoved
	}
	return op(f.fd)
}

func (f *memfdFile) Stat() (size, held uint64, err error) {
	err = f.with(func(fd int) error {
		size, held, err = statFd(fd)
		return err
	})
	return size, held, err
}

func (f *memfdFile) Truncate(size uint64) error {
	return f.with(func(fd int) error { return truncateFd(fd, size) })
}

func (f *memfdFile) Allocate(mode uint32, off, length uint64) error {
	return f.with(func(fd int) error { return allocateFd(fd, mode, off, length) })
}

func (f *memfdFile) Map(length uint64) (p unsafe.Pointer, err error) {
	err = f.with(func(fd int) error {
		p, err = MapFd(fd, length, true)
		return err
	})
	return p, err
}

func (f *memfdFile) Open() (nfd int, err error) {
	err = f.with(func(fd int) error {
		nfd, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("dup memfd: %w", err)
		}
		return nil
	})
	return nfd, err
}

func (f *memfdFile) ReadAt(p []byte, off int64) (n int, err error) {
	err = f.with(func(fd int) error {
		n, err = preadFd(fd, p, off)
		return err
	})
	return n, err
}

func (f *memfdFile) WriteAt(p []byte, off int64) (n int, err error) {
	err = f.with(func(fd int) error {
		n, err = pwriteFd(fd, p, off)
		return err
	})
	return n, err
}

func (f *memfdFile) Holes(from, to uint64) (n uint64, err error) {
	err = f.with(func(fd int) error {
		n, err = HolesFd(fd, from, to)
		return err
	})
	return n, err
}

func (f *memfdFile) Remove() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fd < 0 {
		return errRemoved
	}
	err := unix.Close(f.fd)
	f.fd = -1
	if err != nil {
		return fmt.Errorf("close memfd: %w", err)
	}
	return nil
}
