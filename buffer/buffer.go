package buffer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/store"
	"mrfs/verbs"
)

// Buffer is one file of the store, the daemon's mapping of it, and the
// registration of that mapping.
//
// Invariants while the buffer lives (gone == nil):
//   - charge covers every page the file holds but those a client made
//     since the daemon last looked (a write past the end through a
//     zero-copy open).
//   - regs == nil: nothing is mapped (mp is empty); the buffer is Empty
//     when size is 0, else Unregistered and reason says why.
//   - regs != nil: regs cover [mp.base, mp.base+regs.length()) in order,
//     mp.len is pageRound(regs.length()), and regs.length() <= size. Less
//     only when a client grew the file past what could be registered:
//     reason says why, and the registration that was there stays.
//   - size is the file's size as last learned.
type Buffer struct {
	m *Manager // immutable

	mu sync.RWMutex
	// guards: every field below (owner is written under m.mu too, which
	// an orphan's last close reads it under).
	f      store.File // nil once freed
	mp     mapping    // the daemon's mapping of the file
	regs   regions    // nil unless registered
	size   uint64
	dom    *Domain
	reason string
	access verbs.Access
	owner  uint32
	gen    uint32 // registrations made
	gone   gone   // set once freed

	cut bool // guarded by mu: writes past the quota were taken back since the last Flush

	// guarded by m.mu: the clients' descriptors open (Fd) and how many of
	// them may write; orphan: freed while open (its memory is still
	// charged); reserved: the pages admitted for the operation under way
	// (part of m.inflight).
	// inodes: the kernel's inodes of the file that hold its memory
	// (HoldInode), one per go-fuse node: go-fuse keeps one node per inode
	// number, so two while a forgotten one's release is on its way (a
	// byte, so that Buffer stays in its size class).
	orphan         bool
	inodes         uint8
	opens, writers int32
	reserved       uint64

	// charge is the store memory charged to owner for the file (see
	// charge.go): written under m.mu (and mu, but for an orphan's
	// release), read under either or atomically.
	charge atomic.Uint64
	// slot is set, at creation, for a pool file (slot.go); src for a
	// file registered in place (inplace.go).
	slot *slotRef
	src  *inPlace

	pageSize atomic.Uint32 // PageSize's answer; 0: not learned since the last registration
	// busy is set, while mu is held, for a registration that takes a
	// while: Info, Regions, PageSize and Sync answer from it rather than
	// wait (lockOrBusy).
	busy atomic.Pointer[busy]

	aux any // set once by SetAux, before anyone else knows the buffer
}

// gone says whether a buffer was freed, and why: the field is a byte
// rather than the error itself, since every buffer carries it.
type gone uint8

const (
	alive  gone = iota
	freed       // errFreed
	closed      // errClosed: the manager closed
)

// err is the error an operation on a buffer gone this way fails with.
func (g gone) err() error {
	switch g {
	case freed:
		return errFreed
	case closed:
		return errClosed
	}
	return nil
}

// SetAux keeps the namespace's object for b (tree: its File), for those
// who hear of b through Events.Changed. Call it once, before the buffer
// is published.
func (b *Buffer) SetAux(v any) { b.aux = v }

// Aux is what SetAux kept.
func (b *Buffer) Aux() any { return b.aux }

// lockOrBusy takes mu, for writing or for reading, unless a long
// registration is under way: then it takes nothing and returns that
// registration's busy. The registration holds mu from before it can
// publish busy, so waiting on mu could mean waiting for all of it
// (seconds for gigabytes): the lock is only tried, and busy looked at
// again, with a backoff, until one or the other comes.
func (b *Buffer) lockOrBusy(write bool) *busy {
	wait := 20 * time.Microsecond
	for {
		if bs := b.busy.Load(); bs != nil {
			return bs
		}
		if write && b.mu.TryLock() || !write && b.mu.TryRLock() {
			return nil
		}
		time.Sleep(wait)
		wait = min(2*wait, time.Millisecond)
	}
}

// busy is a registration under way and what the buffer was before it.
type busy struct {
	info Info
	regs []Region
	prog progress
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
	case Stale:
		return "stale"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Create makes a buffer of size bytes in d with d's default access,
// owned (charged to) uid owner, registered at once when size > 0. ENOSPC
// past MaxBuffers; the limits of registration as Resize. A failed Create
// leaves nothing behind.
func (m *Manager) Create(d *Domain, size uint64, owner uint32) (*Buffer, error) {
	if d == nil {
		return nil, fmt.Errorf("create buffer: no domain: %w", syscall.EINVAL)
	}
	if p := d.Pool(); p != nil {
		return m.createSlot(p, owner)
	}
	b := &Buffer{m: m, dom: d, owner: owner}
	// b is in the manager's set before it is built, so a concurrent
	// Manager.Close sees it; holding b.mu makes that Close wait for us.
	b.mu.Lock()
	defer b.mu.Unlock()
	id, err := m.reserveBuffer(b, d, owner, 0)
	if err != nil {
		return nil, fmt.Errorf("create buffer in pd %d: %w", d.handle, err)
	}

	f, err := m.store.Create(id)
	if err != nil {
		b.abandonLocked()
		return nil, fmt.Errorf("create buffer: %w", m.classifyFd(err))
	}
	b.f = f
	if size > 0 {
		err := f.Truncate(size)
		if err == nil {
			err = b.registerLocked(context.Background(), size, b.dom, b.access)
		}
		if err != nil {
			b.abandonLocked()
			return nil, fmt.Errorf("create buffer of %s: %w", bytesize.Format(size), err)
		}
		b.size = size
		b.settleFileLocked()
	}
	return b, nil
}

// abandonLocked undoes a Create that failed after its reservation. Nobody
// else has the file: its memory goes with its name.
func (b *Buffer) abandonLocked() {
	if b.f != nil {
		if err := b.f.Remove(); err != nil {
			b.m.log.Error("removing the file of a buffer that could not be made", "err", err)
		}
		b.f = nil
	}
	b.gone = freed
	b.m.mu.Lock()
	b.m.unaccountLocked(b)
	b.m.mu.Unlock()
}

// unaccountLocked uncharges b, ends what it had in flight and takes it out of
// the manager's set: a buffer that never was (abandonLocked) or that a
// process leaves to its successor (leave). Callers hold m.mu.
func (m *Manager) unaccountLocked(b *Buffer) {
	m.setChargeLocked(b, 0)
	m.inflight -= b.reserved
	b.reserved = 0
	m.forgetLocked(b)
}

// forgetLocked takes b, freed or never made, out of the manager's set
// and counts. Callers hold m.mu.
func (m *Manager) forgetLocked(b *Buffer) {
	delete(m.buffers, b)
	delete(m.sources, b)
	b.dom.nbuf--
	m.user(b.owner).Buffers--
	m.unuse(b.owner)
}

// freeMemory frees the memory of a freed file that no client has any
// more: a pool file's slot goes back to its pool, zeroed; any other file
// is truncated to nothing with truncate. released: at the end of the
// last hold of a file unlinked while held (charge.go).
func (b *Buffer) freeMemory(truncate func() error, released bool) {
	if b.slot != nil {
		b.slot.p.give(b.slot.i, released)
		return
	}
	if b.src != nil {
		return // the source's memory stays its owner's
	}
	if err := truncate(); err != nil {
		b.m.log.Error("freeing the memory of a removed file", "err", err)
	}
}

// Info returns a snapshot. After Free it reports the last size with
// State Empty.
func (b *Buffer) Info() Info {
	in, _ := b.Regions()
	return in
}

// Regions returns Info and the regions of the registration, from one
// snapshot.
func (b *Buffer) Regions() (Info, []Region) {
	if bs := b.lockOrBusy(false); bs != nil {
		in := bs.info
		in.Progress = Progress{Done: bs.prog.done.Load(), Total: bs.prog.total}
		return in, bs.regs
	}
	defer b.mu.RUnlock()
	if b.slot != nil {
		return b.infoLocked(), b.slotRegionsLocked()
	}
	return b.infoLocked(), b.regs.list()
}

func (b *Buffer) infoLocked() Info {
	in := Info{
		Size:       b.size,
		State:      b.stateLocked(),
		Reason:     b.reason,
		Access:     b.access,
		PD:         b.dom.handle,
		Owner:      b.owner,
		Generation: uint64(b.gen),
	}
	if len(b.regs) > 0 {
		in.Length, in.Regions = b.regs.length(), len(b.regs)
		in.LKey, in.RKey, in.Addr = b.regs[0].LKey(), b.regs[0].RKey(), b.regs[0].Addr()
	}
	if b.slot != nil {
		b.slotInfoLocked(&in)
	}
	if b.src != nil {
		in.Source = &SourceInfo{Path: b.src.Path(), Kind: b.src.Kind()}
	}
	return in
}

// PageSize is the size of the pages behind the registration (2 MiB for
// transparent huge pages), 0 when not registered or unknown. It is
// learned from the kernel on first use after each registration: pinned
// pages stay what they are.
func (b *Buffer) PageSize() uint64 {
	if ps := b.pageSize.Load(); ps != 0 {
		return uint64(ps)
	}
	if b.lockOrBusy(false) != nil {
		return 0 // not learned until the registration is done
	}
	defer b.mu.RUnlock()
	base := b.mp.base
	if b.slot != nil {
		base = b.slot.addr
	} else if b.regs == nil {
		return 0
	}
	ps, _ := store.PageSizeAt(base)
	b.pageSize.Store(uint32(ps)) // a page is at most 1 GiB
	return ps
}

func (b *Buffer) stateLocked() State {
	switch {
	case b.gone != alive || b.size == 0 && b.regs == nil:
		return Empty
	case b.regs != nil:
		return Registered
	case b.src != nil && b.src.stale:
		return Stale
	}
	return Unregistered
}

// Domain is the domain the buffer is registered in.
func (b *Buffer) Domain() *Domain {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.dom
}

// coveredLocked says whether the registration is what the file needs:
// the whole file, or nothing for an empty one.
func (b *Buffer) coveredLocked() bool {
	if b.regs == nil {
		return b.size == 0
	}
	return b.regs.length() == b.size
}

// Sync learns the file's size and re-registers when it changed (a client
// wrote past the end through a zero-copy open). When the new size cannot
// be registered (a limit), the registration that was there stays (its
// range is still the file's first bytes), Info.Reason says why, and Sync
// returns the error; every later Sync tries again. During a long
// registration it returns at once: that one learns the size when done.
func (b *Buffer) Sync() error {
	if b.lockOrBusy(true) != nil {
		return nil
	}
	defer b.mu.Unlock()
	if b.gone != alive {
		return fmt.Errorf("sync: %w", b.gone.err())
	}
	if b.slot != nil {
		return nil // sealed: its size cannot change
	}
	return b.syncLocked()
}

// syncLocked brings the registration in line with the file's size,
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
// the file made op fail (op leaves the buffer as it was then).
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
// before, unless final.
func (b *Buffer) syncOnceLocked(final bool) error {
	if b.src != nil {
		return b.syncSourceLocked()
	}
	cur, held, err := b.f.Stat()
	if err != nil {
		return err
	}
	if cur == b.size && b.coveredLocked() {
		if held != b.charge.Load() {
			b.settleLocked(held, true) // a client wrote into a hole, or past the end and back
		}
		return nil
	}
	if cur == 0 {
		// Truncated to nothing: the whole mapping is past the end.
		if err := b.dropLocked(); err != nil {
			return fmt.Errorf("sync to 0 B: %w", err)
		}
		b.size = 0
		return nil
	}
	err = b.registerLocked(context.Background(), cur, b.dom, b.access)
	b.settleFileLocked() // what a client wrote is its owner's, registered or not
	if err == nil {
		b.size, b.reason = cur, ""
		return nil
	}
	err = fmt.Errorf("sync to %s: %w", bytesize.Format(cur), err)
	if errors.Is(err, errRaced) && !final {
		return err // nothing changed yet; the caller looks again
	}
	if b.regs != nil && b.regs.length() > cur {
		// The file shrank under the registration (only a client outside
		// mrfs's own calls could): no region may reach past the end.
		if derr := b.dropLocked(); derr != nil {
			return errors.Join(err, derr)
		}
	}
	b.size, b.reason = cur, reason(err)
	b.m.log.Debug("registration does not cover the file", "size", cur, "reason", b.reason)
	return err
}

// registerLocked makes the registration cover exactly [0, n) of the file
// (whose size is at least n) in d with access a: the new regions are
// registered first, then the old ones deregistered. A smaller n reuses the
// current mapping and unmaps its tail afterwards; a larger one maps the
// file anew. What the registration may add to the file's memory is
// admitted and charged first (admit); the caller settles the charge when
// its operation is done. On failure, or when ctx ends first, the buffer is
// as before.
func (b *Buffer) registerLocked(ctx context.Context, n uint64, d *Domain, a verbs.Access) error {
	m := b.m
	oldLen := b.regs.length()
	reuse := b.regs != nil && n <= oldLen
	grows := n > oldLen
	if err := m.tooLarge(n, b.owner); err != nil {
		return err // before mapping: see tooLarge
	}
	_, held, err := b.f.Stat()
	if err != nil {
		return err
	}
	var add uint64
	if grows {
		if add, err = b.growAddsLocked(n, held); err != nil {
			return err
		}
	}
	if err := m.admit(b, held, add, grows); err != nil {
		return fmt.Errorf("register %s in pd %d: %w", bytesize.Format(n), d.handle, err)
	}
	mp := b.mp
	if !reuse {
		if mp, err = m.mapFile(b.f, n); err != nil {
			return err
		}
	}
	var prog *progress
	if t := m.opt.PopulateThreshold; t == 0 || n < t {
		// A small registration is quick: an interrupt is not worth
		// failing it for (Go programs get one at every preemption signal
		// that comes while they wait).
		ctx = context.Background()
	}
	if t := m.opt.PopulateThreshold; t > 0 && n >= t {
		bs := &busy{info: b.infoLocked(), regs: b.regs.list()}
		bs.prog.total = n
		b.busy.Store(bs)
		defer b.busy.Store(nil)
		prog = &bs.prog
	}
	rs, err := m.register(ctx, b.f, d.pd, d.handle, mp.base, n, oldLen, oldLen, b.owner, a, prog)
	if isLimit(err, limitStore) {
		// The store filled between admission and population: clients
		// wrote unseen meanwhile. What they wrote past their quotas is
		// taken back; one more try.
		m.chargeUnseen(b)
		if prog != nil {
			prog.done.Store(0)
		}
		rs, err = m.register(ctx, b.f, d.pd, d.handle, mp.base, n, oldLen, oldLen, b.owner, a, prog)
	}
	if err != nil {
		if !reuse {
			m.unmap(&mp)
		}
		return err
	}
	if rest, err := m.deregister(b.regs, b.owner, false); err != nil {
		if len(rest) == len(b.regs) {
			// Nothing of the old registration went: keep it, and take
			// the new one back.
			if left, uerr := m.deregister(rs, b.owner, false); uerr != nil {
				m.log.Error("leaking memory regions", "regions", len(left), "err", uerr)
			}
			m.mu.Lock()
			m.pinLocked(b.owner, n, oldLen)
			m.mu.Unlock()
			if !reuse {
				m.unmap(&mp)
			}
			return err
		}
		// Part of it went: the new registration is the only whole one.
		m.log.Error("leaking memory regions", "regions", len(rest), "err", err)
	}
	if reuse {
		if err := b.mp.shrink(n); err != nil {
			// Only address space is lost: the daemon never reads the tail.
			m.log.Error("cannot unmap the tail of a buffer mapping", "err", err)
		}
	} else {
		m.unmap(&b.mp)
		b.mp = mp
	}
	b.regs = rs
	b.gen++
	b.pageSize.Store(0)
	m.events.Changed(b)
	b.keptChangedLocked()
	return nil
}

// growAddsLocked is the most memory a registration of [0, n) may add to
// the file, which holds held bytes now: the holes below n (the pages
// registration faults in, huge ones only within [0, n)), and with huge
// pages past the end (huge=always) the rest of the last one. A file
// registered whole (every page of its size present) and holding nothing
// past its end needs no look at its holes.
func (b *Buffer) growAddsLocked(n, held uint64) (uint64, error) {
	var extra uint64
	if g, pastEnd := b.m.store.Grain(); pastEnd {
		extra = grainRound(n, g) - pageRound(n)
	}
	if b.coveredLocked() && held == pageRound(b.size) && n >= b.size {
		return pageRound(n) - pageRound(b.size) + extra, nil
	}
	holes, err := b.f.Holes(0, n)
	if err != nil {
		return 0, err
	}
	return holes + extra, nil
}

// allocAdds is the most memory filling [off, off+length) of a file of
// size bytes may add: its holes (past its end too), widened to the large
// pages that filling may make (store.Store.Grain).
func (b *Buffer) allocAdds(holes func(from, to uint64) (uint64, error), size, off, length uint64) (uint64, error) {
	end := off + length
	if end < off {
		return 0, fmt.Errorf("range of %d bytes at %d: %w", length, off, syscall.EFBIG)
	}
	lo, hi := off, end
	if g, pastEnd := b.m.store.Grain(); g > pageRound(1) {
		// A large page (up to a huge one) made for a page of the range
		// fills its whole aligned block: below off, and past end too,
		// but (huge=within_size) only below the end of file or range.
		lo &^= g - 1
		hi = grainRound(end, g)
		if !pastEnd {
			hi = max(end, min(hi, pageRound(max(size, end))))
		}
	}
	return holes(lo, hi)
}

// holesOf counts the holes of a descriptor's file (store.HolesFd).
func holesOf(fd int) func(from, to uint64) (uint64, error) {
	return func(from, to uint64) (uint64, error) { return store.HolesFd(fd, from, to) }
}

// grainRound rounds n up to a multiple of grain, a power of two.
func grainRound(n, grain uint64) uint64 { return (n + grain - 1) &^ (grain - 1) }

// dropLocked deregisters the regions and unmaps the mapping.
func (b *Buffer) dropLocked() error {
	rest, err := b.m.deregister(b.regs, b.owner, true)
	b.regs = rest
	b.m.events.Changed(b)
	if err != nil {
		return err
	}
	b.m.unmap(&b.mp)
	b.reason = ""
	return nil
}

// Resize sets the size and registers it: new region first, then the old
// one deregistered. Keeps the first min(old, new) bytes. Resize(0)
// deregisters and unmaps everything (Empty). On failure the buffer keeps
// its previous state and size; so does ctx ending first (EINTR): a FUSE
// INTERRUPT, such as Ctrl-C on truncate, stops a big registration.
func (b *Buffer) Resize(ctx context.Context, size uint64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return fmt.Errorf("resize: %w", b.gone.err())
	}
	if b.slot != nil || b.src != nil {
		return b.f.Truncate(size)
	}
	defer b.settleFileLocked()
	// Start from the size the kernel has: a client may have changed it.
	if err := b.syncedLocked(func() error { return b.resizeLocked(ctx, size) }); err != nil {
		return fmt.Errorf("resize to %s: %w", bytesize.Format(size), err)
	}
	return nil
}

// resizeLocked sets the file's size to n and registers it. It expects
// b.size to be the file's size (syncLocked just ran).
func (b *Buffer) resizeLocked(ctx context.Context, n uint64) error {
	old := b.size
	switch {
	case n == old && b.coveredLocked():
		return nil
	case n == 0:
		if err := b.dropLocked(); err != nil {
			return err
		}
		if err := b.f.Truncate(0); err != nil {
			// Nothing is registered; the next Sync learns the size.
			return err
		}
		b.size, b.reason = 0, ""
		return nil
	case n > old:
		// Grow the file first (sparse: no memory yet), shrink it only
		// once registered.
		if err := b.f.Truncate(n); err != nil {
			return err
		}
		if err := b.registerLocked(ctx, n, b.dom, b.access); err != nil {
			b.undoTruncate(old)
			return err
		}
	default:
		if err := b.registerLocked(ctx, n, b.dom, b.access); err != nil {
			return err
		}
		// Only now, with nothing of ours past n, cut the file.
		if err := b.f.Truncate(n); err != nil {
			// Registered at n while the file is longer: the next Sync
			// registers the rest.
			return err
		}
	}
	b.size, b.reason = n, ""
	return nil
}

func (b *Buffer) undoTruncate(size uint64) {
	if err := b.f.Truncate(size); err != nil {
		b.m.log.Error("cannot undo a resize", "size", size, "err", err)
	}
}

// SetAccess re-registers with access a. EINVAL for an invalid set,
// EPERM outside Options.Allowed, EOPNOTSUPP when the device refuses it. A
// failure changes nothing. A buffer without a registration just stores a
// for its next one.
func (b *Buffer) SetAccess(a verbs.Access) error {
	if b.slot != nil {
		return b.m.refuse(limitPoolAccess, syscall.EPERM, "a pool file has its pool's access",
			"cannot set the access of a pool file: its slot is its pool's registration; set user.mrfs.default_access of the pool's directory, which re-registers the pool's chunks (new keys for all its files)")
	}
	if err := b.m.checkAccess(a); err != nil {
		return err
	}
	if b.src != nil {
		if err := checkSourceAccess(b.src, a); err != nil {
			return err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return fmt.Errorf("set access: %w", b.gone.err())
	}
	defer b.settleFileLocked()
	err := b.syncedLocked(func() error {
		if b.regs == nil {
			return nil // stored for the next registration
		}
		// Register anew, then deregister the old regions (never
		// ibv_rereg_mr, see verbs.MR): the old keys die, and a failure
		// changes nothing.
		return b.registerLocked(context.Background(), b.regs.length(), b.dom, a)
	})
	if err != nil {
		return fmt.Errorf("set access %s: %w", a, err)
	}
	b.access = a
	b.keptChangedLocked()
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
	if b.gone != alive {
		return fmt.Errorf("move: %w", b.gone.err())
	}
	if d == b.dom {
		return nil
	}
	if b.slot != nil || d.Pool() != nil {
		return fmt.Errorf("move into or out of a pool: a pool file is a slot of its pool's registration: %w", syscall.EXDEV)
	}
	defer b.settleFileLocked()
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
		if b.regs == nil {
			return nil
		}
		return b.registerLocked(context.Background(), b.regs.length(), d, b.access)
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
	if err := d.openLocked(); err != nil {
		return err
	}
	d.nbuf++
	return nil
}

// ReadAt reads from the file (pread). Like pread, and unlike
// io.ReaderAt, a short read at end of file returns a nil error.
func (b *Buffer) ReadAt(p []byte, off int64) (int, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.gone != alive {
		return 0, fmt.Errorf("read: %w", b.gone.err())
	}
	return b.f.ReadAt(p, off)
}

// WriteAt writes to the file (pwrite), then Syncs. A write past the end
// first resizes the buffer, so one that would pass a limit fails before
// writing anything.
func (b *Buffer) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("write at %d: %w", off, syscall.EINVAL)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return 0, fmt.Errorf("write: %w", b.gone.err())
	}
	if b.slot != nil || b.src != nil {
		return b.f.WriteAt(p, off) // what fits; EFBIG past the end
	}
	defer b.settleFileLocked()
	var old uint64
	err := b.syncedLocked(func() error {
		old = b.size
		if end := uint64(off) + uint64(len(p)); end > old {
			return b.resizeLocked(context.Background(), end)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("write %d bytes at %d: %w", len(p), off, err)
	}
	n, err := b.f.WriteAt(p, off)
	if err != nil {
		if b.size != old {
			if rerr := b.resizeLocked(context.Background(), old); rerr != nil {
				b.m.log.Error("cannot undo a resize after a failed write", "err", rerr)
			}
		}
		return 0, err
	}
	return n, b.syncLocked()
}

// Allocate is fallocate(2) on the file, then a Sync. When it extends
// the file (mode without FALLOC_FL_KEEP_SIZE), the buffer is resized
// first, so a limit fails cleanly before anything is allocated; other
// ranges (FALLOC_FL_KEEP_SIZE, past the end too) have the memory they may
// add admitted and charged first. After FALLOC_FL_PUNCH_HOLE the buffer is
// registered anew (keys change), since the old region pins the pages the
// hole removed from the file. ctx stops a big registration as in Resize.
func (b *Buffer) Allocate(ctx context.Context, off, length uint64, mode uint32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return fmt.Errorf("fallocate: %w", b.gone.err())
	}
	if b.slot != nil {
		return b.f.Allocate(mode, off, length)
	}
	defer b.settleFileLocked()
	var old uint64
	err := b.syncedLocked(func() error {
		old = b.size
		if end := off + length; mode&unix.FALLOC_FL_KEEP_SIZE == 0 && end > old {
			return b.resizeLocked(ctx, end)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("fallocate %d bytes at %d: %w", length, off, err)
	}
	var add uint64
	if mode&unix.FALLOC_FL_PUNCH_HOLE == 0 {
		_, held, err := b.f.Stat()
		if err == nil {
			if add, err = b.allocAdds(b.f.Holes, b.size, off, length); err == nil {
				err = b.m.admit(b, held, add, true)
			}
		}
		if err != nil {
			b.undoGrowLocked(old)
			return fmt.Errorf("fallocate %d bytes at %d: %w", length, off, err)
		}
	}
	if err := b.m.fill(b, add, func() error { return b.f.Allocate(mode, off, length) }); err != nil {
		b.undoGrowLocked(old)
		return err
	}
	if err := b.syncLocked(); err != nil {
		return err
	}
	if mode&unix.FALLOC_FL_PUNCH_HOLE != 0 && b.regs != nil {
		// The hole's pages left the file, but the region still pins
		// them: the device would write where no mapping looks. Register
		// the range anew, which pins the pages the file holds now (new
		// keys), then drop the old region.
		if err := b.registerLocked(context.Background(), b.regs.length(), b.dom, b.access); err != nil {
			return fmt.Errorf("re-register after punching a hole: %w", err)
		}
	}
	return nil
}

// undoGrowLocked takes the buffer back to size old after a failed
// fallocate that had grown it first.
func (b *Buffer) undoGrowLocked(old uint64) {
	if b.size != old {
		if err := b.resizeLocked(context.Background(), old); err != nil {
			b.m.log.Error("cannot undo a resize after a failed fallocate", "err", err)
		}
	}
}

// Free deregisters the region (remote access ends at once), then unmaps
// and removes the file. Later calls on the buffer fail with ENOENT; Info
// still works. If deregistration fails, nothing is unmapped (the device
// could still write there) and the error is returned.
func (b *Buffer) Free() error {
	_, _, err := b.free(freed)
	return err
}

// free is Free; it returns the regions it deregistered and their bytes
// (whole pages). A client that has the file open or mapped keeps its
// memory, still charged to the owner (an orphan) until nothing holds it
// (charge.go); with nothing holding it, the memory goes now.
func (b *Buffer) free(why gone) (nregions int, unpinned uint64, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return 0, 0, fmt.Errorf("free: %w", b.gone.err())
	}
	nregions, unpinned, err = b.unregisterLocked()
	if err != nil {
		return nregions, unpinned, fmt.Errorf("free: %w", err)
	}
	m := b.m
	// Decided under m.mu, which the last hold's end takes too: an
	// orphan's memory goes then. With no descriptor open and no inode of
	// a zero-copy open left (HoldInode) no client has the file, and its
	// memory goes now. New opens wait for b.mu, and then find the buffer
	// gone. A file only the kernel's inode holds (maybe mapped) is kept
	// open (keepsLocked), to free its memory at once when that goes: the
	// descriptor is made first, outside m.mu.
	keep, kerr := -1, error(nil)
	if b.slot == nil && b.src == nil {
		m.mu.Lock()
		mapped := b.opens == 0 && b.inodes > 0
		m.mu.Unlock()
		if mapped {
			keep, kerr = b.f.Open()
		}
	}
	m.mu.Lock()
	open := b.opens > 0 || b.inodes > 0
	if open {
		m.orphanLocked(b)
	}
	switch {
	case keep >= 0 && b.keepsLocked() && b.opens == 0:
		m.kept[b] = keep
		m.openFds++
		keep = -1
	case kerr != nil && b.keepsLocked():
		m.log.Warn("cannot keep a descriptor of a removed file still mapped: its memory goes when the kernel lets it go", "err", kerr)
	}
	m.mu.Unlock()
	if keep >= 0 {
		unix.Close(keep) // held open by a client meanwhile, or released
	}
	if !open {
		b.freeMemory(func() error { return b.f.Truncate(0) }, false)
	} else if b.slot != nil {
		b.slot.p.hold()
	}
	b.settleFileLocked() // what a client wrote unseen goes with the rest
	if err := b.f.Remove(); err != nil {
		m.log.Error("removing a buffer's file", "err", err)
	}
	b.f, b.reason, b.gone = nil, "", why
	m.mu.Lock()
	m.forgetLocked(b)
	m.mu.Unlock()
	return nregions, unpinned, nil
}

// unregisterLocked deregisters every region and unmaps the file, the
// first steps of free and leave; it returns the regions deregistered and
// their bytes (whole pages). If deregistration fails, what is left stays
// registered and mapped.
func (b *Buffer) unregisterLocked() (nregions int, unpinned uint64, err error) {
	for _, r := range b.regs {
		unpinned += pageRound(r.Length())
	}
	nregions = len(b.regs)
	rest, err := b.m.deregister(b.regs, b.owner, true)
	if err != nil {
		for _, r := range rest {
			unpinned -= pageRound(r.Length())
		}
		b.regs = rest
		return nregions - len(rest), unpinned, err
	}
	b.regs = nil
	b.m.unmap(&b.mp)
	return nregions, unpinned, nil
}

// leave is free for Manager.Leave: the registration goes and the file
// stays, untouched, for a later process to adopt.
func (b *Buffer) leave(why gone) (nregions int, unpinned uint64, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return 0, 0, fmt.Errorf("leave: %w", b.gone.err())
	}
	if nregions, unpinned, err = b.unregisterLocked(); err != nil {
		return nregions, unpinned, fmt.Errorf("leave: %w", err)
	}
	b.m.mu.Lock()
	b.m.unaccountLocked(b)
	b.m.mu.Unlock()
	b.f, b.reason, b.gone = nil, "", why
	return nregions, unpinned, nil
}
