package buffer_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/verbs"
)

// newPool makes e's first domain a pool of slots slots of slot bytes.
func newPool(t *testing.T, e *env, slot uint64, slots int) *buffer.Pool {
	t.Helper()
	p, err := e.d.MakePool(slot, slots, 0)
	if err != nil {
		t.Fatalf("MakePool(%d, %d): %v", slot, slots, err)
	}
	return p
}

// A pool of 8 slots is one region; its files take slots without a
// registration of their own, share the chunk's keys at their own
// addresses, and a full pool is ENOSPC naming the pool.
func TestPoolSlots(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	p := newPool(t, e, 64<<10, 8)
	if mrs, _ := e.dev.counts(); mrs != 1 {
		t.Fatalf("a pool of 8 slots holds %d regions, want 1", mrs)
	}
	in := p.Info()
	if in.Slots != 8 || in.Used != 0 || in.Chunks != 1 || len(in.Regions) != 1 || in.Regions[0].Length != 8*64<<10 {
		t.Fatalf("pool info %+v", in)
	}
	var bufs []*buffer.Buffer
	for i := range 8 {
		b, err := e.m.Create(e.d, 0, 0)
		if err != nil {
			t.Fatalf("slot %d: %v", i, err)
		}
		bi := b.Info()
		if bi.State != buffer.Registered || bi.Size != 64<<10 || bi.Length != 64<<10 || bi.Pool == nil || bi.Pool.Index != i ||
			bi.RKey != in.Regions[0].RKey || bi.Addr != in.Regions[0].Addr+uintptr(i*64<<10) {
			t.Fatalf("slot %d: info %+v, pool region %+v", i, bi, in.Regions[0])
		}
		bufs = append(bufs, b)
	}
	if mrs, _ := e.dev.counts(); mrs != 1 {
		t.Fatalf("8 pool files hold %d regions, want the chunk's 1", mrs)
	}
	_, err := e.m.Create(e.d, 0, 0)
	if !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "pool") {
		t.Fatalf("a ninth file in a pool of 8: %v, want ENOSPC naming the pool", err)
	}
	if got := p.Info().Used; got != 8 {
		t.Fatalf("used %d, want 8", got)
	}
	// A freed slot is given again, zeroed.
	if _, err := bufs[3].WriteAt([]byte("secret"), 100); err != nil {
		t.Fatal(err)
	}
	if err := bufs[3].Free(); err != nil {
		t.Fatal(err)
	}
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if b.Info().Pool.Index != 3 {
		t.Fatalf("the freed slot 3 was not given again: %+v", b.Info().Pool)
	}
	got := make([]byte, 64<<10)
	if n, err := b.ReadAt(got, 0); err != nil || n != len(got) || !bytes.Equal(got, make([]byte, len(got))) {
		t.Fatalf("a reused slot reads %d bytes (%v), not all zero: no byte of one file may reach the next", n, err)
	}
}

// The rules of a pool file: its size is the slot's; writes stop at its
// end; its access is the pool's; it cannot move; O_TRUNC zeroes it.
func TestPoolFileRules(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	newPool(t, e, 16<<10, 2)
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := b.Resize(ctx, 16<<10); err != nil {
		t.Errorf("truncate to the slot size: %v", err)
	}
	for _, size := range []uint64{0, 4096, 32 << 10} {
		if err := b.Resize(ctx, size); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("truncate a pool file to %d: %v, want EINVAL", size, err)
		}
	}
	if n, err := b.WriteAt(make([]byte, 8192), 12<<10); n != 4096 || err != nil {
		t.Errorf("a write across the slot's end wrote %d (%v), want the 4096 that fit", n, err)
	}
	if _, err := b.WriteAt([]byte{1}, 16<<10); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("a write at the slot's end: %v, want EFBIG", err)
	}
	if err := b.Allocate(ctx, 0, 4096, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE); !errors.Is(err, syscall.EPERM) {
		t.Errorf("punching a hole in a pool file: %v, want EPERM", err)
	}
	if err := b.SetAccess(verbs.LocalWrite | verbs.RemoteRead); !errors.Is(err, syscall.EPERM) || !strings.Contains(e.log.String(), "default_access") {
		t.Errorf("SetAccess on a pool file: %v, want EPERM pointing at default_access", err)
	}
	other, err := e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Move(other); !errors.Is(err, syscall.EXDEV) {
		t.Errorf("moving a pool file out: %v, want EXDEV", err)
	}
	if _, err := b.WriteAt([]byte("abc"), 0); err != nil {
		t.Fatal(err)
	}
	if err := b.Clear(ctx); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 3)
	b.ReadAt(got, 0)
	if in := b.Info(); !bytes.Equal(got, []byte{0, 0, 0}) || in.Size != 16<<10 {
		t.Errorf("after O_TRUNC: %q, size %d; want zeroes and the slot size", got, in.Size)
	}
	sa, err := e.m.Create(other, 4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := sa.Move(e.d); !errors.Is(err, syscall.EXDEV) {
		t.Errorf("moving a file into a pool: %v, want EXDEV", err)
	}
}

// Setting the pool's default access re-registers its chunks: every file
// gets the new keys and access at once; the old keys are dead.
func TestPoolAccess(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	newPool(t, e, 4096, 4)
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	before := b.Info()
	if err := e.d.SetDefaultAccess(verbs.LocalWrite | verbs.RemoteWrite); err != nil {
		t.Fatal(err)
	}
	after := b.Info()
	if after.RKey == before.RKey || after.Access != verbs.LocalWrite|verbs.RemoteWrite || after.Addr != before.Addr {
		t.Fatalf("after default_access: %+v (before %+v)", after, before)
	}
	if mrs, _ := e.dev.counts(); mrs != 1 {
		t.Fatalf("%d regions after the re-registration, want 1", mrs)
	}
}

// A pool is admitted whole, and counted against its owner's quota and
// the budget: past them, nothing is made.
func TestPoolAdmission(t *testing.T) {
	e := setup(t, buffer.Options{MaxPinned: 1 << 20, MaxPinnedPerUser: 512 << 10}, 0)
	if _, err := e.d.MakePool(64<<10, 16, 0); !errors.Is(err, syscall.EDQUOT) {
		t.Fatalf("a pool of 1 MiB past a quota of 512 KiB: %v, want EDQUOT", err)
	}
	if mrs, _ := e.dev.counts(); mrs != 0 {
		t.Fatalf("a refused pool left %d regions", mrs)
	}
	p := newPool(t, e, 64<<10, 4)
	if err := p.SetSlots(8, 0); err != nil {
		t.Fatalf("raising the slots to 8: %v", err)
	}
	if in := p.Info(); in.Slots != 8 || in.Chunks != 2 {
		t.Fatalf("after raising: %+v, want 8 slots in 2 chunks", in)
	}
	if s := e.m.Stats(); s.ChargedBytes != 512<<10 || s.Users[0].Charged != 512<<10 || s.RegisteredBytes != 512<<10 {
		t.Fatalf("a pool of 512 KiB: %+v", s)
	}
	if s := e.m.Stats(); s.Store == "tmpfs" && s.StoreSize != 512<<10 {
		t.Fatalf("the store's bound beside a pool of 512 KiB: %d, want the budget's other 512 KiB", s.StoreSize)
	}
	other, err := e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Create(other, 4096, 0); !errors.Is(err, syscall.EDQUOT) {
		t.Fatalf("a buffer past the quota the pool fills: %v, want EDQUOT", err)
	}
	if err := p.SetSlots(9, 0); !errors.Is(err, syscall.EDQUOT) {
		t.Fatalf("raising past the quota: %v, want EDQUOT", err)
	}
	if err := p.SetSlots(6, 0); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("lowering to 6 (chunks end at 4 and 8): %v, want EINVAL", err)
	}
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	for range 4 {
		if _, err := e.m.Create(e.d, 0, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.SetSlots(4, 0); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("lowering while slot 4 is used: %v, want EBUSY", err)
	}
	_ = b
	if in := p.Info(); in.Used != 5 {
		t.Fatalf("used %d, want 5", in.Used)
	}
}

// Lowering the slots frees the last chunk: its region, mappings and
// charge go.
func TestPoolShrink(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	p := newPool(t, e, 64<<10, 4)
	if err := p.SetSlots(8, 0); err != nil {
		t.Fatal(err)
	}
	maps := e.m.Stats().Maps
	if err := p.SetSlots(4, 0); err != nil {
		t.Fatalf("lowering to 4 with the second chunk free: %v", err)
	}
	s := e.m.Stats()
	if mrs, _ := e.dev.counts(); mrs != 1 || s.ChargedBytes != 256<<10 || s.RegisteredBytes != 256<<10 || s.Maps != maps-4 {
		t.Fatalf("after lowering: %d regions, %+v (maps before %d)", mrs, s, maps)
	}
}

// A create that finds every free slot still being zeroed waits for one
// rather than calling the pool full; what it gets is zeroed.
func TestPoolWaitsForZeroing(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	const slot = 64 << 10
	newPool(t, e, slot, 1)
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.WriteAt(bytes.Repeat([]byte{7}, slot), 0); err != nil {
		t.Fatal(err)
	}
	started, let := holdZeroing(t)
	go b.Free() // zeroes the slot before it returns
	<-started
	made := make(chan error, 1)
	go func() {
		var err error
		b, err = e.m.Create(e.d, 0, 0)
		made <- err
	}()
	select {
	case err := <-made:
		t.Fatalf("a create while the only slot is being zeroed returned (%v), want it to wait", err)
	case <-time.After(50 * time.Millisecond):
	}
	let()
	if err := <-made; err != nil {
		t.Fatalf("a create once the slot is zeroed: %v", err)
	}
	got := make([]byte, slot)
	b.ReadAt(got, 0)
	if !bytes.Equal(got, make([]byte, slot)) {
		t.Fatal("the slot was given before it was zeroed")
	}
}

// Lowering the slots while a slot of the last chunk is being zeroed
// waits for the zeroing before that chunk is unmapped.
func TestPoolShrinkWhileZeroing(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	p := newPool(t, e, 64<<10, 1)
	if err := p.SetSlots(2, 0); err != nil {
		t.Fatal(err)
	}
	var last *buffer.Buffer // the file of slot 1, in the second chunk
	for range 2 {
		b, err := e.m.Create(e.d, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		if b.Info().Pool.Index == 1 {
			last = b
		}
	}
	started, let := holdZeroing(t)
	go last.Free() // zeroes the slot before it returns
	<-started
	done := make(chan error, 1)
	go func() { done <- p.SetSlots(1, 0) }()
	select {
	case err := <-done:
		t.Fatalf("lowering to 1 returned (%v) while slot 1 was being zeroed", err)
	case <-time.After(50 * time.Millisecond):
	}
	let()
	if err := <-done; err != nil {
		t.Fatalf("lowering to 1 once slot 1 is zeroed: %v", err)
	}
	if in := p.Info(); in.Slots != 1 || in.Chunks != 1 || in.Used != 1 {
		t.Fatalf("after lowering: %+v", in)
	}
}

// holdZeroing makes the next slot zeroing wait, once started, until let
// is called (at the latest at the test's end, before the manager closes,
// which waits for it).
func holdZeroing(t *testing.T) (started <-chan struct{}, let func()) {
	start, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	let = func() { once.Do(func() { close(release) }) }
	t.Cleanup(let)
	t.Cleanup(buffer.SetZeroSlot(func(mem []byte) {
		close(start)
		<-release
		clear(mem)
	}))
	return start, let
}

// Removing a pool while the slot of a file unlinked while open is being
// zeroed, at that file's last close, waits for the zeroing before the
// chunks are unmapped.
func TestPoolCloseWhileZeroing(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	newPool(t, e, 64<<10, 2)
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := b.Open(true)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil { // unlinked while open: zeroed at its last close
		t.Fatal(err)
	}
	started, let := holdZeroing(t)
	go fd.Close()
	<-started
	done := make(chan error, 1)
	go func() { done <- e.d.Close() }()
	select {
	case err := <-done:
		t.Fatalf("removing the pool returned (%v) while a slot was being zeroed", err)
	case <-time.After(50 * time.Millisecond):
	}
	let()
	if err := <-done; err != nil {
		t.Fatalf("removing the pool: %v", err)
	}
	if mrs, _ := e.dev.counts(); mrs != 0 {
		t.Fatalf("%d regions after the pool went", mrs)
	}
}

// A create in a pool whose only slot is held by a file unlinked while
// open waits a little for its last close (the kernel's RELEASE comes
// after the client's close returns) rather than calling the pool full.
func TestPoolWaitsForRelease(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	newPool(t, e, 4096, 1)
	b, err := e.m.Create(e.d, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := b.Open(true)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(50*time.Millisecond, fd.Close)
	if _, err := e.m.Create(e.d, 0, 0); err != nil {
		t.Fatalf("a create while the only slot's unlinked file is being closed: %v, want it to wait", err)
	}
	// Held open past the wait: the pool is full, and says why.
	fd2, err := e.m.Create(e.d, 0, 0)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("a second file in a pool of one: %v (%v), want ENOSPC", err, fd2)
	}
}

// Only a pool's owner, who pays for its slots, or root changes them.
func TestPoolSlotsByOwner(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	p, err := e.d.MakePool(page, 1, 7)
	if err != nil {
		t.Fatal(err)
	}
	errnoIs(t, p.SetSlots(2, 8), syscall.EPERM)
	if err := p.SetSlots(2, 7); err != nil {
		t.Fatalf("the owner grows its pool: %v", err)
	}
	if err := p.SetSlots(1, 0); err != nil {
		t.Fatalf("root shrinks it: %v", err)
	}
	if got := p.Info().Slots; got != 1 {
		t.Fatalf("%d slots, want 1", got)
	}
}
