package buffer

import (
	"errors"
	"fmt"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
)

// Buffer is one memfd, its daemon mapping, and its registration.
//
// Invariants while the buffer lives (b.gone == nil):
//   - Registered: mr covers [mp.base, mp.base+size), mp.len ==
//     pageRound(size), and size is the memfd's size as last learned.
//   - Empty: size == 0, no mapping, no region.
//   - Unregistered: size > 0, no mapping, no region, reason says why.
type Buffer struct {
	m *Manager

	mu sync.RWMutex
	// guards (with mu): its memfd, mapping, region, size, access, domain,
	// state and reason, and gone.
	fd     int      // the memfd; -1 once freed
	mp     mapping  // the daemon's mapping of the memfd
	mr     verbs.MR // nil unless Registered
	size   uint64
	access verbs.Access
	dom    *Domain
	state  State
	reason string
	gone   error // errFreed or errClosed once freed
}

// String is the state as user.mrfs.state spells it (without the reason).
func (s State) String() string {
	switch s {
	case Empty:
		return "empty"
	case Registered:
		return "registered"
	case Unregistered:
		return "unregistered"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Create makes a buffer of size bytes in d with d's default access,
// registered at once when size > 0. ENOSPC past MaxBuffers or MaxPinned;
// a device refusal passes its errno through. A failed Create leaves
// nothing behind.
func (m *Manager) Create(d *Domain, size uint64) (*Buffer, error) {
	if d == nil {
		return nil, fmt.Errorf("create buffer: no domain: %w", syscall.EINVAL)
	}
	b := &Buffer{m: m, fd: -1, dom: d}
	// b is in the manager's set before it is built, so a concurrent
	// Manager.Close sees it; holding b.mu makes that Close wait for us.
	b.mu.Lock()
	defer b.mu.Unlock()
	m.mu.Lock()
	err := m.reserveBuffer(d)
	if err == nil {
		m.buffers[b] = struct{}{}
		d.nbuf++
		b.access = d.access
		m.nextID++
	}
	id := m.nextID
	m.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("create buffer in pd %d: %w", d.handle, err)
	}

	fd, err := unix.MemfdCreate(fmt.Sprintf("mrfs:%d", id), unix.MFD_CLOEXEC)
	if err != nil {
		b.abandonLocked()
		if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
			// Each buffer holds a memfd: the daemon's descriptor limit
			// is a buffer limit the user must be told about.
			var rl unix.Rlimit
			unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
			m.mu.Lock()
			m.warn(limitNoFile, fmt.Sprintf("cannot create buffer: out of file descriptors (RLIMIT_NOFILE is %d; each buffer holds one); raise it with `ulimit -n` or lower buffers.max_buffers", rl.Cur), "value", rl.Cur)
			m.mu.Unlock()
		}
		return nil, fmt.Errorf("create buffer: memfd_create: %w", err)
	}
	b.fd = fd
	if size > 0 {
		err := truncate(fd, size)
		if err == nil {
			err = b.mapAndRegisterLocked(size)
		}
		if err != nil {
			b.abandonLocked()
			return nil, fmt.Errorf("create buffer of %s: %w", formatSize(size), err)
		}
	}
	return b, nil
}

// abandonLocked undoes a Create that failed after its reservation.
func (b *Buffer) abandonLocked() {
	if b.fd >= 0 {
		unix.Close(b.fd)
		b.fd = -1
	}
	b.gone = errFreed
	b.m.mu.Lock()
	delete(b.m.buffers, b)
	b.dom.nbuf--
	b.m.mu.Unlock()
}

// Fd is the memfd, for FUSE passthrough; -1 once freed.
func (b *Buffer) Fd() int {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.fd
}

// DupFd returns a new descriptor of the memfd (close-on-exec), which
// stays valid after Free; the caller closes it. ENOENT once freed.
func (b *Buffer) DupFd() (int, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.gone != nil {
		return -1, fmt.Errorf("dup memfd: %w", b.gone)
	}
	fd, err := unix.FcntlInt(uintptr(b.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("dup memfd: %w", err)
	}
	return fd, nil
}

// Info returns a snapshot. After Free it reports the last size with
// State Empty.
func (b *Buffer) Info() Info {
	b.mu.RLock()
	defer b.mu.RUnlock()
	in := Info{
		Size:   b.size,
		State:  b.state,
		Reason: b.reason,
		Access: b.access,
		PD:     b.dom.handle,
	}
	if b.mr != nil {
		in.LKey, in.RKey, in.Addr = b.mr.LKey(), b.mr.RKey(), b.mr.Addr()
	}
	return in
}

// Domain is the domain the buffer is registered in.
func (b *Buffer) Domain() *Domain {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.dom
}

// Sync learns the memfd's size by fstat and re-registers when it changed
// (a client wrote past EOF or truncated through a passthrough fd). When
// the new size cannot be registered (a limit), the old region is
// deregistered anyway, since it no longer matches the file, and the buffer
// becomes Unregistered with Info.Reason saying why; Sync returns that
// error, and the next successful Sync or Resize registers again. An
// Unregistered buffer is retried at every Sync.
func (b *Buffer) Sync() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return fmt.Errorf("sync: %w", b.gone)
	}
	return b.syncLocked()
}

// syncLocked brings the registration in line with the memfd's size,
// trying again when a client changes it meanwhile.
func (b *Buffer) syncLocked() error {
	var err error
	for i := range maxRetries {
		if err = b.syncOnceLocked(i == maxRetries-1); !errors.Is(err, errRaced) {
			break
		}
	}
	return err
}

// syncedLocked runs op after a syncLocked, again when a client shrinking
// the memfd made op fail (op leaves the buffer as it was then).
func (b *Buffer) syncedLocked(op func() error) error {
	var err error
	for range maxRetries {
		_ = b.syncLocked() // a failure leaves a consistent state for op
		if err = op(); !errors.Is(err, errRaced) {
			break
		}
	}
	return err
}

// syncOnceLocked makes one attempt. After errRaced the buffer is as
// before, unless final: then it is Unregistered.
func (b *Buffer) syncOnceLocked(final bool) error {
	cur, err := memfdSize(b.fd)
	if err != nil {
		return err
	}
	if cur == b.size && b.state != Unregistered {
		return nil
	}
	switch {
	case cur == 0:
		// Truncated to nothing: the whole mapping is past EOF.
		err = b.dropAllLocked(false)
		if err != nil {
			return fmt.Errorf("sync to 0 B: %w", err)
		}
		return nil
	case b.state != Registered:
		err = b.mapAndRegisterLocked(cur)
	case cur > b.size:
		err = b.growLocked(cur)
	default:
		// Shrunk under us: the tail of our mapping is past EOF. Register
		// the part still inside, then unmap the rest; the daemon never
		// touches the mapping in between.
		err = b.shrinkLocked(cur)
	}
	if err == nil {
		return nil
	}
	err = fmt.Errorf("sync to %s: %w", formatSize(cur), err)
	if errors.Is(err, errRaced) && !final {
		// Nothing changed yet; the caller fstats again.
		return err
	}
	if uerr := b.unregisterLocked(cur, err); uerr != nil {
		return errors.Join(err, uerr)
	}
	b.m.log.Debug("buffer left unregistered", "size", cur, "reason", b.reason)
	return err
}

// unregisterLocked drops region and mapping after a size change that could
// not be registered: the buffer becomes Unregistered at size.
func (b *Buffer) unregisterLocked(size uint64, cause error) error {
	if b.mr != nil {
		if err := b.m.deregMR(b.mr, true); err != nil {
			return err // still registered at the old size; the next Sync retries
		}
		b.mr = nil
	}
	if err := b.mp.unmap(); err != nil {
		b.m.log.Error("leaking a buffer mapping", "err", err)
		b.mp = mapping{}
	}
	b.size, b.state, b.reason = size, Unregistered, reason(cause)
	return nil
}

// Resize sets the size and re-registers: new region first, then the old
// one deregistered. Keeps the first min(old, new) bytes. Resize(0)
// deregisters and unmaps everything (Empty). On failure the buffer keeps
// its previous state and size.
func (b *Buffer) Resize(size uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return fmt.Errorf("resize: %w", b.gone)
	}
	// Start from the size the kernel has: a client may have changed it.
	// A failure there leaves the buffer Unregistered, which resizing fixes.
	if err := b.syncedLocked(func() error { return b.resizeLocked(size) }); err != nil {
		return fmt.Errorf("resize to %s: %w", formatSize(size), err)
	}
	return nil
}

// resizeLocked sets the memfd's size to n and registers it. It expects
// b.size to be the memfd's size (syncLocked just ran).
func (b *Buffer) resizeLocked(n uint64) error {
	old := b.size
	switch {
	case n == old && b.state != Unregistered:
		return nil
	case n == 0:
		return b.dropAllLocked(true)
	case b.state != Registered:
		// Nothing mapped: map n bytes of the memfd and register them.
		// Grow the memfd first, shrink it only once registered.
		if n > old {
			if err := truncate(b.fd, n); err != nil {
				return err
			}
		}
		if err := b.mapAndRegisterLocked(n); err != nil {
			if n > old {
				b.undoTruncate(old)
			}
			b.size = old
			return err
		}
		if n < old {
			if err := truncate(b.fd, n); err != nil {
				// Keep the invariant: no registration past EOF.
				b.unregisterLocked(old, err)
				return err
			}
		}
		return nil
	case n > old:
		if err := truncate(b.fd, n); err != nil {
			return err
		}
		if err := b.growLocked(n); err != nil {
			b.undoTruncate(old)
			return err
		}
		return nil
	default:
		if err := b.shrinkLocked(n); err != nil {
			return err
		}
		// Only now, with nothing of ours past n, truncate the memfd.
		if err := truncate(b.fd, n); err != nil {
			// Registered at n while the file is longer: the next Sync
			// registers the rest.
			return err
		}
		return nil
	}
}

func (b *Buffer) undoTruncate(size uint64) {
	if err := truncate(b.fd, size); err != nil {
		b.m.log.Error("cannot undo a memfd resize", "size", size, "err", err)
	}
}

// mapAndRegisterLocked maps size bytes of the memfd and registers them,
// from a state with no mapping. On failure nothing is left mapped.
func (b *Buffer) mapAndRegisterLocked(size uint64) error {
	mp, err := mapMemfd(b.fd, size)
	if err != nil {
		return err
	}
	mr, err := b.m.regMR(b.fd, b.dom.pd, b.dom.handle, uintptr(mp.base), size, 0, b.access)
	if err != nil {
		mp.unmap()
		return err
	}
	b.mp, b.mr, b.size, b.state, b.reason = mp, mr, size, Registered, ""
	return nil
}

// growLocked re-registers a Registered buffer whose memfd is already n
// bytes (n > size): a new mapping of the whole memfd is registered, then
// the old region deregistered and the old mapping unmapped. Both mappings
// show the same pages, so the old region is valid until its dereg. On
// failure the buffer is as before.
func (b *Buffer) growLocked(n uint64) error {
	mp, err := mapMemfd(b.fd, n)
	if err != nil {
		return err
	}
	if err := b.replaceLocked(uintptr(mp.base), n, b.dom, b.access); err != nil {
		mp.unmap()
		return err
	}
	if err := b.mp.unmap(); err != nil {
		b.m.log.Error("leaking a buffer mapping", "err", err)
	}
	b.mp, b.size = mp, n
	return nil
}

// shrinkLocked re-registers the first n bytes (0 < n < size) of the
// current mapping, deregisters the old region, then unmaps the mapping's
// pages past n. It does not truncate the memfd. On failure the buffer is
// as before.
func (b *Buffer) shrinkLocked(n uint64) error {
	if err := b.replaceLocked(uintptr(b.mp.base), n, b.dom, b.access); err != nil {
		return err
	}
	if err := b.mp.shrink(n); err != nil {
		// Only address space is lost: the daemon never reads the tail.
		b.m.log.Error("cannot unmap the tail of a buffer mapping", "err", err)
	}
	b.size = n
	return nil
}

// replaceLocked registers [addr, addr+length) in d with access a, then
// deregisters the current region, if any, and installs the new one. On
// failure the current region stays registered and nothing else changed.
func (b *Buffer) replaceLocked(addr uintptr, length uint64, d *Domain, a verbs.Access) error {
	var oldLen uint64
	if b.mr != nil {
		oldLen = b.mr.Length()
	}
	mr, err := b.m.regMR(b.fd, d.pd, d.handle, addr, length, oldLen, a)
	if err != nil {
		return err
	}
	if b.mr != nil {
		if err := b.m.deregMR(b.mr, false); err != nil {
			// Keep the old region; take the new one back.
			if uerr := b.m.deregMR(mr, false); uerr != nil {
				b.m.log.Error("leaking a memory region", "lkey", mr.LKey(), "err", uerr)
			}
			b.m.charge(length, oldLen, false)
			return err
		}
	}
	b.mr, b.state, b.reason = mr, Registered, ""
	return nil
}

// dropAllLocked deregisters and unmaps everything, truncating the memfd
// to 0 when asked: the buffer becomes Empty.
func (b *Buffer) dropAllLocked(truncateFile bool) error {
	if b.mr != nil {
		if err := b.m.deregMR(b.mr, true); err != nil {
			return err
		}
		b.mr = nil
	}
	if err := b.mp.unmap(); err != nil {
		b.m.log.Error("leaking a buffer mapping", "err", err)
		b.mp = mapping{}
	}
	b.size, b.state, b.reason = 0, Empty, ""
	if truncateFile {
		return truncate(b.fd, 0)
	}
	return nil
}

// SetAccess re-registers with access a. EINVAL for an invalid set,
// EPERM outside Options.Allowed, EOPNOTSUPP when the device refuses it. A
// failure changes nothing. An Empty or Unregistered buffer just stores a
// for its next registration.
func (b *Buffer) SetAccess(a verbs.Access) error {
	if err := b.m.checkAccess(a); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return fmt.Errorf("set access: %w", b.gone)
	}
	err := b.syncedLocked(func() error {
		if b.state != Registered {
			return nil // stored for the next registration
		}
		// Register anew, then deregister the old region, rather than
		// MR.Rereg: a failed ibv_rereg_mr (ERR_CMD) leaves the region
		// unusable, which would break "a failed call changes nothing",
		// and this order also guarantees that the old keys die.
		return b.replaceLocked(uintptr(b.mp.base), b.size, b.dom, a)
	})
	if err != nil {
		return fmt.Errorf("set access %s: %w", a, err)
	}
	b.access = a
	return nil
}

// Move re-registers the buffer in d (register in d, then deregister the
// old region). Keys change. It keeps its access. On failure it stays
// where it was.
func (b *Buffer) Move(d *Domain) error {
	if d == nil {
		return fmt.Errorf("move: no domain: %w", syscall.EINVAL)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return fmt.Errorf("move: %w", b.gone)
	}
	if d == b.dom {
		return nil
	}
	m := b.m
	// Count b in d before registering there, so d cannot be closed
	// under a region in its PD.
	m.mu.Lock()
	err := m.reserveMove(d)
	m.mu.Unlock()
	if err != nil {
		return fmt.Errorf("move to pd %d: %w", d.handle, err)
	}
	err = b.syncedLocked(func() error {
		if b.state != Registered {
			return nil
		}
		return b.replaceLocked(uintptr(b.mp.base), b.size, d, b.access)
	})
	if err != nil {
		m.mu.Lock()
		d.nbuf--
		m.mu.Unlock()
		return fmt.Errorf("move to pd %d: %w", d.handle, err)
	}
	m.mu.Lock()
	b.dom.nbuf--
	m.mu.Unlock()
	b.dom = d
	return nil
}

// reserveMove counts one more buffer in d. Callers hold m.mu.
func (m *Manager) reserveMove(d *Domain) error {
	if d.m != m {
		return fmt.Errorf("domain belongs to another manager: %w", syscall.EINVAL)
	}
	if err := d.goneLocked(); err != nil {
		return err
	}
	d.nbuf++
	return nil
}

// ReadAt reads from the memfd (pread). Like pread, and unlike
// io.ReaderAt, a short read at end of file returns a nil error.
func (b *Buffer) ReadAt(p []byte, off int64) (int, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.gone != nil {
		return 0, fmt.Errorf("read: %w", b.gone)
	}
	n, err := unix.Pread(b.fd, p, off)
	if err != nil {
		return 0, fmt.Errorf("pread memfd at %d: %w", off, err)
	}
	return n, nil
}

// WriteAt writes to the memfd (pwrite), then Syncs. A write past the end
// first resizes the buffer, so one that would pass a limit fails (ENOSPC)
// before writing anything.
func (b *Buffer) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("write at %d: %w", off, syscall.EINVAL)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return 0, fmt.Errorf("write: %w", b.gone)
	}
	var old uint64
	err := b.syncedLocked(func() error {
		old = b.size
		if end := uint64(off) + uint64(len(p)); end > old {
			return b.resizeLocked(end)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("write %d bytes at %d: %w", len(p), off, err)
	}
	n, err := unix.Pwrite(b.fd, p, off)
	if err != nil {
		if b.size != old {
			if rerr := b.resizeLocked(old); rerr != nil {
				b.m.log.Error("cannot undo a resize after a failed write", "err", rerr)
			}
		}
		return 0, fmt.Errorf("pwrite memfd at %d: %w", off, err)
	}
	return n, b.syncLocked()
}

// Allocate is fallocate(2) on the memfd, then a Sync. When it extends
// the file (mode without FALLOC_FL_KEEP_SIZE), the buffer is resized
// first, so a limit fails cleanly before anything is allocated. After
// FALLOC_FL_PUNCH_HOLE the buffer is registered anew (keys change), since
// the old region pins the pages the hole removed from the file.
func (b *Buffer) Allocate(off, length uint64, mode uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return fmt.Errorf("fallocate: %w", b.gone)
	}
	var old uint64
	err := b.syncedLocked(func() error {
		old = b.size
		if end := off + length; mode&unix.FALLOC_FL_KEEP_SIZE == 0 && end > old {
			return b.resizeLocked(end)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("fallocate %d bytes at %d: %w", length, off, err)
	}
	if err := unix.Fallocate(b.fd, mode, int64(off), int64(length)); err != nil {
		if b.size != old {
			if rerr := b.resizeLocked(old); rerr != nil {
				b.m.log.Error("cannot undo a resize after a failed fallocate", "err", rerr)
			}
		}
		return fmt.Errorf("fallocate memfd mode 0x%x: %w", mode, err)
	}
	if err := b.syncLocked(); err != nil {
		return err
	}
	if mode&unix.FALLOC_FL_PUNCH_HOLE != 0 && b.state == Registered {
		// The hole's pages left the memfd, but the region still pins
		// them: the device would write where no mapping looks. Register
		// the pages the file holds now (new keys), then drop the old.
		if err := b.replaceLocked(uintptr(b.mp.base), b.size, b.dom, b.access); err != nil {
			return fmt.Errorf("re-register after punching a hole: %w", err)
		}
	}
	return nil
}

// Free deregisters the region (remote access ends at once), then unmaps
// and closes the memfd. Later calls on the buffer fail with ENOENT; Info
// still works. If deregistration fails, nothing is unmapped (the device
// could still write there) and the error is returned.
func (b *Buffer) Free() error {
	_, err := b.free(errFreed)
	return err
}

// free is Free; it returns the bytes (whole pages) of the region it
// deregistered, 0 when there was none.
func (b *Buffer) free(gone error) (unpinned uint64, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != nil {
		return 0, fmt.Errorf("free: %w", b.gone)
	}
	if b.mr != nil {
		n := b.mr.Length()
		if err := b.m.deregMR(b.mr, true); err != nil {
			return 0, fmt.Errorf("free: %w", err)
		}
		unpinned = pageRound(n)
		b.mr = nil
	}
	if err := b.mp.unmap(); err != nil {
		b.m.log.Error("leaking a buffer mapping", "err", err)
		b.mp = mapping{}
	}
	if err := unix.Close(b.fd); err != nil {
		b.m.log.Error("closing a memfd", "err", err)
	}
	b.fd, b.state, b.reason, b.gone = -1, Empty, "", gone
	b.m.mu.Lock()
	delete(b.m.buffers, b)
	b.dom.nbuf--
	b.m.mu.Unlock()
	return unpinned, nil
}
