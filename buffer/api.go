// Package buffer owns the memory behind mrfs files: one memfd per buffer,
// mapped MAP_SHARED in the daemon, and that mapping registered with a verbs
// device. It implements the lifecycle rules of DESIGN.md (create, resize,
// size learned by fstat, access change, move between PDs, unlink,
// teardown) and the limits, and knows nothing of FUSE.
package buffer

import (
	"mrfs/verbs"
)

// Options are the policy and limits a Manager enforces.
type Options struct {
	// MaxBuffers is the most buffers that may exist at once; 0: no limit.
	MaxBuffers int
	// MaxPinned is the most bytes that may be registered at once, counted
	// in whole pages; 0: no limit beyond RLIMIT_MEMLOCK.
	MaxPinned uint64
	// Allowed are the access flags a buffer or directory may be given;
	// others are EPERM.
	Allowed verbs.Access
}

// State is where a buffer stands with its registration.
type State int

const (
	// Empty: length 0, nothing registered.
	Empty State = iota
	// Registered: the whole memfd is registered.
	Registered
	// Unregistered: the memfd has bytes but no registration; Info.Reason
	// says why (a limit hit while learning a size the kernel changed).
	Unregistered
)

// Info is a consistent snapshot of a buffer.
type Info struct {
	Size   uint64 // bytes in the memfd == registered length when Registered
	State  State
	Reason string // why, when Unregistered
	LKey   uint32
	RKey   uint32
	Addr   uintptr // registered virtual address (== iova)
	Access verbs.Access
	PD     uint32
}

// Stats are totals across a Manager.
type Stats struct {
	Buffers         int
	PDs             int
	RegisteredBytes uint64 // sum of registered lengths
	PinnedBytes     uint64 // the same rounded up to whole pages
}

// Freed is what Manager.Close released.
type Freed struct {
	Regions       int    // regions deregistered
	PDs           int    // protection domains deallocated
	UnpinnedBytes uint64 // the deregistered regions' bytes, in whole pages
}
