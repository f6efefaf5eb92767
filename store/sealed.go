package store

import (
	"fmt"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
)

// NewSealed makes the file behind one pool slot: a memfd of size bytes
// whose size can never change again (F_SEAL_GROW, F_SEAL_SHRINK, and
// F_SEAL_SEAL so that nobody lifts them). A write past its end, through
// any descriptor or mapping of it, fails with EPERM at that call, so
// nothing ever lands outside the registration of its pages; a plain tmpfs
// file cannot promise that (named tmpfs files refuse seals). Hole
// punching is still allowed by the kernel: callers refuse it. The caller
// closes the descriptor.
func NewSealed(size uint64) (int, error) {
	fd, err := unix.MemfdCreate("mrfs-slot", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := truncateFd(fd, size); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("seal a memfd of %s: %w", bytesize.Format(size), err)
	}
	return fd, nil
}

// Reserver is a store whose own size bound can give room to memory held
// outside it (pools), so that the kernel's bound on its files and that
// memory together stays the budget.
type Reserver interface {
	// Reserve lowers the bound by n bytes: ENOSPC when its files hold
	// more than the lower bound allows.
	Reserve(n uint64) error
	// Unreserve gives n bytes back.
	Unreserve(n uint64)
}

var _ Reserver = (*tmpfs)(nil)

// reserved is what the tmpfs instance's size gives to memory outside it.
type reserved struct {
	mu sync.Mutex // guards: n, and the reconfigurations of the instance
	n  uint64
}

// Reserve remounts the instance with size = the budget less what is
// reserved (fspick and a reconfigure of the detached mount). The kernel
// refuses a size below what the files hold (EINVAL): ENOSPC then.
func (s *tmpfs) Reserve(n uint64) error {
	if s.opt.Size == 0 || n == 0 {
		return nil
	}
	s.res.mu.Lock()
	defer s.res.mu.Unlock()
	if s.res.n+n >= s.opt.Size {
		return fmt.Errorf("reserve %s of the store's %s (%s reserved already): %w",
			bytesize.Format(n), bytesize.Format(s.opt.Size), bytesize.Format(s.res.n), syscall.ENOSPC)
	}
	if err := s.resize(s.opt.Size - s.res.n - n); err != nil {
		if err == syscall.EINVAL {
			used, _, _ := s.Usage()
			return fmt.Errorf("reserve %s of the store: its files hold %s of %s: %w",
				bytesize.Format(n), bytesize.Format(used), bytesize.Format(s.opt.Size-s.res.n), syscall.ENOSPC)
		}
		return fmt.Errorf("reserve %s of the store: %w", bytesize.Format(n), err)
	}
	s.res.n += n
	return nil
}

func (s *tmpfs) Unreserve(n uint64) {
	if s.opt.Size == 0 || n == 0 {
		return
	}
	s.res.mu.Lock()
	defer s.res.mu.Unlock()
	s.res.n -= min(n, s.res.n)
	// Growing cannot fail for room; if it fails at all the store stays
	// smaller than the budget: refusals come early, nothing leaks.
	_ = s.resize(s.opt.Size - s.res.n)
}

// resize sets the instance's size bound. Callers hold s.res.mu.
func (s *tmpfs) resize(size uint64) error {
	fc, err := unix.Fspick(s.root, "", unix.FSPICK_EMPTY_PATH|unix.FSPICK_CLOEXEC)
	if err != nil {
		return err
	}
	defer unix.Close(fc)
	if err := unix.FsconfigSetString(fc, "size", fmt.Sprint(size)); err != nil {
		return err
	}
	return unix.FsconfigReconfigure(fc)
}
