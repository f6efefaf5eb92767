package buffer

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/internal/sysmem"
	"mrfs/store"
	"mrfs/verbs"
)

// Manager owns every buffer and domain of one device.
type Manager struct {
	dev    verbs.Device
	attr   verbs.DeviceAttr // queried once: device limits do not change
	opt    Options
	store  store.Store
	memory func() (sysmem.Memory, error)
	events Events
	log    *slog.Logger

	mu sync.Mutex
	// guards (with mu): the sets of buffers and domains, every Domain's
	// mutable fields, the counters, the per-user charges, every Buffer's
	// charge, descriptors and orphan state (charge.go), the
	// limit-warning times, the memory reading, the mappings and the open
	// descriptors.
	closed     bool
	buffers    map[*Buffer]struct{}
	domains    map[*Domain]struct{}
	registered uint64 // sum of registered lengths, net of a replacement in flight
	pinned     uint64 // the same in whole pages
	regions    int    // live regions, counting both during a replacement
	pdsPending int    // PDs being allocated (domain.go)
	charged    uint64 // store memory charged to owners: every Buffer's charge
	orphans    int    // buffers freed while clients hold them open
	orphaned   uint64 // their charges
	users      map[uint32]*UserStats
	warned     map[limitKind]time.Time
	mem        sysmem.Memory // the last reading of the memory left (limits.go)
	memAt      time.Time     // when it was read
	memSince   uint64        // bytes of pages admitted since, or not made then
	inflight   uint64        // bytes of pages admitted and not settled yet
	maps       mapCount      // the daemon's mappings (maps.go)
	nextID     uint64
	openFds    int
	maxOpenFds int
	// writers are the buffers with writable descriptors open: where pages
	// the daemon has not seen can come from.
	writers map[*Buffer]struct{}
	// kept are descriptors of unlinked files that only the kernel's
	// inodes hold (mapped), counted in openFds: the file's memory is
	// freed through it, at once, when nothing holds the file any more
	// (charge.go).
	kept map[*Buffer]int
	// sources are the buffers registered in place and not stale, which
	// watchSources (running once watching is set) looks at.
	sources  map[*Buffer]struct{}
	watching bool
	// releases is closed (and replaced) whenever an orphan's memory is
	// released, for admissions waiting for it.
	releases chan struct{}
}

// NewManager returns a Manager registering on dev. It does not own dev or
// opt.Store: Close closes neither. A nil log discards messages.
func NewManager(dev verbs.Device, opt Options, log *slog.Logger) *Manager {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opt.Store == nil {
		opt.Store = store.NewMemfd()
	}
	if opt.Memory == nil {
		opt.Memory = sysmem.Read
	}
	if opt.FdReserve <= 0 {
		opt.FdReserve = 128
	}
	events := opt.Events
	if events == nil {
		events = noEvents{}
	}
	m := &Manager{
		dev:      dev,
		attr:     dev.Attr(),
		opt:      opt,
		store:    opt.Store,
		memory:   opt.Memory,
		events:   events,
		log:      log,
		buffers:  make(map[*Buffer]struct{}),
		domains:  make(map[*Domain]struct{}),
		users:    make(map[uint32]*UserStats),
		warned:   make(map[limitKind]time.Time),
		writers:  make(map[*Buffer]struct{}),
		kept:     make(map[*Buffer]int),
		sources:  make(map[*Buffer]struct{}),
		releases: make(chan struct{}),
	}
	m.maps.init()
	m.maps.reserveMin = opt.MapReserve
	if c := opt.MaxRegionSize; c > 0 && c < m.attr.MaxMRSize {
		m.attr.MaxMRSize = c // split as a device of that limit would
	}
	m.maxOpenFds = maxOpenFds(opt.FdReserve)
	return m
}

// maxOpenFds is what RLIMIT_NOFILE leaves clients' opens once reserve
// descriptors are kept for the daemon's own use.
func maxOpenFds(reserve int) int {
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &rl) != nil || rl.Cur > 1<<30 {
		return 1 << 30
	}
	return max(int(rl.Cur)-reserve, 16)
}

type noEvents struct{}

func (noEvents) Registered(uint64, time.Duration) {}
func (noEvents) Deregistered(uint64)              {}
func (noEvents) LimitHit(string)                  {}
func (noEvents) Changed(*Buffer)                  {}

// Device is the device buffers are registered on.
func (m *Manager) Device() verbs.Device { return m.dev }

// Options returns the options the manager enforces.
func (m *Manager) Options() Options { return m.opt }

// Stats returns current totals.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	// Read under mu: admission charges under mu before the pages exist,
	// so this reading never shows more used than charged but for what a
	// client wrote unseen.
	used, size, ok := m.store.Usage()
	if !ok {
		size = 0
	}
	users := make(map[uint32]UserStats, len(m.users))
	for uid, u := range m.users {
		users[uid] = *u
	}
	return Stats{
		Buffers:         len(m.buffers),
		PDs:             len(m.domains),
		RegisteredBytes: m.registered,
		PinnedBytes:     m.pinned,
		ChargedBytes:    m.charged,
		Orphans:         m.orphans,
		OrphanBytes:     m.orphaned,
		Users:           users,
		Store:           m.store.Kind(),
		StoreUsed:       used,
		StoreSize:       size,
		OpenFds:         m.openFds,
		MaxOpenFds:      m.maxOpenFds,
		Maps:            m.maps.usedLocked(),
		MaxMaps:         m.maps.limit,
		MapRoom:         m.maps.headroom(),
		Regions:         m.regions,
	}
}

// checkAccess applies the checks of SetAccess and SetDefaultAccess, in
// the documented order.
func (m *Manager) checkAccess(a verbs.Access) error {
	if err := a.Validate(); err != nil {
		return err
	}
	if extra := a &^ m.opt.Allowed; extra != 0 {
		return fmt.Errorf("access %s: %s not in buffers.allowed_access (%s): %w",
			a, extra, m.opt.Allowed, syscall.EPERM)
	}
	if extra := a &^ m.attr.Access; extra != 0 {
		return fmt.Errorf("access %s: device %s does not support %s: %w",
			a, m.dev.Name(), extra, syscall.EOPNOTSUPP)
	}
	return nil
}

// Close closes what is attached to the domains (remote connections,
// queue pairs), frees every buffer (deregister, unmap, remove) and
// deallocates every domain. It returns what it freed itself, counted as
// each call to the device succeeds, so that the caller reports the
// teardown that happened rather than the totals before it. Operations on
// the buffers and domains afterwards fail with ENODEV. Close is
// idempotent (a second call frees nothing); it closes neither the device
// nor the store.
func (m *Manager) Close() (Freed, error) { return m.close((*Buffer).free) }

// Leave is Close for a process that hands its store on to a later one
// (DESIGN, Restart): every registration and PD goes, as at Close, but
// the store's files stay as they are, bytes and all, for that process to
// adopt (Adopt). A manager that could not restore (tree.Restore) is left
// this way, so that the next try finds every file.
func (m *Manager) Leave() (Freed, error) { return m.close((*Buffer).leave) }

// close is Close and Leave: end takes each buffer.
func (m *Manager) close(end func(*Buffer, gone) (int, uint64, error)) (Freed, error) {
	var freed Freed
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return freed, nil
	}
	// From here Create and NewDomain refuse, so the sets only shrink.
	m.closed = true
	bufs := make([]*Buffer, 0, len(m.buffers))
	for b := range m.buffers {
		bufs = append(bufs, b)
	}
	var users []*user
	for d := range m.domains {
		for u := range d.users {
			users = append(users, u)
		}
		d.users = nil
	}
	m.mu.Unlock()

	// Peers go first: nothing reaches a region while it is deregistered,
	// and no queue pair holds a PD when it is deallocated.
	for _, u := range users {
		u.c.Close()
	}
	var errs []error
	for _, b := range bufs {
		// free waits for a Create still building b (it holds b.mu).
		nregions, unpinned, err := end(b, closed)
		if err != nil && !errors.Is(err, errClosed) && !errors.Is(err, errFreed) {
			errs = append(errs, err)
		}
		freed.Regions += nregions
		freed.UnpinnedBytes += unpinned
	}

	m.mu.Lock()
	for b, fd := range m.kept { // the mount is going: no mapping is left
		unix.Close(fd)
		delete(m.kept, b)
		m.openFds--
	}
	m.mu.Unlock()
	for d := range m.domainsSnapshot() {
		if p := d.Pool(); p != nil {
			// After the slots' buffers, before the PD.
			if err := p.close(); err != nil {
				errs = append(errs, err)
			}
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for d := range m.domains {
		if err := d.pd.Dealloc(); err != nil {
			errs = append(errs, fmt.Errorf("dealloc pd %d: %w", d.handle, err))
			continue
		}
		freed.PDs++
		d.closed = true
		delete(m.domains, d)
	}
	return freed, errors.Join(errs...)
}

// domainsSnapshot is the set of domains now.
func (m *Manager) domainsSnapshot() map[*Domain]struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return maps.Clone(m.domains)
}

// Sentinels for a buffer or domain that is gone. They wrap the errnos the
// FUSE layer answers with.
var (
	errFreed  = fmt.Errorf("buffer freed: %w", syscall.ENOENT)
	errClosed = fmt.Errorf("buffer manager closed: %w", syscall.ENODEV)
)

// reserveBuffer counts b, a new buffer in d for owner, and gives it an id
// for its file (kept, when non-zero: a file an earlier process made, which
// no later id may name), or refuses with ENOSPC past MaxBuffers. Files unlinked
// while open count: the store holds them until clients let go, which
// admission waits for briefly.
func (m *Manager) reserveBuffer(b *Buffer, d *Domain, owner uint32, kept uint64) (id uint64, err error) {
	deadline := time.Now().Add(releaseWait)
	m.mu.Lock()
	defer m.mu.Unlock()
	for {
		switch {
		case d.m != m:
			return 0, fmt.Errorf("domain belongs to another manager: %w", syscall.EINVAL)
		}
		if err := d.openLocked(); err != nil {
			return 0, err
		}
		if d.making {
			return 0, fmt.Errorf("pd %d is being made a pool: %w", d.handle, syscall.EBUSY)
		}
		max := m.opt.MaxBuffers
		if max <= 0 || len(m.buffers)+m.orphans < max {
			break
		}
		if m.orphans > 0 && m.waitReleaseLocked(deadline) {
			continue
		}
		open := ""
		if m.orphans > 0 {
			open = fmt.Sprintf(" (%d of them unlinked, still open)", m.orphans)
		}
		return 0, m.refuseLocked(limitMaxBuffers, syscall.ENOSPC, fmt.Sprintf("max_buffers (%d) reached", max),
			fmt.Sprintf("cannot create a buffer: max_buffers (%d) reached%s; raise buffers.max_buffers in the config", max, open))
	}
	m.buffers[b] = struct{}{}
	d.nbuf++
	b.access = d.access
	m.user(owner).Buffers++
	if kept != 0 {
		m.nextID = max(m.nextID, kept)
		return kept, nil
	}
	m.nextID++
	return m.nextID, nil
}

// waitReleaseLocked waits, releasing m.mu meanwhile, for an orphan's
// memory to be released or for deadline; it says whether one was.
// Callers hold m.mu.
func (m *Manager) waitReleaseLocked(deadline time.Time) bool {
	left := time.Until(deadline)
	if left <= 0 {
		return false
	}
	ch := m.releases
	m.mu.Unlock()
	defer m.mu.Lock()
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-t.C:
		return false
	}
}

// user is uid's charge, made on first use. Callers hold m.mu.
func (m *Manager) user(uid uint32) *UserStats {
	u := m.users[uid]
	if u == nil {
		u = &UserStats{}
		m.users[uid] = u
	}
	return u
}

// unuse drops uid's entry once it holds nothing. Callers hold m.mu.
func (m *Manager) unuse(uid uint32) {
	if u := m.users[uid]; u != nil && *u == (UserStats{}) {
		delete(m.users, uid)
	}
}

// errRaced says a client truncated the file below the range being
// registered while it was registered: pinning pages past EOF fails, and
// that failure says nothing about the device or a limit. Callers learn
// the new size and try again.
var errRaced = fmt.Errorf("file shrank during registration: %w", syscall.EAGAIN)

// maxRetries bounds the retries after errRaced.
const maxRetries = 3

// pinLocked moves the registered counters of owner from a region of
// oldLen bytes to one of newLen (either may be 0). Callers hold m.mu.
func (m *Manager) pinLocked(owner uint32, oldLen, newLen uint64) {
	oldP, newP := pageRound(oldLen), pageRound(newLen)
	u := m.user(owner)
	m.pinned = m.pinned - oldP + newP
	m.registered = m.registered - oldLen + newLen
	u.PinnedBytes = u.PinnedBytes - oldP + newP
	m.unuse(owner)
}
