package buffer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
)

// Every page the store holds is someone's: a buffer's charge is the store
// memory its owner pays for, against max_pinned_per_user and against the
// budget (max_pinned). An operation that may add pages first charges what
// it may add (admit, in limits.go), as one step with every check; once
// done, settle sets the charge to what the file really holds. Pages the
// daemon does not see being made (a client's write past the end through a
// zero-copy open, bounded by the store's own size) are charged when it
// next looks at the file: at every getattr, getxattr, flush and release,
// and before admission refuses because the store is fuller than charged.
//
// An unlinked file that a client still holds open or mapped keeps its
// pages, and its charge, until nothing holds it: no descriptor open and
// no inode of the kernel's that a zero-copy open may have left mapped
// (HoldInode). A mapping outlives its descriptor: FUSE passthrough maps
// the daemon's own file, so RELEASE comes at the client's close, while
// the kernel's inode stays until the munmap (its FORGET). Then no client
// can reach the file: the daemon frees what it still holds (truncates the
// file through the last descriptor, gives a slot back to its pool)
// before it drops the charge.

// settleLocked ends an operation on b: its charge becomes held, the bytes
// its file holds now (unless known is false: the file could not be looked
// at, and the charge stays), and the memory the operation reserved is no
// longer in flight. Callers hold b.mu.
func (b *Buffer) settleLocked(held uint64, known bool) {
	m := b.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if known {
		m.setChargeLocked(b, held)
	}
	m.inflight -= b.reserved
	b.reserved = 0
}

// settleFileLocked is settleLocked with the file's own count. Callers
// hold b.mu.
func (b *Buffer) settleFileLocked() {
	var held uint64
	err := errFreed
	if b.f != nil {
		_, held, err = b.f.Stat()
	}
	if b.src != nil && b.regs == nil {
		// Memory brought is charged while registered only: its pages
		// are its owner's, pinned by nobody once deregistered (stale,
		// freed).
		held, err = 0, nil
	}
	b.settleLocked(held, err == nil)
}

// setChargeLocked moves b's charge, and its owner's and the total, to n.
// Callers hold m.mu (and b.mu, but for an orphan: its last close and
// chargeUnseen charge it under m.mu alone).
func (m *Manager) setChargeLocked(b *Buffer, n uint64) {
	old := b.charge.Load()
	u := m.user(b.owner)
	u.Charged = u.Charged - old + n
	m.charged = m.charged - old + n
	if b.orphan {
		u.Orphaned = u.Orphaned - old + n
		m.orphaned = m.orphaned - old + n
	}
	b.charge.Store(n)
	m.unuse(b.owner)
}

// Charged is the store memory charged to b's owner for it: what its file
// held when the daemon last looked, or what an operation in progress may
// make it hold.
func (b *Buffer) Charged() uint64 { return b.charge.Load() }

// orphanLocked makes b, being freed while clients still hold it (open or
// mapped), an orphan: its memory stays charged until nothing holds it.
// Callers hold b.mu and m.mu.
func (m *Manager) orphanLocked(b *Buffer) {
	b.orphan = true
	m.orphans++
	m.orphaned += b.charge.Load()
	m.user(b.owner).Orphaned += b.charge.Load()
}

// releasedLocked drops the charge of an orphan whose memory is gone, and
// wakes admissions waiting for memory. Callers hold m.mu.
func (m *Manager) releasedLocked(b *Buffer) {
	m.setChargeLocked(b, 0)
	b.orphan = false
	m.orphans--
	// The reading of MemAvailable stays: it only misses memory freed, and
	// is read again whenever it leaves too little (memoryLeftLocked).
	// Every removed file opened zero-copy ends here, so reading it afresh
	// each time cost the next registration a /proc read.
	close(m.releases)
	m.releases = make(chan struct{})
}

// Fd is a client's descriptor of a buffer's file (the daemon keeps none
// per buffer). It stays valid after Free: a client that had the file open
// keeps its memory, and the calls of this type act on it then as they do
// on any unlinked file, charged to the owner as before.
type Fd struct {
	N        int
	b        *Buffer
	writable bool
	once     sync.Once
}

// Open gives a client's open its own descriptor of the file, counted
// against what RLIMIT_NOFILE leaves clients: past it EMFILE, logged as
// that limit, and nothing else is touched. writable says the client may
// write (its writes past the end are looked for when the store is
// fuller than charged). ENOENT once freed.
func (b *Buffer) Open(writable bool) (*Fd, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.gone != alive {
		return nil, fmt.Errorf("open: %w", b.gone.err())
	}
	if writable && b.src != nil && !b.src.Writable() {
		return nil, fmt.Errorf("open for writing: %s is registered read-only: %w", b.src.Path(), syscall.EACCES)
	}
	m := b.m
	m.mu.Lock()
	if m.openFds >= m.maxOpenFds {
		m.mu.Unlock()
		return nil, fmt.Errorf("open: %w", m.classifyFd(fmt.Errorf("%d clients' descriptors open: %w", m.maxOpenFds, syscall.EMFILE)))
	}
	m.openFds++
	m.mu.Unlock()
	fd, err := b.f.Open()
	m.mu.Lock()
	if err != nil {
		m.openFds--
		m.mu.Unlock() // classifyFd takes it
		return nil, fmt.Errorf("open: %w", m.classifyFd(err))
	}
	defer m.mu.Unlock()
	b.opens++
	if writable {
		b.writers++
		m.writers[b] = struct{}{}
	}
	return &Fd{N: fd, b: b, writable: writable}, nil
}

// Close closes the descriptor (once). The last descriptor of an unlinked
// file frees its memory first: no client can reach it any more.
func (f *Fd) Close() {
	f.once.Do(func() {
		b, m := f.b, f.b.m
		m.mu.Lock()
		b.opens--
		if f.writable {
			if b.writers--; b.writers == 0 {
				delete(m.writers, b)
			}
		}
		last := b.unheldLocked()
		keep := !last && b.opens == 0 && b.keepsLocked()
		if keep {
			m.kept[b] = f.N
		} else {
			m.openFds--
		}
		m.mu.Unlock()
		switch {
		case last:
			b.freeMemory(func() error { return unix.Ftruncate(f.N, 0) }, true)
			unix.Close(f.N)
			b.released()
		case !keep:
			unix.Close(f.N)
		}
	})
}

// keepsLocked says whether b is an orphan whose memory the daemon frees
// itself when nothing holds it: through a descriptor it keeps (m.kept)
// while only the kernel's inodes hold it. A pool slot is given back
// instead, and a source's memory is its owner's. Callers hold m.mu.
func (b *Buffer) keepsLocked() bool {
	return b.orphan && b.inodes > 0 && b.slot == nil && b.src == nil
}

// HoldInode keeps b's memory, and its charge, while the kernel holds the
// inode of a file a client opened zero-copy, until release (at the
// kernel's FORGET of it). Such a client may map the file, and its mapping
// outlives its descriptor: FUSE passthrough maps the daemon's own file,
// so RELEASE comes at the close while the pages are still mapped, and the
// kernel's inode stays until the munmap. Called while a descriptor of b is
// open. release is quick and idempotent; when it ends the last hold of a
// removed file it returns free, which frees the memory (it may truncate
// or zero gigabytes: the caller runs it where that may take a while) and
// then drops the charge.
func (b *Buffer) HoldInode() (release func() (free func())) {
	m := b.m
	m.mu.Lock()
	b.inodes++
	m.mu.Unlock()
	var once sync.Once
	return func() (free func()) {
		once.Do(func() {
			m.mu.Lock()
			b.inodes--
			last := b.unheldLocked()
			fd, kept := m.kept[b]
			if last && kept {
				delete(m.kept, b)
				m.openFds--
			}
			m.mu.Unlock()
			if !last {
				return
			}
			// No mapping is left: the memory goes now, before its
			// charge (the kernel would free it only once every
			// reference of its own is gone).
			free = func() {
				b.freeMemory(func() error {
					if !kept {
						return nil // a descriptor could not be kept: the kernel frees it
					}
					defer unix.Close(fd)
					return unix.Ftruncate(fd, 0)
				}, true)
				b.released()
			}
		})
		return free
	}
}

// unheldLocked says whether b is an orphan that nothing holds any more:
// its memory goes now. Callers hold m.mu.
func (b *Buffer) unheldLocked() bool {
	return b.orphan && b.opens == 0 && b.inodes == 0
}

// released drops the charge of an orphan whose memory is gone.
func (b *Buffer) released() {
	b.m.mu.Lock()
	b.m.releasedLocked(b)
	b.m.mu.Unlock()
}

// orphaned runs op on b under b.mu when b was freed (an unlinked file
// still open through f); it returns false, with nothing done, while b
// lives.
func (f *Fd) orphaned(op func() error) (bool, error) {
	b := f.b
	// Shared for the look, as the calls on a live buffer take it: reads
	// through direct-I/O handles go on side by side. Once gone, b stays so.
	b.mu.RLock()
	live := b.gone == alive
	b.mu.RUnlock()
	if live {
		return false, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != freed {
		return true, b.gone.err() // the manager closed
	}
	return true, op()
}

// live runs op, a call on the buffer, unless the buffer was freed before
// or meanwhile: then orphan runs instead.
func (f *Fd) live(op func() error, orphan func() error) error {
	if done, err := f.orphaned(orphan); done {
		return err
	}
	err := op()
	if errors.Is(err, errFreed) {
		if done, oerr := f.orphaned(orphan); done {
			return oerr
		}
	}
	return err
}

// stat is the descriptor's file size and memory held.
func (f *Fd) stat() (size, held uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(f.N, &st); err != nil {
		return 0, 0, fmt.Errorf("fstat: %w", err)
	}
	return uint64(st.Size), uint64(st.Blocks) * 512, nil
}

// Size is the file's size as this descriptor sees it.
func (f *Fd) Size() (uint64, error) {
	size, _, err := f.stat()
	return size, err
}

// Truncate is ftruncate through this open: Resize while the buffer
// lives; afterwards the unlinked file's own size changes (nothing is
// registered: a larger size is sparse and adds no memory).
func (f *Fd) Truncate(ctx context.Context, size uint64) error {
	return f.live(func() error { return f.b.Resize(ctx, size) }, func() error {
		if f.b.slot != nil {
			return slotFile{f.b.slot}.Truncate(size)
		}
		defer f.settleLocked()
		if err := unix.Ftruncate(f.N, int64(size)); err != nil {
			return fmt.Errorf("ftruncate an unlinked file to %s: %w", bytesize.Format(size), err)
		}
		return nil
	})
}

// Allocate is fallocate through this open: the buffer's Allocate while it
// lives; afterwards the pages it may add are admitted and charged to the
// owner first, as for any buffer.
func (f *Fd) Allocate(ctx context.Context, off, length uint64, mode uint32) error {
	return f.live(func() error { return f.b.Allocate(ctx, off, length, mode) }, func() error {
		if f.b.slot != nil {
			return slotFile{f.b.slot}.Allocate(mode, off, length)
		}
		defer f.settleLocked()
		var add uint64
		if mode&unix.FALLOC_FL_PUNCH_HOLE == 0 {
			size, held, err := f.stat()
			if err != nil {
				return err
			}
			if add, err = f.b.allocAdds(holesOf(f.N), size, off, length); err != nil {
				return err
			}
			if err := f.b.m.admit(f.b, held, add, true); err != nil {
				return fmt.Errorf("fallocate an unlinked file: %w", err)
			}
		}
		err := f.b.m.fill(f.b, add, func() error { return unix.Fallocate(f.N, mode, int64(off), int64(length)) })
		if err != nil {
			return fmt.Errorf("fallocate an unlinked file: %w", err)
		}
		return nil
	})
}

// ReadAt is pread through this open.
func (f *Fd) ReadAt(p []byte, off int64) (int, error) {
	var n int
	err := f.live(func() (err error) {
		n, err = f.b.ReadAt(p, off)
		return err
	}, func() (err error) {
		n, err = unix.Pread(f.N, p, off)
		if err != nil {
			return fmt.Errorf("pread an unlinked file: %w", err)
		}
		return nil
	})
	return n, err
}

// WriteAt is pwrite through this open (degraded mode: direct I/O): the
// buffer's WriteAt while it lives; afterwards the pages the write may add
// are admitted and charged first.
func (f *Fd) WriteAt(p []byte, off int64) (int, error) {
	var n int
	err := f.live(func() (err error) {
		n, err = f.b.WriteAt(p, off)
		return err
	}, func() error {
		if off < 0 {
			return fmt.Errorf("write at %d: %w", off, syscall.EINVAL)
		}
		if f.b.slot != nil {
			// Sealed: nothing past the slot, and nothing to charge.
			var err error
			if n, err = unix.Pwrite(f.N, p, off); err != nil {
				return fmt.Errorf("pwrite an unlinked pool file: %w", err)
			}
			return nil
		}
		defer f.settleLocked()
		size, held, err := f.stat()
		if err != nil {
			return err
		}
		add, err := f.b.allocAdds(holesOf(f.N), size, uint64(off), uint64(len(p)))
		if err != nil {
			return err
		}
		if err := f.b.m.admit(f.b, held, add, true); err != nil {
			return fmt.Errorf("write to an unlinked file: %w", err)
		}
		if n, err = unix.Pwrite(f.N, p, off); err != nil {
			return fmt.Errorf("pwrite an unlinked file: %w", err)
		}
		return nil
	})
	return n, err
}

// Seek is lseek through this open (SEEK_DATA and SEEK_HOLE come to the
// daemon).
func (f *Fd) Seek(off int64, whence int) (int64, error) {
	return unix.Seek(f.N, off, whence)
}

// Sync learns what the file holds: the buffer's Sync while it lives
// (which re-registers a size a client changed); afterwards the unlinked
// file's charge follows what the client wrote.
func (f *Fd) Sync() error {
	return f.live(f.b.Sync, func() error {
		f.settleLocked()
		return nil
	})
}

// settleLocked charges the owner of an unlinked file what it holds.
// Callers hold b.mu.
func (f *Fd) settleLocked() {
	if f.b.slot != nil {
		return // the pool pays for its slots
	}
	_, held, err := f.stat()
	f.b.settleLocked(held, err == nil)
}

// SetOwner charges the buffer to uid from now on (chown, also of an
// unlinked file still open): its charge moves to uid, whose quota must
// hold it (EDQUOT), as do its registered bytes. On failure nothing
// changes.
func (b *Buffer) SetOwner(uid uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	m := b.m
	m.mu.Lock()
	defer m.mu.Unlock()
	// Under m.mu: the last close of an orphan ends it there.
	if b.gone != alive && !b.orphan {
		return fmt.Errorf("chown: %w", b.gone.err())
	}
	if uid == b.owner {
		return nil
	}
	if b.slot != nil {
		// Nothing charged of its own: only the file count moves.
		if !b.orphan {
			m.user(b.owner).Buffers--
			m.user(uid).Buffers++
		}
		m.unuse(b.owner)
		b.owner = uid
		return nil
	}
	n := b.regs.length()
	charge := b.charge.Load()
	q := m.opt.MaxPinnedPerUser
	over := func() bool { return q > 0 && charge > 0 && m.user(uid).Charged+charge > q }
	// As admission does (admit): uid's files removed a moment ago may be
	// held only until the kernel's RELEASE or FORGET reaches the daemon.
	for deadline := time.Now().Add(releaseWait); over() && m.user(uid).Orphaned > 0 && m.waitReleaseLocked(deadline); {
		m.unuse(uid)
		if b.gone != alive && !b.orphan {
			return fmt.Errorf("chown: %w", b.gone.err())
		}
		charge = b.charge.Load()
	}
	if over() {
		held := m.users[uid].Charged
		m.unuse(uid)
		return fmt.Errorf("chown to uid %d: %w", uid, m.refuseLocked(limitPerUser, syscall.EDQUOT,
			fmt.Sprintf("max_pinned_per_user (%s) of uid %d reached", bytesize.Format(q), uid),
			fmt.Sprintf("cannot give uid %d a buffer of %s: it holds %s of its max_pinned_per_user (%s)", uid, bytesize.Format(charge), bytesize.Format(held), bytesize.Format(q)),
			"value", q, "uid", uid))
	}
	m.setChargeLocked(b, 0)
	m.pinLocked(b.owner, n, 0)
	if !b.orphan {
		m.user(b.owner).Buffers--
		m.user(uid).Buffers++
	}
	m.unuse(b.owner)
	b.owner = uid
	m.setChargeLocked(b, charge)
	m.pinLocked(uid, 0, n)
	b.keptChangedLocked()
	return nil
}

// chargeUnseen charges, to their owners, what clients wrote through
// zero-copy opens since the daemon last looked, and takes back what they
// wrote past their owners' quotas (cutLocked): the buffers with writable
// opens other than skip. A busy one (an operation holds it) is tried
// again for a little while, never waited for: its holder could be waiting
// for skip's lock, which skip's caller holds. Unlinked files only a
// mapping holds (m.kept) are charged what they hold too: a mapping can
// fill their holes, and nothing is taken back from one (its pages are
// the client's own to read).
func (m *Manager) chargeUnseen(skip *Buffer) {
	m.mu.Lock()
	// Under m.mu a kept descriptor is open: its release takes it out of
	// m.kept under m.mu before closing it.
	for b, fd := range m.kept {
		var st unix.Stat_t
		if unix.Fstat(fd, &st) == nil {
			m.setChargeLocked(b, uint64(st.Blocks)*512)
		}
	}
	ws := make([]*Buffer, 0, len(m.writers))
	for b := range m.writers {
		if b != skip {
			ws = append(ws, b)
		}
	}
	m.mu.Unlock()
	deadline := time.Now().Add(unseenWait)
	for len(ws) > 0 {
		busy := ws[:0]
		for _, b := range ws {
			if !b.mu.TryLock() {
				busy = append(busy, b)
				continue
			}
			if b.gone == alive {
				b.settleFileLocked()
				b.cutLocked()
			}
			b.mu.Unlock()
		}
		if ws = busy; len(ws) == 0 || time.Now().After(deadline) {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// unseenWait bounds how long chargeUnseen tries busy buffers again.
const unseenWait = 20 * time.Millisecond

// Writes past the end through a zero-copy open are the one way to add
// memory the daemon does not see first, and the kernel bounds them only
// by the store. So what they add past the owner's quota is taken back:
// at the writer's close (Flush), and when another call needs the room
// (chargeUnseen); the writer's close then fails with EDQUOT, as a write
// past a quota does elsewhere, only later.

// errCut is the writer's word that its writes past the end were taken
// back: they passed its owner's quota.
var errCut = fmt.Errorf("written past max_pinned_per_user through a zero-copy open; cut back: %w", syscall.EDQUOT)

// cutLocked takes the file back to its registered length when its owner
// holds more than its quota and the file grew past that length unseen,
// and says whether it did. Callers hold b.mu.
func (b *Buffer) cutLocked() bool {
	m := b.m
	quota := m.opt.MaxPinnedPerUser
	if quota == 0 || b.gone != alive || b.slot != nil {
		return false
	}
	m.mu.Lock()
	over := m.user(b.owner).Charged > quota
	m.unuse(b.owner)
	m.mu.Unlock()
	keep := b.regs.length()
	size, _, err := b.f.Stat()
	if !over || err != nil || size <= keep {
		return false
	}
	if err := b.f.Truncate(keep); err != nil {
		m.log.Error("cannot take back writes past a quota", "err", err)
		return false
	}
	b.size, b.reason, b.cut = keep, "", true
	b.settleFileLocked()
	m.events.LimitHit(string(limitPerUser))
	m.mu.Lock()
	defer m.mu.Unlock()
	// Its own line in the log, rate-limited apart from the quota's
	// refusals: bytes a client wrote were dropped.
	if t := now(); t.Sub(m.warned[limitCut]) >= warnEvery || m.warned[limitCut].IsZero() {
		m.warned[limitCut] = t
		m.log.Warn(fmt.Sprintf("uid %d wrote %s past the end of a file through a zero-copy open, past its max_pinned_per_user (%s): taken back; the writer's close fails with EDQUOT", b.owner, bytesize.Format(size-keep), bytesize.Format(quota)),
			"limit", string(limitPerUser), "value", quota, "uid", b.owner, "cut", size-keep)
	}
	return true
}

// Flush is a writer's close: Sync, and what the client wrote past the
// owner's quota through its zero-copy open is taken back (cutLocked), so
// that it does not outlive the close: EDQUOT then (also when another
// call took it back meanwhile: the buffer's next writer to close is told).
// It waits for a registration under way, which may be of what this
// client wrote.
func (b *Buffer) Flush() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return fmt.Errorf("flush: %w", b.gone.err())
	}
	if b.slot != nil {
		return nil
	}
	err := b.syncLocked()
	if b.cutLocked() || b.cut {
		b.cut = false
		return fmt.Errorf("flush: %w", errCut)
	}
	if err != nil && b.src == nil && !b.coveredLocked() {
		return b.cutTailLocked(err)
	}
	return err
}

// cutTailLocked takes the file back to its registered length at a
// writer's close when it grew unseen past what could be registered (err
// says why): what is not registered does not outlive the close. A mapping
// does, and could fill the tail's holes with pages nobody is charged for.
// Callers hold b.mu.
func (b *Buffer) cutTailLocked(err error) error {
	keep := b.regs.length()
	if terr := b.f.Truncate(keep); terr != nil {
		return fmt.Errorf("flush: %w", errors.Join(err, terr))
	}
	b.size, b.reason = keep, ""
	b.settleFileLocked()
	m := b.m
	m.mu.Lock()
	// Rate-limited with the quota's cuts: a client can repeat it at will.
	if t := now(); t.Sub(m.warned[limitCut]) >= warnEvery || m.warned[limitCut].IsZero() {
		m.warned[limitCut] = t
		m.log.Warn(fmt.Sprintf("uid %d wrote past the end of a file through a zero-copy open, more than could be registered: taken back to the %s registered at the writer's close", b.owner, bytesize.Format(keep)),
			"uid", b.owner, "kept", keep, "err", err)
	}
	m.mu.Unlock()
	return fmt.Errorf("flush: %w; taken back to the %s registered", err, bytesize.Format(keep))
}
