package buffer

import (
	"time"

	"mrfs/internal/sysmem"
	"mrfs/store"
	"mrfs/verbs"
)

// Options are the policy and limits a Manager enforces.
type Options struct {
	// Store makes the files behind buffers (store.NewTmpfs, or
	// store.NewMemfd in the degraded mode); nil is NewMemfd.
	Store store.Store
	// MaxBuffers is the most buffers that may exist at once; 0: no limit.
	MaxBuffers int
	// MaxPinned is the pinning budget: the most bytes that may be
	// registered at once, counted in whole pages; 0: none beyond what the
	// machine has (see Memory).
	MaxPinned uint64
	// MaxPinnedPerUser bounds the bytes registered for the buffers one
	// uid owns; 0: no quota.
	MaxPinnedPerUser uint64
	// Allowed are the access flags a buffer or directory may be given;
	// others are EPERM.
	Allowed verbs.Access
	// Memory reads what the machine and the daemon's memory cgroup have
	// left; before pinning pages that do not exist yet, the manager
	// checks there is room for them (ENOMEM otherwise). nil:
	// sysmem.Read.
	Memory func() (sysmem.Memory, error)
	// FdReserve is how many descriptors below RLIMIT_NOFILE clients'
	// opens leave to the daemon itself (its own opens of the store,
	// sockets of remote peers, the FUSE device); 0: 128.
	FdReserve int
	// Events hears of registrations and refusals (metrics); nil: none.
	Events Events
	// OnKept, when set, hears what a later process needs of a buffer
	// (Keep) each time it changes: a registration (the generation grows),
	// an access, an owner. Called with the buffer's lock held (and the
	// manager's, for an owner), in the order of the buffer's changes: it
	// must not block or call back into the manager (a journal).
	OnKept func(Kept)
	// Reopen opens again the source of a registration in place an
	// earlier process kept (AdoptInPlace): source.Reopen. nil: such
	// files cannot be taken back.
	Reopen func(k KeptSource) (Source, error)
	// PopulateThreshold: a registration of at least this many bytes has
	// its new pages populated by PopulateWorkers workers first (0 or
	// less: GOMAXPROCS); 0: never.
	PopulateThreshold uint64
	PopulateWorkers   int
	// MaxRegionSize caps a region below the device's max_mr_size: a
	// larger registration is split into regions of at most this many
	// bytes (rounded down to pages). 0: the device's limit only.
	MaxRegionSize uint64
	// ChunkDelay is a test hook: a pause after each chunk populated, so
	// that a registration lasts long enough to watch or interrupt.
	ChunkDelay time.Duration
	// MapReserve is a test hook: the mappings left to the daemon below
	// vm.max_map_count (0: 1/64 of it, at least 256), so that tests under
	// emulation reach the limit with fewer buffers.
	MapReserve int
}

// Events are what a Manager reports as it happens, for metrics. Calls are
// made without the manager's locks held and must not call back into it.
type Events interface {
	// Registered: a region of n bytes was registered in took.
	Registered(n uint64, took time.Duration)
	// Deregistered: a region of n bytes was deregistered.
	Deregistered(n uint64)
	// Changed: b's registration changed (its keys, regions, length or
	// generation) or went, but for a Free, which its caller knows of.
	// Called with b's lock held: hear of it and return.
	Changed(b *Buffer)
	// LimitHit: a call was refused by limit (its name in the log:
	// "max_pinned", "RLIMIT_MEMLOCK", ...).
	LimitHit(limit string)
}

// State is where a buffer stands with its registration.
type State int

const (
	// Empty: length 0, nothing registered.
	Empty State = iota
	// Registered: the file is registered, wholly, or (with Info.Reason)
	// only its first Info.Length bytes, where a client grew the file past
	// what could be registered: the registration that was there stays.
	Registered
	// Unregistered: the file has bytes but no registration; Info.Reason
	// says why (a limit hit while learning a size a client changed).
	Unregistered
	// Stale: registered in place, and deregistered for good since its
	// source was resized (Info.Reason).
	Stale
)

// Info is a consistent snapshot of a buffer.
type Info struct {
	Size   uint64 // bytes in the file
	Length uint64 // bytes registered: Size when wholly Registered
	State  State
	// Reason says why the registration does not cover the file
	// (Unregistered, or Registered with Length < Size).
	Reason     string
	LKey       uint32
	RKey       uint32
	Addr       uintptr // registered virtual address (== iova)
	Access     verbs.Access
	PD         uint32
	Owner      uint32 // the uid charged for its pinned bytes
	Generation uint64 // registrations made for it: grows at every one
	// Regions is how many memory regions the registration is made of
	// (Buffer.Regions lists them); LKey, RKey and Addr are the first's.
	Regions int
	// Progress is a registration under way (Total 0: none); the rest of
	// Info is then what was there before it.
	Progress Progress
	// Pool is where a pool file's slot is (nil for other files): its
	// registration is its chunk's (LKey, RKey), Addr the slot's.
	Pool *SlotInfo
	// Source is where a file registered in place has its memory (nil
	// for other files).
	Source *SourceInfo
}

// Stats are totals across a Manager.
type Stats struct {
	Buffers         int
	PDs             int
	RegisteredBytes uint64 // sum of registered lengths
	PinnedBytes     uint64 // the same rounded up to whole pages
	// ChargedBytes is the store memory charged to owners (what max_pinned
	// and max_pinned_per_user bound): what files hold, and what
	// operations in progress may add. Orphans are the files unlinked while
	// clients still hold them, OrphanBytes their part of it.
	ChargedBytes uint64
	Orphans      int
	OrphanBytes  uint64
	Users        map[uint32]UserStats
	// Store is the backing store's kind; StoreUsed and StoreSize what its
	// files hold and its own limit (0 when it has none).
	Store     string
	StoreUsed uint64
	StoreSize uint64
	// OpenFds are clients' open descriptors of buffers, MaxOpenFds what
	// RLIMIT_NOFILE leaves them.
	OpenFds, MaxOpenFds int
	// Maps are the daemon's memory mappings (counted, not read), MaxMaps
	// vm.max_map_count: each registered buffer is one.
	Maps, MaxMaps int
	// MapRoom is how many more buffers or pool slots the mapping limit
	// lets the daemon map, after the reserve it keeps for itself.
	MapRoom int
	// Regions are the memory regions registered (against the device's
	// max_mr): one per buffer, or more past max_mr_size; one per pool
	// chunk.
	Regions int
}

// UserStats are one uid's buffers, registered (pinned) bytes and the
// store memory charged to it, Orphaned of which for unlinked files still
// open.
type UserStats struct {
	Buffers     int
	PinnedBytes uint64
	Charged     uint64
	Orphaned    uint64
}

// Freed is what Manager.Close released itself.
type Freed struct {
	Regions       int    // regions deregistered
	PDs           int    // protection domains deallocated
	UnpinnedBytes uint64 // the deregistered regions' bytes, in whole pages
}
