package buffer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/store"
	"mrfs/verbs"
)

// A pool (DESIGN "Pools") is a domain whose buffers are fixed-size slots
// of a few big registrations: each chunk is one reservation of address
// space in which every slot is its own sealed memfd (store.NewSealed)
// mapped at its place, and the chunk is registered as one region. A slot's
// buffer has no file, mapping or registration of its own; creating one
// takes a free slot and nothing else. The pool's memory is charged to its
// owner through holder (admission works on a buffer's charge), and taken
// from the store's own bound (store.Reserver), so that the kernel's bound
// on the store and the pools together stays the budget.
//
// A slot is zeroed once its file is unlinked, or, for a file unlinked
// while a client held it open or mapped, once nothing holds it (charge.go:
// a mapping outlives its descriptor), and only then given again: no byte
// of one file is readable through the next one given its slot. The zeroing is
// done without the pool's lock; a create that finds no free slot but one
// being zeroed waits for it. (A worker zeroing off the unlink's path
// measured slower on two CPUs: docs/BENCHMARKS.md.)
//
// Lock order: a slot's Buffer.mu, then Pool.mu, then Manager.mu.
type Pool struct {
	m      *Manager
	d      *Domain
	slot   uint64  // immutable: bytes per slot, whole pages
	per    int     // immutable: slots per region (max_mr_size / slot)
	owner  uint32  // immutable: charged for the pool's memory
	holder *Buffer // immutable: carries the charge

	mu sync.Mutex
	// guards: chunks (and every chunk's regs), free, used, zeroing,
	// held, access, closed.
	chunks []*chunk
	free   []int // free slot numbers, zeroed; the last is given next
	used   int   // slots held by files
	// zeroing: slots being zeroed now, without mu (their chunks stay
	// until it is 0); done is signalled (on mu) whenever one is.
	zeroing int
	done    *sync.Cond
	// held: slots of files unlinked while held (open or mapped), given
	// back when nothing holds them; after close, each still charged.
	held   int
	access verbs.Access
	closed bool
}

// chunk is slots [first, first+n) of a pool: one reservation, one region.
type chunk struct {
	first, n int
	base     unsafe.Pointer
	regs     regions
}

// slotRef is a slot's buffer's place in its pool; immutable.
type slotRef struct {
	p    *Pool
	i    int
	addr unsafe.Pointer // the slot's memory: its chunk stays while it is used
}

// PoolInfo is a snapshot of a pool.
type PoolInfo struct {
	Slot        uint64 // bytes per slot
	Slots, Used int
	Chunks      int
	Access      verbs.Access
	Regions     []Region // one per chunk
}

// SlotInfo says where a pool file's buffer lives in its pool.
type SlotInfo struct {
	Index int    // the slot's number in the pool
	Size  uint64 // the pool's slot size
}

// Pool is d's pool, nil when d is an ordinary directory.
func (d *Domain) Pool() *Pool {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	return d.pool
}

// MakePool turns d, which must hold no buffer (EBUSY), into a pool of
// slots slots of slot bytes (rounded up to whole pages) with d's default
// access, owned by (charged to) owner: the whole pool is admitted at once
// (max_pinned, the owner's quota, the memory left), populated and
// registered in as few regions as the device allows. EINVAL for a size
// of nothing or one past a region, EEXIST when d is a pool already; the
// limits as for any registration.
func (d *Domain) MakePool(slot uint64, slots int, owner uint32) (*Pool, error) {
	m := d.m
	slot = pageRound(slot)
	switch {
	case slot == 0 || slots <= 0:
		return nil, fmt.Errorf("pool of %d slots of %s: %w", slots, bytesize.Format(slot), syscall.EINVAL)
	case slot > m.attr.MaxMRSize:
		return nil, fmt.Errorf("pool slot of %s: larger than a region may be (%s, max_mr_size or buffers.max_region_size): %w",
			bytesize.Format(slot), bytesize.Format(m.attr.MaxMRSize), syscall.EINVAL)
	case uint64(slots) > (1<<62)/slot:
		return nil, fmt.Errorf("pool of %d slots of %s: %w", slots, bytesize.Format(slot), syscall.EFBIG)
	}
	if _, ok := m.store.(store.Reserver); !ok && m.store.Kind() != "memfd" {
		return nil, fmt.Errorf("pool: the %s store cannot give room to one: %w", m.store.Kind(), syscall.EOPNOTSUPP)
	}
	p := &Pool{m: m, d: d, slot: slot, per: int(min(m.attr.MaxMRSize/slot, 1<<30)), owner: owner,
		holder: &Buffer{m: m, dom: d, owner: owner}}
	p.done = sync.NewCond(&p.mu)
	m.mu.Lock()
	err := d.openLocked()
	switch {
	case err != nil:
	case d.pool != nil:
		err = fmt.Errorf("pd %d is a pool already: %w", d.handle, syscall.EEXIST)
	case d.nbuf > 0 || d.making:
		err = fmt.Errorf("pd %d holds %d buffers; a pool is made of an empty directory: %w", d.handle, d.nbuf, syscall.EBUSY)
	}
	if err == nil {
		d.making = true // no buffer comes in meanwhile (reserveBuffer)
		p.access = d.access
	}
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	err = p.growLocked(slots)
	if err == nil {
		err = p.reopenableLocked()
	}
	p.mu.Unlock()
	m.mu.Lock()
	d.making = false
	if err == nil {
		d.pool = p
	}
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return p, nil
}

// reopenableLocked checks that a slot's file can be reopened for a
// client (slotFile.Open, through /proc/self/map_files: CAP_SYS_ADMIN or
// CAP_CHECKPOINT_RESTORE), and frees the pool's chunks when not: EPERM,
// logged with what it takes. Callers hold p.mu.
func (p *Pool) reopenableLocked() error {
	addr, _ := p.addrLocked(0)
	fd, err := slotFile{&slotRef{p: p, addr: addr}}.Open()
	if err == nil {
		unix.Close(fd)
		return nil
	}
	if derr := p.dropToLocked(0, 0); derr != nil {
		return errors.Join(err, derr)
	}
	p.free = nil
	return p.m.refuse(limitPoolReopen, syscall.EPERM, "pools need CAP_SYS_ADMIN",
		fmt.Sprintf("cannot make a pool: a client's open of a pool file reopens its slot through /proc/self/map_files, which needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE); run mrfs as root, or use standalone buffers (%v)", err))
}

// Info is a snapshot of the pool.
func (p *Pool) Info() PoolInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	in := PoolInfo{Slot: p.slot, Slots: p.slotsLocked(), Used: p.used, Chunks: len(p.chunks), Access: p.access}
	for _, c := range p.chunks {
		in.Regions = append(in.Regions, c.regs.list()...)
	}
	return in
}

func (p *Pool) slotsLocked() int {
	if len(p.chunks) == 0 {
		return 0
	}
	c := p.chunks[len(p.chunks)-1]
	return c.first + c.n
}

// SetSlots grows the pool to n slots (new chunks) or shrinks it by
// freeing whole chunks from the end, asked by uid by: EINVAL when n is
// not where a chunk ends, EBUSY when a slot to free is in use. Only the
// pool's owner, who pays for every slot, or root changes them (EPERM):
// anyone else who may write the directory would grow it on the owner's
// quota.
func (p *Pool) SetSlots(n int, by uint32) error {
	if by != p.owner && by != 0 {
		return fmt.Errorf("pool of pd %d: only its owner (uid %d), who pays for its slots, or root changes them, not uid %d: %w",
			p.d.handle, p.owner, by, syscall.EPERM)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("pool: %w", syscall.ENOENT)
	}
	have := p.slotsLocked()
	switch {
	case n <= 0:
		return fmt.Errorf("pool of %d slots: remove the directory instead: %w", n, syscall.EINVAL)
	case n > have:
		return p.growLocked(n - have)
	case n == have:
		return nil
	}
	k := len(p.chunks)
	for k > 0 && p.chunks[k-1].first >= n {
		k--
	}
	if p.chunks[k-1].first+p.chunks[k-1].n != n {
		return fmt.Errorf("pool of %d slots: chunks end at slot %d, not %d; a pool shrinks by whole chunks: %w",
			have, p.chunks[k-1].first+p.chunks[k-1].n, n, syscall.EINVAL)
	}
	// A slot of a file removed a moment ago may be held until the
	// kernel's RELEASE or FORGET reaches the daemon: waited for, briefly.
	deadline := time.Now().Add(releaseWait)
	for {
		for p.zeroing > 0 {
			p.done.Wait() // its chunk may be one to free
		}
		if p.closed {
			return fmt.Errorf("pool: %w", syscall.ENOENT)
		}
		i := p.usedFromLocked(n)
		if i < 0 {
			break
		}
		if p.held == 0 || !p.waitGiveLocked(deadline) {
			return fmt.Errorf("pool: slot %d is in use (or held open or mapped): %w", i, syscall.EBUSY)
		}
	}
	p.free = slices.DeleteFunc(p.free, func(i int) bool { return i >= n })
	return p.dropToLocked(k, 0)
}

// usedFromLocked is the first slot from n on that is not free, or -1.
// Callers hold p.mu.
func (p *Pool) usedFromLocked(n int) int {
	free := make(map[int]bool, len(p.free))
	for _, i := range p.free {
		free[i] = true
	}
	for i := n; i < p.slotsLocked(); i++ {
		if !free[i] {
			return i
		}
	}
	return -1
}

// waitGiveLocked waits, releasing p.mu meanwhile, for a slot to be given
// back or for deadline; it says whether the deadline is still ahead.
// Callers hold p.mu.
func (p *Pool) waitGiveLocked(deadline time.Time) bool {
	left := time.Until(deadline)
	if left <= 0 {
		return false
	}
	t := time.AfterFunc(left, func() {
		p.mu.Lock()
		p.done.Broadcast()
		p.mu.Unlock()
	})
	defer t.Stop()
	p.done.Wait()
	return true
}

// growLocked adds n slots in new chunks, all or nothing: admitted and
// charged first, then made, populated and registered. Callers hold p.mu.
func (p *Pool) growLocked(n int) error {
	m, d := p.m, p.d
	bytes := uint64(n) * p.slot
	if err := m.tooLarge(p.holder.charge.Load()+bytes, p.owner); err != nil {
		return err
	}
	if err := m.admit(p.holder, p.holder.charge.Load(), bytes, true); err != nil {
		return fmt.Errorf("pool of %d slots of %s in pd %d: %w", n, bytesize.Format(p.slot), d.handle, err)
	}
	settle := func(ok bool) {
		held := p.holder.charge.Load()
		if !ok {
			held -= bytes
		}
		p.holder.settleLocked(held, true)
	}
	if r, ok := m.store.(store.Reserver); ok {
		if err := r.Reserve(bytes); err != nil {
			settle(false)
			return fmt.Errorf("pool of %s in pd %d: %w", bytesize.Format(bytes), d.handle,
				m.refuse(limitStore, syscall.ENOSPC, "the store is full", "cannot make a pool: "+err.Error()))
		}
	}
	var made []*chunk
	first := p.slotsLocked()
	for left := n; left > 0; {
		k := min(left, p.per)
		c, err := p.makeChunk(first, k)
		if err != nil {
			for _, c := range made {
				p.dropLocked(c, 0)
			}
			if r, ok := m.store.(store.Reserver); ok {
				r.Unreserve(bytes)
			}
			settle(false)
			return fmt.Errorf("pool of %d slots of %s in pd %d: %w", n, bytesize.Format(p.slot), d.handle, err)
		}
		made = append(made, c)
		first += k
		left -= k
	}
	settle(true)
	p.chunks = append(p.chunks, made...)
	// Free is used from its end: the lowest new slot is given next.
	for i := first - 1; i >= first-n; i-- {
		p.free = append(p.free, i)
	}
	return nil
}

// makeChunk reserves the address space of slots [first, first+n), maps a
// sealed memfd at each slot's place and registers the whole range.
func (p *Pool) makeChunk(first, n int) (*chunk, error) {
	m := p.m
	length := uint64(n) * p.slot
	if err := m.reserveMaps(n); err != nil {
		return nil, err
	}
	base, err := unix.MmapPtr(-1, 0, nil, uintptr(length), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		m.unreserveMaps(n)
		return nil, fmt.Errorf("reserve %s of address space: %w", bytesize.Format(length), err)
	}
	c := &chunk{first: first, n: n, base: base}
	for i := range n {
		if err := p.mapSlot(unsafe.Add(base, uint64(i)*p.slot)); err != nil {
			p.unmapChunk(c)
			return nil, m.classifyFd(err)
		}
	}
	rs, err := m.register(context.Background(), nil, p.d.pd, p.d.handle, base, length, 0, 0, p.owner, p.access, nil)
	if err != nil {
		p.unmapChunk(c)
		return nil, err
	}
	c.regs = rs
	return c, nil
}

// mapSlot maps a new sealed memfd of one slot at addr, in place of the
// reservation.
func (p *Pool) mapSlot(addr unsafe.Pointer) error {
	fd, err := store.NewSealed(p.slot)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.MmapPtr(fd, 0, addr, uintptr(p.slot), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED)
	if err != nil {
		return fmt.Errorf("map a pool slot: %w", err)
	}
	return nil
}

// unmapChunk unmaps c's range (its memfds go with their last mapping
// elsewhere) and gives back its count of mappings.
func (p *Pool) unmapChunk(c *chunk) {
	if err := unix.MunmapPtr(c.base, uintptr(uint64(c.n)*p.slot)); err != nil {
		p.m.log.Error("leaking a pool chunk's mappings", "err", err)
		return
	}
	p.m.unreserveMaps(c.n)
}

// dropToLocked frees the chunks past the first k, the last first, but
// for keep bytes of their memory, which stay charged (slots clients still
// map: give uncharges each); one that cannot be deregistered stays, with
// those before it. Callers hold p.mu.
func (p *Pool) dropToLocked(k int, keep uint64) error {
	for len(p.chunks) > k {
		c := p.chunks[len(p.chunks)-1]
		kc := min(keep, uint64(c.n)*p.slot)
		if err := p.dropLocked(c, kc); err != nil {
			return err
		}
		keep -= kc
		p.chunks = p.chunks[:len(p.chunks)-1]
	}
	return nil
}

// dropLocked deregisters c, then unmaps it and gives its memory back to
// the budget and the store but for keep bytes: slots that clients still
// map, whose memory goes (and is uncharged, give) with their last
// mapping. Callers hold p.mu.
func (p *Pool) dropLocked(c *chunk, keep uint64) error {
	m := p.m
	if rest, err := m.deregister(c.regs, p.owner, true); err != nil {
		c.regs = rest
		return fmt.Errorf("pool: %w", err) // nothing is unmapped under a live region
	}
	c.regs = nil
	p.unmapChunk(c)
	p.uncharge(uint64(c.n)*p.slot - keep)
	return nil
}

// uncharge gives bytes of the pool's memory, freed, back to the budget
// and the store.
func (p *Pool) uncharge(bytes uint64) {
	m := p.m
	if r, ok := m.store.(store.Reserver); ok {
		r.Unreserve(bytes)
	}
	m.mu.Lock()
	m.setChargeLocked(p.holder, p.holder.charge.Load()-min(bytes, p.holder.charge.Load()))
	m.memAt = time.Time{} // memory was freed: read MemAvailable afresh
	m.mu.Unlock()
}

// close frees every chunk (the pool's directory is removed, or the
// manager closes); its slots' buffers are gone before. The slots of files
// unlinked while held stay charged to the pool's owner until nothing
// holds them (give): a client's mapping keeps their pages. Errors leave
// the chunks that could not be deregistered.
func (p *Pool) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for p.zeroing > 0 {
		p.done.Wait()
	}
	if err := p.dropToLocked(0, uint64(p.held)*p.slot); err != nil {
		return err
	}
	p.free = nil
	return nil
}

// setAccess re-registers every chunk with a (new regions first, then the
// old ones deregistered): new keys for all the pool's files. All or
// nothing.
func (p *Pool) setAccess(a verbs.Access) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return fmt.Errorf("pool: %w", syscall.ENOENT)
	}
	m := p.m
	made := make([]regions, 0, len(p.chunks))
	for _, c := range p.chunks {
		rs, err := m.register(context.Background(), nil, p.d.pd, p.d.handle, c.base, uint64(c.n)*p.slot, 0, uint64(c.n)*p.slot, p.owner, a, nil)
		if err != nil {
			for _, rs := range made {
				if _, derr := m.deregister(rs, p.owner, true); derr != nil {
					m.log.Error("leaking memory regions", "err", derr)
				}
			}
			return fmt.Errorf("re-register the pool's chunks with %s: %w", a, err)
		}
		made = append(made, rs)
	}
	for i, c := range p.chunks {
		if _, err := m.deregister(c.regs, p.owner, true); err != nil {
			m.log.Error("leaking memory regions", "err", err)
		}
		c.regs = made[i]
	}
	p.access = a
	return nil
}

// take gives a free slot, waiting for one being zeroed if that is all
// there is, and briefly (releaseWait) for files unlinked while open to
// be closed: the kernel sends FUSE's RELEASE after a client's close
// returns, so `rm` followed at once by a create can find the removed
// file's slot still held. ENOSPC naming the pool when every slot is held.
func (p *Pool) take() (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var deadline time.Time
	for {
		switch {
		case p.closed:
			return 0, fmt.Errorf("pool: %w", syscall.ENOENT)
		case len(p.free) > 0:
			i := p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
			p.used++
			return i, nil
		case p.zeroing > 0:
			p.done.Wait()
			continue
		case p.held > 0 && deadline.IsZero():
			deadline = time.Now().Add(releaseWait)
			continue
		case p.held > 0 && p.waitGiveLocked(deadline):
			continue
		}
		open := ""
		if n := p.held; n > 0 {
			open = fmt.Sprintf(" (%d of them by files unlinked, still open or mapped)", n)
		}
		m := p.m
		return 0, m.refuse(limitPoolFull, syscall.ENOSPC, fmt.Sprintf("pool of pd %d is full (%d slots)", p.d.handle, p.slotsLocked()),
			fmt.Sprintf("cannot create a file in the pool of pd %d: all its %d slots of %s are taken%s; remove files or raise its slots", p.d.handle, p.slotsLocked(), bytesize.Format(p.slot), open))
	}
}

// hold counts a slot whose file was unlinked while held: give gets it
// back when nothing holds it.
func (p *Pool) hold() {
	p.mu.Lock()
	p.held++
	p.mu.Unlock()
}

// give takes slot i back from its file (released: when nothing holds a
// file unlinked while held), zeroes it without mu, and makes it free.
// After close the slot's memory is gone with its last mapping: its
// charge goes too.
func (p *Pool) give(i int, released bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if released {
		p.held--
	}
	p.used--
	if p.closed {
		if released {
			p.uncharge(p.slot)
		}
		return
	}
	mem := p.bytesLocked(i)
	p.zeroing++
	p.mu.Unlock()
	zeroSlot(mem)
	p.mu.Lock()
	p.zeroing--
	p.free = append(p.free, i)
	p.done.Broadcast()
}

// zeroSlot zeroes a slot's memory; a variable so that tests can hold a
// zeroing under way.
var zeroSlot = func(mem []byte) { clear(mem) }

// addrLocked is slot i's address, and its chunk. Callers hold p.mu.
func (p *Pool) addrLocked(i int) (unsafe.Pointer, *chunk) {
	for _, c := range p.chunks {
		if i >= c.first && i < c.first+c.n {
			return unsafe.Add(c.base, uint64(i-c.first)*p.slot), c
		}
	}
	return nil, nil
}

// bytesLocked is slot i's memory. Callers hold p.mu.
func (p *Pool) bytesLocked(i int) []byte {
	a, _ := p.addrLocked(i)
	if a == nil {
		return nil
	}
	return unsafe.Slice((*byte)(a), p.slot)
}

// Pools are the manager's pools, by their PD's number.
func (m *Manager) Pools() map[uint32]*Pool {
	m.mu.Lock()
	defer m.mu.Unlock()
	ps := make(map[uint32]*Pool)
	for d := range m.domains {
		if d.pool != nil {
			ps[d.handle] = d.pool
		}
	}
	return ps
}
