package buffer

import (
	"time"
	"unsafe"

	"mrfs/store"
	"mrfs/verbs"
)

// MR is the buffer's current region, nil unless Registered.
func (b *Buffer) MR() verbs.MR {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.mr
}

// Mem is the daemon's mapping of the registered bytes, for tests that
// write and read through the very memory that is registered.
func (b *Buffer) Mem() []byte {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.mr == nil {
		return nil
	}
	return unsafe.Slice((*byte)(b.mp.base), b.mr.Length())
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
