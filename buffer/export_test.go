package buffer

import (
	"unsafe"

	"mrfs/verbs"
)

// MR is the buffer's current region, nil unless Registered.
func (b *Buffer) MR() verbs.MR {
	b.mu.RLock()
	defer b.mu.RUnlock()
	return b.mr
}

// Mem is the daemon's mapping of the buffer's first Size bytes, for tests
// that write and read through the very memory that is registered.
func (b *Buffer) Mem() []byte {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.mp.base == nil {
		return nil
	}
	return unsafe.Slice((*byte)(b.mp.base), b.size)
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

// unsafePointer is for tests that compare a slice with a region address.
func UnsafePointer(p []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(p)) }
