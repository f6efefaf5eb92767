package buffer

import (
	"time"
	"unsafe"

	"mrfs/store"
	"mrfs/verbs"
)

// MR is the first region of the registration, nil unless Registered.
func (b *Buffer) MR() verbs.MR {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.regs == nil {
		return nil
	}
	return b.regs[0]
}

// MRs are the regions of the registration.
func (b *Buffer) MRs() []verbs.MR {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.regs
}

// Mem is the daemon's mapping of the registered bytes, for tests that
// write and read through the very memory that is registered.
func (b *Buffer) Mem() []byte {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.regs == nil {
		return nil
	}
	return unsafe.Slice((*byte)(b.mp.base), b.regs.length())
}

// MappedLen is the length of the daemon's mapping.
func (b *Buffer) MappedLen() uint64 {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.mp.len
}

// Regions is the manager's count of live regions.
func (m *Manager) Regions() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.regions
}

var PageRound = pageRound

// File is the buffer's file in the store (nil once freed).
func (b *Buffer) File() store.File {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.f
}

// unsafePointer is for tests that compare a slice with a region address.
func UnsafePointer(p []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(p)) }

// SetClock makes the manager's clock (limit-log rate) f until restore.
func SetClock(f func() time.Time) (restore func()) {
	old := now
	now = f
	return func() { now = old }
}

const (
	MemoryFresh = memoryFresh
	MemoryNear  = memoryNear
	MemReserve  = memReserve
)

const PopulateChunk = populateChunk

// PopulateRange is the real population of a chunk.
var PopulateRange = populateRange

// SetPopulate makes f populate each chunk until restore.
func SetPopulate(f func(p unsafe.Pointer, n uint64) error) (restore func()) {
	old := populateRange
	populateRange = f
	return func() { populateRange = old }
}

// HoldLikeRegistration takes b.mu as a registration does, from before it
// publishes its busy state: publish then publishes one of total bytes,
// done clears it and lets go of mu.
func (b *Buffer) HoldLikeRegistration() (publish func(total uint64), done func()) {
	b.mu.Lock()
	publish = func(total uint64) {
		bs := &busy{info: b.infoLocked(), regs: b.regs.list()}
		bs.prog.total = total
		b.busy.Store(bs)
	}
	done = func() {
		b.busy.Store(nil)
		b.mu.Unlock()
	}
	return publish, done
}

// SetMapRoom makes vm.max_map_count leave room for n more buffer mappings
// (counted from now: the process's other mappings stay as counted).
func (m *Manager) SetMapRoom(n int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := &m.maps
	c.reserveMin = c.reserve()
	c.limit = c.own + c.other + c.reserveMin + n
	c.since, c.countedAt = 0, now() // no recount in this test
}

// SetZeroSlot replaces how a pool slot is zeroed; restore puts it back.
func SetZeroSlot(f func([]byte)) (restore func()) {
	old := zeroSlot
	zeroSlot = f
	return func() { zeroSlot = old }
}

// MapRecountDue says whether the process's mappings are counted again,
// far from vm.max_map_count, with own buffer mappings, other mappings at
// the last count, and since buffer mappings made since.
func MapRecountDue(own, other, since int) bool {
	c := mapCount{limit: 1 << 30, own: own, other: other, since: since, countedAt: now()}
	return c.due(now())
}

// MapRecountDueNear says whether the process's mappings are counted
// again near vm.max_map_count, elapsed after a count that took took.
func MapRecountDueNear(elapsed, took time.Duration) bool {
	t := now()
	c := mapCount{limit: 1000, own: 990, countedAt: t.Add(-elapsed), took: took}
	return c.due(t)
}

// Fill is the manager's fill for b, with its lock held as the fallocate
// paths hold it.
func (m *Manager) Fill(b *Buffer, n uint64, fill func() error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return m.fill(b, n, fill)
}
