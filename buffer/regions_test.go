package buffer_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"mrfs/buffer"
	"mrfs/verbs"
)

// setupMaxMRSize is setup on a device whose regions hold at most
// maxSize bytes.
func setupMaxMRSize(t *testing.T, opt buffer.Options, maxSize uint64, maxMR int) *env {
	t.Helper()
	e := setup(t, opt, maxMR)
	if _, err := e.m.Close(); err != nil {
		t.Fatal(err)
	}
	e.dev.maxMRSize = maxSize
	if opt.Allowed == 0 {
		opt.Allowed = allowed
	}
	if opt.Store == nil {
		opt.Store = newStore(t, opt)
	}
	e.m = buffer.NewManager(e.dev, opt, slog.New(slog.NewTextHandler(e.log, nil)))
	d, err := e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	e.d = d
	return e
}

// checkRegions checks that the regions cover the buffer's registered
// bytes in order, each at most maxSize, with keys of their own, that the
// device holds exactly them, and that Info agrees.
func checkRegions(t *testing.T, e *env, b *buffer.Buffer, maxSize uint64, want int) {
	t.Helper()
	in, rs := b.Regions()
	if len(rs) != want || in.Regions != want {
		t.Fatalf("%d regions (Info says %d), want %d: %+v", len(rs), in.Regions, want, rs)
	}
	mrs := b.MRs()
	next, keys := in.Addr, map[uint32]bool{}
	var total uint64
	for i, r := range rs {
		if r.Addr != next || r.Length == 0 || r.Length > maxSize {
			t.Fatalf("region %d %+v: want it at 0x%x, of 1 to %d bytes", i, r, next, maxSize)
		}
		if i < len(rs)-1 && r.Length != maxSize {
			t.Fatalf("region %d is %d bytes; only the last may be short of %d", i, r.Length, maxSize)
		}
		if mrs[i].Addr() != r.Addr || mrs[i].Length() != r.Length || mrs[i].LKey() != r.LKey || mrs[i].RKey() != r.RKey {
			t.Fatalf("region %d %+v is not the device's %x+%d", i, r, mrs[i].Addr(), mrs[i].Length())
		}
		if keys[r.LKey] {
			t.Fatalf("region %d repeats lkey 0x%x", i, r.LKey)
		}
		keys[r.LKey] = true
		next += uintptr(r.Length)
		total += r.Length
	}
	if total != in.Length || total != in.Size {
		t.Fatalf("regions hold %d bytes; Info says length %d, size %d", total, in.Length, in.Size)
	}
	if rs[0].LKey != in.LKey || rs[0].RKey != in.RKey {
		t.Fatal("Info's keys are not the first region's")
	}
	if live, _ := e.dev.counts(); live != e.m.Regions() {
		t.Fatalf("the device holds %d regions, the manager counts %d", live, e.m.Regions())
	}
}

// Options.MaxRegionSize splits as a device of that max_mr_size does, on
// a device without one; a cap above the device's changes nothing.
func TestRegionsSplitAtMaxRegionSize(t *testing.T) {
	const max = 8 * page
	e := setup(t, buffer.Options{MaxRegionSize: max + 100}, 0)
	b := e.create(t, 2*max+page)
	checkRegions(t, e, b, max, 3)
	e = setupMaxMRSize(t, buffer.Options{MaxRegionSize: 4 * max}, max, 0)
	b = e.create(t, 2*max+page)
	checkRegions(t, e, b, max, 3)
}

// A buffer past the device's max_mr_size is registered in regions of at
// most that size, in order; resizes keep the bytes and re-split.
func TestRegionsSplitAtMaxMRSize(t *testing.T) {
	const max = 8 * page
	e := setupMaxMRSize(t, buffer.Options{}, max, 0)
	b := e.create(t, max)
	checkRegions(t, e, b, max, 1)
	copy(b.Mem(), pattern(max, 3))

	if err := b.Resize(context.Background(), max+1); err != nil {
		t.Fatalf("one byte past max_mr_size: %v", err)
	}
	checkRegions(t, e, b, max, 2)
	if err := b.Resize(context.Background(), 2*max+4*page); err != nil {
		t.Fatal(err)
	}
	checkRegions(t, e, b, max, 3)
	if !bytes.Equal(b.Mem()[:max], pattern(max, 3)) {
		t.Fatal("the bytes did not survive the growth")
	}
	if st := e.m.Stats(); st.RegisteredBytes != 2*max+4*page || st.PinnedBytes != 2*max+4*page {
		t.Fatalf("Stats %+v", st)
	}
	// Access changes and moves re-register every region.
	before := b.Info()
	if err := b.SetAccess(verbs.LocalWrite | verbs.RemoteRead); err != nil {
		t.Fatal(err)
	}
	checkRegions(t, e, b, max, 3)
	for _, r := range b.MRs() {
		if r.Access() != verbs.LocalWrite|verbs.RemoteRead {
			t.Fatalf("a region kept access %s", r.Access())
		}
	}
	if b.Info().Generation != before.Generation+1 {
		t.Fatal("a re-registration of all regions is one generation")
	}
	d2, err := e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Move(d2); err != nil {
		t.Fatal(err)
	}
	checkRegions(t, e, b, max, 3)
	for _, r := range b.MRs() {
		if r.PD().Handle() != d2.PD() {
			t.Fatal("a region stayed in the old PD")
		}
	}
	if err := b.Resize(context.Background(), 5*page); err != nil {
		t.Fatal(err)
	}
	checkRegions(t, e, b, max, 1)
	if !bytes.Equal(b.Mem(), pattern(max, 3)[:5*page]) {
		t.Fatal("the bytes did not survive the shrink")
	}
	if err := b.Resize(context.Background(), 3*max); err != nil {
		t.Fatal(err)
	}
	checkRegions(t, e, b, max, 3)
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if live, _ := e.dev.counts(); live != 0 || e.m.Stats().PinnedBytes != 0 {
		t.Fatalf("after Free the device holds %d regions, %+v", live, e.m.Stats())
	}
}

// When the device runs out of regions part way through a split, the
// regions made are taken back and the buffer is as before; Close counts
// every region it frees.
func TestRegionsOutOfMaxMR(t *testing.T) {
	const max = 4 * page
	e := setupMaxMRSize(t, buffer.Options{}, max, 4)
	b := e.create(t, 2*max) // regions 1 and 2
	copy(b.Mem(), pattern(2*max, 5))
	before := b.Info()
	// Growing to 3 regions needs 3 more while 2 are held: the 5th fails.
	errnoIs(t, b.Resize(context.Background(), 3*max), syscall.EINVAL)
	if b.Info() != before || e.m.Regions() != 2 || e.m.Stats().PinnedBytes != 2*max {
		t.Fatalf("a failed split changed the buffer: %+v -> %+v, %d regions", before, b.Info(), e.m.Regions())
	}
	checkRegions(t, e, b, max, 2)
	if !bytes.Equal(b.Mem(), pattern(2*max, 5)) {
		t.Fatal("a failed split changed the bytes")
	}
	freed, err := e.m.Close()
	if err != nil || freed.Regions != 2 || freed.UnpinnedBytes != 2*max {
		t.Fatalf("Close: %+v, %v; want 2 regions of %d bytes", freed, err, 2*max)
	}
}

// populateHook replaces the population of each chunk for a test.
func populateHook(t *testing.T, f func(p unsafe.Pointer, n uint64) error) {
	t.Cleanup(buffer.SetPopulate(f))
}

// A big registration populates its new pages in chunks by several
// workers at once, before it registers them; small ones are not.
func TestPopulateInParallel(t *testing.T) {
	const size = 4 * buffer.PopulateChunk
	e := setup(t, buffer.Options{PopulateThreshold: 2 * buffer.PopulateChunk, PopulateWorkers: 2}, 0)
	var mu sync.Mutex
	var chunks []uint64
	var running, most atomic.Int32
	both := make(chan struct{})
	var once sync.Once
	populateHook(t, func(p unsafe.Pointer, n uint64) error {
		if r := running.Add(1); r > most.Load() {
			most.Store(r)
		}
		if running.Load() == 2 {
			once.Do(func() { close(both) })
		}
		select { // the first chunk waits for a second worker
		case <-both:
		case <-time.After(10 * time.Second):
			once.Do(func() { close(both) }) // none came: the rest need not wait
		}
		err := buffer.PopulateRange(p, n)
		running.Add(-1)
		mu.Lock()
		chunks = append(chunks, n)
		mu.Unlock()
		return err
	})
	small := e.create(t, 2*buffer.PopulateChunk-page)
	if len(chunks) != 0 {
		t.Fatalf("a registration below the threshold was populated: %v", chunks)
	}
	big := e.create(t, size)
	if len(chunks) != 4 || most.Load() != 2 {
		t.Fatalf("populated %v with at most %d workers at once; want 4 chunks, 2 at once", chunks, most.Load())
	}
	if _, held, err := big.File().Stat(); err != nil || held != size {
		t.Fatalf("the file holds %d bytes after population (%v), want %d", held, err, size)
	}
	// A growth populates only what is new.
	chunks = nil
	if err := big.Resize(context.Background(), size+buffer.PopulateChunk); err != nil {
		t.Fatal(err)
	}
	if len(chunks) != 1 {
		t.Fatalf("growing by a chunk populated %v", chunks)
	}
	_ = small
}

// A worker that fails (ENOMEM) stops the population: the registration
// that was there stays, with its keys and bytes, nothing more is pinned,
// and the file is its old size again.
func TestPopulateFailureKeepsRegistration(t *testing.T) {
	e := setup(t, buffer.Options{PopulateThreshold: buffer.PopulateChunk, PopulateWorkers: 2}, 0)
	b := e.create(t, 4*page)
	copy(b.Mem(), pattern(4*page, 7))
	before, st := b.Info(), e.m.Stats()
	var calls atomic.Int32
	populateHook(t, func(p unsafe.Pointer, n uint64) error {
		if calls.Add(1) == 3 {
			return syscall.ENOMEM
		}
		return buffer.PopulateRange(p, n)
	})
	errnoIs(t, b.Resize(context.Background(), 6*buffer.PopulateChunk), syscall.ENOMEM)
	if b.Info() != before || e.m.Stats().PinnedBytes != st.PinnedBytes || e.m.Regions() != 1 {
		t.Fatalf("a failed population changed the buffer: %+v -> %+v", before, b.Info())
	}
	if size, _, err := b.File().Stat(); err != nil || size != 4*page {
		t.Fatalf("the file is %d bytes after the failure (%v), want %d", size, err, 4*page)
	}
	if !bytes.Equal(b.Mem(), pattern(4*page, 7)) {
		t.Fatal("the bytes changed")
	}
}

// While a big registration runs, Info reports its progress and the state
// before it, and Sync does not wait; the caller's context ending (a FUSE
// INTERRUPT) stops it with EINTR and leaves the buffer as before.
func TestRegistrationProgressAndInterrupt(t *testing.T) {
	const size = 4 * buffer.PopulateChunk
	e := setup(t, buffer.Options{PopulateThreshold: buffer.PopulateChunk, PopulateWorkers: 1}, 0)
	b := e.create(t, 2*page)
	before, pinned := b.Info(), e.m.Stats().PinnedBytes
	second := make(chan struct{})
	release := make(chan struct{})
	var calls atomic.Int32
	populateHook(t, func(p unsafe.Pointer, n uint64) error {
		if calls.Add(1) == 2 {
			close(second)
			<-release
		}
		return buffer.PopulateRange(p, n)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- b.Resize(ctx, size) }()
	<-second
	infos := make(chan buffer.Info, 1)
	go func() { infos <- b.Info() }()
	var in buffer.Info
	select {
	case in = <-infos:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("Info waits for the registration")
	}
	if in.Progress != (buffer.Progress{Done: buffer.PopulateChunk, Total: size}) {
		t.Errorf("progress %+v during the second chunk, want 1 chunk of %d", in.Progress, size)
	}
	in.Progress = buffer.Progress{}
	if in != before {
		t.Errorf("during the registration Info is %+v, want the state before it %+v", in, before)
	}
	synced := make(chan error, 1)
	go func() { synced <- b.Sync() }()
	select {
	case err := <-synced:
		if err != nil {
			t.Errorf("Sync during a registration: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("Sync waits for the registration")
	}
	cancel()
	close(release)
	err := <-done
	errnoIs(t, err, syscall.EINTR)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("%v does not say the call was canceled", err)
	}
	if b.Info() != before || e.m.Stats().PinnedBytes != pinned || e.m.Regions() != 1 {
		t.Fatalf("an interrupted registration changed the buffer: %+v -> %+v", before, b.Info())
	}
	if size, _, err := b.File().Stat(); err != nil || size != 2*page {
		t.Fatalf("the file is %d bytes after the interruption (%v)", size, err)
	}
	if calls.Load() != 2 {
		t.Fatalf("population went on after the interruption: %d chunks", calls.Load())
	}
}

// A reader that comes after a registration took the buffer's lock, but
// before it published its progress, answers from the progress once it
// is published, not when the registration ends (a getxattr of
// user.mrfs.state right as a truncate to gigabytes starts).
func TestReadersDoNotWaitForARegistration(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, 2*page)
	before := b.Info()
	publish, done := b.HoldLikeRegistration()
	infos := make(chan buffer.Info, 1)
	synced := make(chan error, 1)
	go func() { infos <- b.Info() }()
	go func() { synced <- b.Sync() }()
	select {
	case <-infos:
		done()
		t.Fatal("Info answered while the buffer was locked and no progress published")
	case <-time.After(50 * time.Millisecond):
	}
	publish(8 * page)
	select {
	case in := <-infos:
		if in.Progress.Total != 8*page {
			t.Errorf("progress %+v, want a total of %d", in.Progress, 8*page)
		}
		in.Progress = buffer.Progress{}
		if in != before {
			t.Errorf("Info %+v during the registration, want the state before it %+v", in, before)
		}
	case <-time.After(10 * time.Second):
		done()
		t.Fatal("Info waits for the registration to end")
	}
	select {
	case err := <-synced:
		if err != nil {
			t.Errorf("Sync during the registration: %v", err)
		}
	case <-time.After(10 * time.Second):
		done()
		t.Fatal("Sync waits for the registration to end")
	}
	done()
}
