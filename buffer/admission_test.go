package buffer_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/internal/sysmem"
	"mrfs/store"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// events records what a Manager reports.
type events struct {
	mu          sync.Mutex
	regs, deres int
	regBytes    uint64
	limits      []string
}

func (e *events) Registered(n uint64, took time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.regs++
	e.regBytes += n
}

func (e *events) Deregistered(n uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.deres++
}

func (e *events) Changed(*buffer.Buffer) {}

func (e *events) LimitHit(limit string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.limits = append(e.limits, limit)
}

func (e *events) hits() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return strings.Join(e.limits, ",")
}

// Per-user quotas: EDQUOT past a uid's own bytes, charged to the owner,
// moving with the owner (chown), reported in Stats.Users.
func TestPerUserQuota(t *testing.T) {
	ev := &events{}
	e := setup(t, buffer.Options{MaxPinnedPerUser: 4 * page, Events: ev}, 0)
	a, err := e.m.Create(e.d, 3*page, 1000)
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.m.Create(e.d, 2*page, 1000)
	errnoIs(t, err, syscall.EDQUOT)
	_, err = e.m.Create(e.d, 5*page, 2000)
	errnoIs(t, err, syscall.EDQUOT) // more than the quota at all
	b, err := e.m.Create(e.d, 2*page, 2000)
	if err != nil {
		t.Fatalf("another user's buffer: %v", err)
	}
	st := e.m.Stats()
	if st.Users[1000] != (buffer.UserStats{Buffers: 1, PinnedBytes: 3 * page, Charged: 3 * page}) || st.Users[2000] != (buffer.UserStats{Buffers: 1, PinnedBytes: 2 * page, Charged: 2 * page}) || len(st.Users) != 2 {
		t.Fatalf("Users %+v", st.Users)
	}
	errnoIs(t, a.Resize(context.Background(), 5*page), syscall.EDQUOT)
	if err := a.Resize(context.Background(), 4*page); err != nil {
		t.Fatalf("up to the quota: %v", err)
	}
	// chown: the charge follows, and the new owner's quota must hold it.
	errnoIs(t, a.SetOwner(2000), syscall.EDQUOT)
	if a.Info().Owner != 1000 {
		t.Fatal("a refused chown changed the owner")
	}
	if err := b.SetOwner(1000); err == nil {
		t.Fatal("uid 1000 took 2 more pages past its quota")
	}
	if err := a.Resize(context.Background(), page); err != nil {
		t.Fatal(err)
	}
	if err := b.SetOwner(1000); err != nil {
		t.Fatalf("chown into room: %v", err)
	}
	st = e.m.Stats()
	if st.Users[1000] != (buffer.UserStats{Buffers: 2, PinnedBytes: 3 * page, Charged: 3 * page}) || len(st.Users) != 1 {
		t.Fatalf("after chown: Users %+v", st.Users)
	}
	if !strings.Contains(e.log.String(), "max_pinned_per_user") || !strings.Contains(ev.hits(), "max_pinned_per_user") {
		t.Fatalf("the quota is not named: %s / %s", e.log.String(), ev.hits())
	}
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	if st := e.m.Stats(); st.Users[1000] != (buffer.UserStats{Buffers: 1, PinnedBytes: 2 * page, Charged: 2 * page}) {
		t.Fatalf("after Free: %+v", st.Users)
	}
}

// Pages that do not exist yet must fit in what the machine and the
// cgroup have left, beyond a reserve: ENOMEM, naming which, and nothing
// changes. Pages the file already holds need nothing.
func TestMemoryAdmission(t *testing.T) {
	var mu sync.Mutex
	mem := sysmem.Memory{Total: 1 << 40, Available: 1 << 40}
	clock := time.Unix(1000, 0)
	defer buffer.SetClock(func() time.Time { mu.Lock(); defer mu.Unlock(); return clock })()
	ev := &events{}
	e := setup(t, buffer.Options{Events: ev, Memory: func() (sysmem.Memory, error) {
		mu.Lock()
		defer mu.Unlock()
		return mem, nil
	}}, 0)
	set := func(m sysmem.Memory) { // and a reading is due
		mu.Lock()
		mem, clock = m, clock.Add(buffer.MemoryFresh)
		mu.Unlock()
	}
	b := e.create(t, 4*page)
	copy(b.Mem(), pattern(4*page, 2))
	before := b.Info()

	set(sysmem.Memory{Total: 1 << 30, Available: 32<<20 + page})
	errnoIs(t, b.Resize(context.Background(), 6*page), syscall.ENOMEM)
	if b.Info() != before || e.m.Stats().PinnedBytes != 4*page {
		t.Fatal("a refused Resize changed something")
	}
	if !strings.Contains(e.log.String(), "MemAvailable") || ev.hits() != "MemAvailable" {
		t.Fatalf("MemAvailable not named: %s / %s", e.log.String(), ev.hits())
	}
	// The pages are there already: a move or access change pins nothing new.
	if err := b.SetAccess(verbs.LocalWrite | verbs.RemoteRead); err != nil {
		t.Fatalf("SetAccess with no memory left: %v", err)
	}

	set(sysmem.Memory{Total: 1 << 40, Available: 1 << 40, Cgroup: "/sys/fs/cgroup/memory/x", CgroupLimit: 1 << 30, CgroupUsage: 1<<30 - 32<<20})
	errnoIs(t, b.Resize(context.Background(), 8*page), syscall.ENOMEM)
	if !strings.Contains(e.log.String(), "/sys/fs/cgroup/memory/x") || ev.hits() != "MemAvailable,memory cgroup" {
		t.Fatalf("the cgroup is not named: %s / %s", e.log.String(), ev.hits())
	}
	if in := b.Info(); in.Size != 4*page || in.Length != 4*page {
		t.Fatalf("after the refusal %+v", in)
	}
	set(sysmem.Memory{Total: 1 << 40, Available: 1 << 40})
	if err := b.Resize(context.Background(), 8*page); err != nil {
		t.Fatalf("once there is room: %v", err)
	}
}

// A reading of the memory left is reused for a while, less what was
// admitted since; close to a limit, or once it is old, a new one is taken.
func TestMemoryReadingReused(t *testing.T) {
	var mu sync.Mutex
	reads := 0
	const mib = 1 << 20
	const size = 16 * mib
	// Room for two more beyond what a registration keeps clear.
	const avail = 2*size + buffer.MemReserve + buffer.MemoryNear + 2*mib
	clock := time.Unix(1000, 0)
	defer buffer.SetClock(func() time.Time { mu.Lock(); defer mu.Unlock(); return clock })()
	e := setup(t, buffer.Options{Memory: func() (sysmem.Memory, error) {
		mu.Lock()
		defer mu.Unlock()
		reads++
		return sysmem.Memory{Total: 1 << 40, Available: avail}, nil
	}}, 0)
	want := func(n int, what string) {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		if reads != n {
			t.Fatalf("%s: %d readings, want %d", what, reads, n)
		}
	}
	e.create(t, size)
	want(1, "the first registration")
	e.create(t, size)
	want(1, "a second one far from the limits")
	e.create(t, size)
	want(2, "one that the reading, less what was admitted since, brings near a limit")
	e.create(t, page)
	want(2, "a page far from the limits")
	mu.Lock()
	clock = clock.Add(buffer.MemoryFresh)
	mu.Unlock()
	e.create(t, page)
	want(3, "one once the reading is old")
}

// The tmpfs store is the budget: pages a client wrote through its own
// descriptor, past what can be registered, are charged to the file's
// owner when the daemon looks (they count against the budget), and an
// unlinked file a client still holds keeps its charge until the store
// reports its memory gone.
func TestStoreFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	e := setup(t, buffer.Options{MaxPinned: 8 * page}, 0)
	a := e.create(t, 2*page)
	z := e.create(t, 0)
	f := outside(t, z)
	for i := range 6 { // six pages far past the budget: z cannot be registered
		if _, err := f.WriteAt([]byte("z"), int64(20+i)*page); err != nil {
			t.Fatal(err)
		}
	}
	errnoIs(t, z.Sync(), syscall.EFBIG)
	if st := e.m.Stats(); st.StoreUsed != 8*page || st.PinnedBytes != 2*page || st.ChargedBytes != 8*page || z.Charged() != 6*page {
		t.Fatalf("Stats %+v, z charged %d", st, z.Charged())
	}
	err := a.Resize(context.Background(), 4*page)
	errnoIs(t, err, syscall.ENOSPC)
	check(t, e, a, 2*page, buffer.Registered)
	if !strings.Contains(err.Error(), "max_pinned (32 KiB) reached") {
		t.Fatalf("the budget is not named: %v", err)
	}
	if _, err := f.WriteAt([]byte("z"), 30*page); err == nil {
		t.Fatal("a client wrote past the store's size")
	} else if !strings.Contains(err.Error(), "no space") {
		t.Fatalf("a client's write past the store: %v, want ENOSPC", err)
	}
	if err := z.Free(); err != nil {
		t.Fatal(err)
	}
	// A client's descriptor keeps the removed file's pages, charged; once
	// closed, they are the store's again.
	if st := e.m.Stats(); st.Orphans != 1 || st.OrphanBytes != 6*page || st.ChargedBytes != 8*page || st.Buffers != 1 {
		t.Fatalf("with the unlinked file open: Stats %+v", st)
	}
	errnoIs(t, a.Resize(context.Background(), 4*page), syscall.ENOSPC)
	f.Close()
	if err := a.Resize(context.Background(), 4*page); err != nil {
		t.Fatalf("once the store has room: %v", err)
	}
	if st := e.m.Stats(); st.Orphans != 0 || st.ChargedBytes != 4*page || st.StoreUsed != 4*page {
		t.Fatalf("after the release: Stats %+v", st)
	}
}

// Registrations, deregistrations and refusals reach Events.
func TestEvents(t *testing.T) {
	ev := &events{}
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	m := buffer.NewManager(dev, buffer.Options{Allowed: allowed, MaxBuffers: 1, Events: ev, Store: newStore(t, buffer.Options{})}, nil)
	d, _ := m.NewDomain(verbs.LocalWrite)
	b, err := m.Create(d, page, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Resize(context.Background(), 2*page); err != nil {
		t.Fatal(err)
	}
	_, err = m.Create(d, 0, 0)
	errnoIs(t, err, syscall.ENOSPC)
	if _, err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if ev.regs != 2 || ev.regBytes != 3*page || ev.deres != 2 || ev.hits() != "max_buffers" {
		t.Fatalf("events: %d registrations of %d bytes, %d deregistrations, limits %q", ev.regs, ev.regBytes, ev.deres, ev.hits())
	}
}

// The budget is exact to the page: on memfds (no store of its own to
// catch it) the manager's count alone admits up to max_pinned and refuses
// one page more.
func TestMaxPinnedExact(t *testing.T) {
	e := setup(t, buffer.Options{MaxPinned: 4 * page, Store: store.NewMemfd()}, 0)
	e.create(t, 3*page)
	b := e.create(t, page)
	errnoIs(t, b.Resize(context.Background(), page+1), syscall.ENOSPC)
	check(t, e, b, page, buffer.Registered)
	_, err := e.m.Create(e.d, 1, 0)
	errnoIs(t, err, syscall.ENOSPC)
}
