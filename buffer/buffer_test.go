package buffer_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/verbs"
)

func TestCreateEmptyAndRegistered(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b0 := e.create(t, 0)
	check(t, e, b0, 0, buffer.Empty)
	if b0.File() == nil {
		t.Fatal("empty buffer has no file")
	}
	if got := b0.Info(); got.Access != verbs.LocalWrite || got.PD != e.d.PD() || got.Generation != 0 {
		t.Fatalf("Info %+v: want the domain's access and PD, no registration yet", got)
	}

	b := e.create(t, 10000)
	check(t, e, b, 10000, buffer.Registered)
	in := b.Info()
	if in.LKey != in.RKey || in.LKey == 0 {
		t.Fatalf("soft keys: lkey 0x%x rkey 0x%x", in.LKey, in.RKey)
	}
	if in.Generation != 1 {
		t.Fatalf("Generation %d after one registration", in.Generation)
	}
	// The memory is the file's: what the daemon mapping holds, pread sees.
	copy(b.Mem(), pattern(10000, 1))
	if !bytes.Equal(readAll(t, b), pattern(10000, 1)) {
		t.Fatal("pread does not see the registered mapping's bytes")
	}
	st := e.m.Stats()
	if st.Buffers != 2 || st.PDs != 1 || st.RegisteredBytes != 10000 || st.PinnedBytes != 3*page ||
		len(st.Users) != 1 || st.Users[0] != (buffer.UserStats{Buffers: 2, PinnedBytes: 3 * page, Charged: 3 * page}) {
		t.Fatalf("Stats %+v", st)
	}
	if e.d.Buffers() != 2 || e.m.Regions() != 1 {
		t.Fatalf("domain holds %d buffers, manager %d regions", e.d.Buffers(), e.m.Regions())
	}
}

// TestResizeSequence grows and shrinks through page boundaries and to 0,
// checking data, keys and that every old region is gone.
func TestResizeSequence(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, page)
	copy(b.Mem(), pattern(page, 3))
	want := pattern(page, 3)
	for _, size := range []uint64{10000, 3, 1 << 20, 1<<20 + 1, 5000, 4096, 0, 7000, 100, 0, 0, 64 << 10} {
		old := b.MR()
		oldKey, oldGen := b.Info().RKey, b.Info().Generation
		if err := b.Resize(context.Background(), size); err != nil {
			t.Fatalf("Resize(%d): %v", size, err)
		}
		state := buffer.Registered
		if size == 0 {
			state = buffer.Empty
		}
		check(t, e, b, size, state)
		if old != nil && uint64(len(want)) != size {
			deadMR(t, old)
			if size > 0 && b.Info().RKey == oldKey {
				t.Fatalf("Resize(%d) kept rkey 0x%x", size, oldKey)
			}
		}
		if size > 0 && uint64(len(want)) != size && b.Info().Generation != oldGen+1 {
			t.Fatalf("Resize(%d): generation %d -> %d", size, oldGen, b.Info().Generation)
		}
		// The first min(old, new) bytes are kept, the rest reads 0.
		keep := min(uint64(len(want)), size)
		got := readAll(t, b)
		if !bytes.Equal(got[:keep], want[:keep]) {
			t.Fatalf("Resize(%d) lost data", size)
		}
		if bytes.Count(got[keep:], []byte{0}) != len(got[keep:]) {
			t.Fatalf("Resize(%d): grown part is not zero", size)
		}
		if size > 0 && !bytes.Equal(b.Mem(), got) {
			t.Fatalf("Resize(%d): mapping and file disagree", size)
		}
		want = pattern(size, byte(size))
		if size > 0 {
			copy(b.Mem(), want)
		}
		if mrs, _ := e.dev.counts(); e.m.Regions() != mrs || mrs != int(min(size, 1)) {
			t.Fatalf("after Resize(%d): manager counts %d regions, device %d", size, e.m.Regions(), mrs)
		}
		if st := e.m.Stats(); st.RegisteredBytes != size || st.PinnedBytes != buffer.PageRound(size) {
			t.Fatalf("after Resize(%d): %+v", size, st)
		}
	}
}

// TestSyncExternalGrow writes past EOF through another fd of the file, as
// a passthrough client does, and checks Sync registers the new size.
func TestSyncExternalGrow(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	for _, start := range []uint64{0, 100, page} {
		b := e.create(t, start)
		copy(b.Mem(), pattern(start, 5))
		f := outside(t, b)
		tail := []byte("hello from a client")
		off := int64(3*page + 17)
		if _, err := f.WriteAt(tail, off); err != nil {
			t.Fatal(err)
		}
		old := b.MR()
		if b.Info().Size != start {
			t.Fatal("size changed before Sync")
		}
		if err := b.Sync(); err != nil {
			t.Fatalf("Sync: %v", err)
		}
		size := uint64(off) + uint64(len(tail))
		check(t, e, b, size, buffer.Registered)
		if old != nil {
			deadMR(t, old)
		}
		mem := b.Mem()
		if !bytes.Equal(mem[:start], pattern(start, 5)) || !bytes.Equal(mem[off:], tail) {
			t.Fatal("registered mapping does not show the client's bytes")
		}
		// A second Sync with nothing changed keeps the region.
		mr := b.MR()
		if err := b.Sync(); err != nil || b.MR() != mr {
			t.Fatalf("idle Sync: %v, region replaced: %v", err, b.MR() != mr)
		}
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSyncExternalShrink truncates through another fd, then Syncs: the
// region and the daemon mapping must shrink to the new end.
func TestSyncExternalShrink(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, 5*page)
	copy(b.Mem(), pattern(5*page, 9))
	f := outside(t, b)
	for _, size := range []uint64{2*page + 5, page, 1} {
		old := b.MR()
		if err := f.Truncate(int64(size)); err != nil {
			t.Fatal(err)
		}
		if err := b.Sync(); err != nil {
			t.Fatalf("Sync after truncate to %d: %v", size, err)
		}
		check(t, e, b, size, buffer.Registered)
		deadMR(t, old)
		if !bytes.Equal(b.Mem(), pattern(5*page, 9)[:size]) {
			t.Fatal("data lost")
		}
	}
	old := b.MR()
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 0, buffer.Empty)
	deadMR(t, old)
	// And back: a client writing into an empty file.
	if _, err := f.WriteAt([]byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 1, buffer.Registered)
}

// TestSyncKeepsRegistrationOnLimit lets a client grow a buffer past
// max_pinned: Sync keeps the registration it had (still the file's first
// bytes), says why, and registers the whole file once it fits.
func TestSyncKeepsRegistrationOnLimit(t *testing.T) {
	e := setup(t, buffer.Options{MaxPinned: 4 * page}, 0)
	b := e.create(t, 2*page)
	copy(b.Mem(), pattern(2*page, 4))
	f := outside(t, b)
	before := b.Info()
	if _, err := f.WriteAt([]byte("big"), 8*page); err != nil {
		t.Fatal(err)
	}
	err := b.Sync()
	errnoIs(t, err, syscall.EFBIG) // more than the whole budget
	size := uint64(8*page + 3)
	in := b.Info()
	if in.State != buffer.Registered || in.Size != size || in.Length != 2*page || in.RKey != before.RKey || in.Generation != before.Generation {
		t.Fatalf("after a Sync past the budget: %+v, was %+v", in, before)
	}
	if in.Reason != "32771 B is past max_pinned (16 KiB)" {
		t.Fatalf("Reason %q", in.Reason)
	}
	if st := e.m.Stats(); st.PinnedBytes != 2*page || st.RegisteredBytes != 2*page {
		t.Fatalf("Stats %+v", st)
	}
	if !strings.Contains(e.log.String(), "max_pinned (16 KiB)") || !strings.Contains(e.log.String(), "buffers.max_pinned") {
		t.Fatalf("log does not name the limit: %s", e.log.String())
	}
	// Still too big: the registration stays, the bytes are all there.
	errnoIs(t, b.Sync(), syscall.EFBIG)
	if !bytes.Equal(b.Mem(), pattern(2*page, 4)) {
		t.Fatal("the registered bytes changed")
	}
	if got := readAll(t, b); !bytes.Equal(got[:2*page], pattern(2*page, 4)) || string(got[8*page:]) != "big" {
		t.Fatal("data lost while partly registered")
	}
	// An access change re-registers what is registered.
	if err := b.SetAccess(verbs.LocalWrite | verbs.RemoteRead); err != nil {
		t.Fatal(err)
	}
	if in := b.Info(); in.Length != 2*page || in.Reason == "" || b.MR().Access() != verbs.LocalWrite|verbs.RemoteRead {
		t.Fatalf("after SetAccess: %+v", in)
	}
	if err := f.Truncate(3 * page); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatalf("Sync once it fits: %v", err)
	}
	check(t, e, b, 3*page, buffer.Registered)
	if b.MR().Access() != verbs.LocalWrite|verbs.RemoteRead {
		t.Fatalf("after re-registration: %+v", b.Info())
	}
	// Too big again, then Resize down into the budget.
	if err := f.Truncate(10 * page); err != nil {
		t.Fatal(err)
	}
	errnoIs(t, b.Sync(), syscall.EFBIG)
	if err := b.Resize(context.Background(), page); err != nil {
		t.Fatalf("Resize out of a partial registration: %v", err)
	}
	check(t, e, b, page, buffer.Registered)
	// An empty buffer grown past the budget stays unregistered.
	z := e.create(t, 0)
	fz := outside(t, z)
	if _, err := fz.WriteAt([]byte("z"), 6*page); err != nil {
		t.Fatal(err)
	}
	errnoIs(t, z.Sync(), syscall.EFBIG)
	check(t, e, z, 6*page+1, buffer.Unregistered)
}

// TestResizeLimitChangesNothing hits max_pinned on grow and checks the
// buffer, its keys, its bytes and the file are as before: ENOSPC for a
// size that fits the budget but not what is free now, EFBIG for one
// past the whole budget.
func TestResizeLimitChangesNothing(t *testing.T) {
	e := setup(t, buffer.Options{MaxPinned: 4 * page}, 0)
	clock := time.Unix(1000, 0)
	defer buffer.SetClock(func() time.Time { return clock })()
	other := e.create(t, page)
	b := e.create(t, 2*page)
	copy(b.Mem(), pattern(2*page, 8))
	before := b.Info()
	for _, c := range []struct {
		size uint64
		want syscall.Errno
	}{{3*page + 1, syscall.ENOSPC}, {100 * page, syscall.EFBIG}, {4*page + 1, syscall.EFBIG}} {
		size := c.size
		errnoIs(t, b.Resize(context.Background(), size), c.want)
		check(t, e, b, 2*page, buffer.Registered)
		if b.Info() != before {
			t.Fatalf("failed Resize changed Info: %+v -> %+v", before, b.Info())
		}
		if !bytes.Equal(b.Mem(), pattern(2*page, 8)) {
			t.Fatal("failed Resize changed data")
		}
	}
	// Exactly at the limit is fine; the net change counts, not the overlap.
	if err := b.Resize(context.Background(), 3*page); err != nil {
		t.Fatalf("Resize to the limit: %v", err)
	}
	if err := b.SetAccess(verbs.LocalWrite | verbs.RemoteWrite); err != nil {
		t.Fatalf("SetAccess at the limit: %v", err)
	}
	// Refusals by one limit are logged once a minute.
	if n := strings.Count(e.log.String(), "raise buffers.max_pinned"); n != 1 {
		t.Fatalf("max_pinned logged %d times:\n%s", n, e.log.String())
	}
	errnoIs(t, other.Resize(context.Background(), 2*page), syscall.ENOSPC)
	clock = clock.Add(61 * time.Second)
	_, err := e.m.Create(e.d, page, 0)
	errnoIs(t, err, syscall.ENOSPC)
	if e.m.Stats().Buffers != 2 {
		t.Fatal("failed Create left a buffer")
	}
	if n := strings.Count(e.log.String(), "raise buffers.max_pinned"); n != 2 {
		t.Fatalf("max_pinned logged %d times:\n%s", n, e.log.String())
	}
	if err := b.Resize(context.Background(), page); err != nil {
		t.Fatal(err)
	}
	if err := other.Resize(context.Background(), 2*page); err != nil {
		t.Fatalf("Resize after room was made: %v", err)
	}
}

func TestMaxBuffers(t *testing.T) {
	e := setup(t, buffer.Options{MaxBuffers: 2}, 0)
	clock := time.Unix(1000, 0)
	defer buffer.SetClock(func() time.Time { return clock })()
	a := e.create(t, page)
	e.create(t, 0)
	for range 3 {
		_, err := e.m.Create(e.d, page, 0)
		errnoIs(t, err, syscall.ENOSPC)
	}
	if n := strings.Count(e.log.String(), "max_buffers (2) reached; raise buffers.max_buffers in the config"); n != 1 {
		t.Fatalf("max_buffers logged %d times:\n%s", n, e.log.String())
	}
	if st := e.m.Stats(); st.Buffers != 2 || e.d.Buffers() != 2 {
		t.Fatalf("Stats %+v", st)
	}
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	e.create(t, page)
	// A minute later the next refusal is logged again.
	clock = clock.Add(time.Minute)
	_, err := e.m.Create(e.d, 0, 0)
	errnoIs(t, err, syscall.ENOSPC)
	if n := strings.Count(e.log.String(), "max_buffers (2) reached"); n != 2 {
		t.Fatalf("max_buffers logged %d times a minute later", n)
	}
}

// TestMaxMR uses a device that holds 2 regions: the device's EINVAL
// passes through, and a replacement that needs a third index fails
// without changing anything.
func TestMaxMR(t *testing.T) {
	e := setup(t, buffer.Options{}, 2)
	a := e.create(t, page)
	b := e.create(t, page)
	_, err := e.m.Create(e.d, page, 0)
	errnoIs(t, err, syscall.EINVAL)
	before := a.Info()
	copy(a.Mem(), pattern(page, 2))
	errnoIs(t, a.Resize(context.Background(), 2*page), syscall.EINVAL)
	errnoIs(t, a.SetAccess(verbs.LocalWrite|verbs.RemoteRead), syscall.EINVAL)
	check(t, e, a, page, buffer.Registered)
	if a.Info() != before || !bytes.Equal(a.Mem(), pattern(page, 2)) {
		t.Fatal("failed re-registration changed the buffer")
	}
	if !strings.Contains(e.log.String(), "max_mr is 2") {
		t.Fatalf("log does not name max_mr:\n%s", e.log.String())
	}
	// A client grows b: Sync cannot register (the replacement needs a
	// third region), so b keeps the region it has and says why.
	f := outside(t, b)
	if _, err := f.WriteAt([]byte("x"), 2*page); err != nil {
		t.Fatal(err)
	}
	errnoIs(t, b.Sync(), syscall.EINVAL)
	if in := b.Info(); in.State != buffer.Registered || in.Length != page || in.Size != 2*page+1 || in.Reason != "device max_mr (2) reached" {
		t.Fatalf("Info %+v", in)
	}
	// Once a goes, b's next Sync registers it whole.
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 2*page+1, buffer.Registered)
}

// An EINVAL from the device is max_mr only when mrfs holds max_mr
// regions; otherwise it is the device's own answer and names no limit.
func TestEinvalIsNotAlwaysMaxMR(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, page)
	e.dev.mu.Lock()
	e.dev.failReg = func(uint64, verbs.Access) error { return fmt.Errorf("injected: %w", syscall.EINVAL) }
	e.dev.mu.Unlock()
	errnoIs(t, b.Resize(context.Background(), 2*page), syscall.EINVAL)
	e.dev.mu.Lock()
	e.dev.failReg = nil
	e.dev.mu.Unlock()
	if strings.Contains(e.log.String(), "max_mr") {
		t.Fatalf("an EINVAL with 1 region was logged as max_mr:\n%s", e.log.String())
	}
}

func TestSetAccess(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, 3*page)
	before := b.Info()
	for _, c := range []struct {
		a    verbs.Access
		want syscall.Errno
	}{
		{verbs.RemoteWrite, syscall.EINVAL},                      // without local_write
		{1 << 12, syscall.EINVAL},                                // unknown bit
		{verbs.LocalWrite | verbs.MWBind, syscall.EPERM},         // not allowed
		{verbs.LocalWrite | verbs.ZeroBased, syscall.EOPNOTSUPP}, // allowed, device refuses
		{verbs.RemoteWrite | verbs.MWBind, syscall.EINVAL},       // EINVAL is checked first
	} {
		errnoIs(t, b.SetAccess(c.a), c.want)
		if b.Info() != before {
			t.Fatalf("failed SetAccess(%s) changed the buffer", c.a)
		}
	}
	old := b.MR()
	a := verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite
	if err := b.SetAccess(a); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 3*page, buffer.Registered)
	deadMR(t, old)
	in := b.Info()
	if in.Access != a || b.MR().Access() != a || in.RKey == before.RKey || in.Addr != before.Addr {
		t.Fatalf("after SetAccess: %+v (before %+v)", in, before)
	}
	// Access 0 (local read only) is valid.
	if err := b.SetAccess(0); err != nil {
		t.Fatal(err)
	}
	// Empty: stored, used at the next registration.
	z := e.create(t, 0)
	if err := z.SetAccess(verbs.LocalWrite | verbs.RemoteAtomic); err != nil {
		t.Fatal(err)
	}
	errnoIs(t, z.SetAccess(verbs.MWBind), syscall.EPERM)
	if err := z.Resize(context.Background(), 10); err != nil {
		t.Fatal(err)
	}
	if got := z.MR().Access(); got != verbs.LocalWrite|verbs.RemoteAtomic {
		t.Fatalf("registered with %s", got)
	}
	// Injected device failure: nothing changes.
	e.dev.mu.Lock()
	e.dev.failReg = func(uint64, verbs.Access) error { return fmt.Errorf("injected: %w", syscall.EAGAIN) }
	e.dev.mu.Unlock()
	before = z.Info()
	errnoIs(t, z.SetAccess(verbs.LocalWrite), syscall.EAGAIN)
	if z.Info() != before {
		t.Fatal("failed SetAccess changed the buffer")
	}
	e.dev.mu.Lock()
	e.dev.failReg = nil
	e.dev.mu.Unlock()
}

func TestDomainDefaultAccess(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	_, err := e.m.NewDomain(verbs.MWBind)
	errnoIs(t, err, syscall.EPERM)
	d, err := e.m.NewDomain(verbs.RemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	if d.PD() == e.d.PD() {
		t.Fatal("two domains share a PD number")
	}
	errnoIs(t, d.SetDefaultAccess(verbs.RemoteAtomic), syscall.EINVAL)
	errnoIs(t, d.SetDefaultAccess(verbs.LocalWrite|verbs.MWBind), syscall.EPERM)
	errnoIs(t, d.SetDefaultAccess(verbs.LocalWrite|verbs.ZeroBased), syscall.EOPNOTSUPP)
	if d.DefaultAccess() != verbs.RemoteRead {
		t.Fatal("failed SetDefaultAccess changed it")
	}
	a := verbs.LocalWrite | verbs.RemoteWrite
	if err := d.SetDefaultAccess(a); err != nil {
		t.Fatal(err)
	}
	b, err := e.m.Create(d, page, 0)
	if err != nil {
		t.Fatal(err)
	}
	if b.Info().Access != a || b.MR().Access() != a || b.Info().PD != d.PD() || b.Domain() != d {
		t.Fatalf("created with %+v", b.Info())
	}
}

func TestMoveAndDomainClose(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	d2, err := e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	b := e.create(t, 2*page)
	copy(b.Mem(), pattern(2*page, 6))
	z := e.create(t, 0)
	errnoIs(t, e.d.Close(), syscall.ENOTEMPTY)

	old := b.Info()
	oldMR := b.MR()
	if err := b.Move(d2); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 2*page, buffer.Registered)
	deadMR(t, oldMR)
	in := b.Info()
	if in.PD != d2.PD() || b.MR().PD().Handle() != d2.PD() || in.RKey == old.RKey || b.Domain() != d2 {
		t.Fatalf("after Move: %+v", in)
	}
	if !bytes.Equal(b.Mem(), pattern(2*page, 6)) {
		t.Fatal("Move lost data")
	}
	if err := z.Move(d2); err != nil {
		t.Fatal(err)
	}
	if e.d.Buffers() != 0 || d2.Buffers() != 2 {
		t.Fatalf("counts: %d %d", e.d.Buffers(), d2.Buffers())
	}
	if err := b.Move(d2); err != nil { // same domain: nothing to do
		t.Fatal(err)
	}

	// A failed Move leaves the buffer where it was.
	e.dev.mu.Lock()
	e.dev.failReg = func(uint64, verbs.Access) error { return syscall.ENOMEM }
	e.dev.mu.Unlock()
	before := b.Info()
	errnoIs(t, b.Move(e.d), syscall.ENOMEM)
	if b.Info() != before || e.d.Buffers() != 0 || d2.Buffers() != 2 {
		t.Fatal("failed Move changed something")
	}
	// ENOMEM is RLIMIT_MEMLOCK only where that limit applies (not with
	// CAP_IPC_LOCK, which root has).
	if blames := strings.Contains(e.log.String(), "RLIMIT_MEMLOCK"); blames != (verbs.MemlockLimit() != 0) {
		t.Fatalf("ENOMEM with RLIMIT_MEMLOCK %d: the log blames it: %v\n%s", verbs.MemlockLimit(), blames, e.log.String())
	}
	e.dev.mu.Lock()
	e.dev.failReg = nil
	e.dev.mu.Unlock()

	if err := e.d.Close(); err != nil {
		t.Fatal(err)
	}
	errnoIs(t, e.d.Close(), syscall.ENOENT)
	_, err = e.m.Create(e.d, 0, 0)
	errnoIs(t, err, syscall.ENOENT)
	errnoIs(t, b.Move(e.d), syscall.ENOENT)
	errnoIs(t, e.d.SetDefaultAccess(verbs.LocalWrite), syscall.ENOENT)
	if _, pds := e.dev.counts(); pds != 1 || e.m.Stats().PDs != 1 {
		t.Fatalf("%d PDs on the device after Domain.Close", pds)
	}
}

// TestFree checks the order (deregister while still mapped, then unmap,
// then remove) and that the buffer answers ENOENT afterwards.
func TestFree(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, 3*page+1)
	f := b.File()
	mr := b.MR()
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	e.dev.checkViolations(t) // the spy saw the memory mapped at dereg
	deadMR(t, mr)
	if _, _, err := f.Stat(); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("the file is still in the store after Free: %v", err)
	}
	if b.File() != nil {
		t.Fatal("File after Free")
	}
	if in := b.Info(); in.State != buffer.Empty || in.Size != 3*page+1 || in.LKey != 0 {
		t.Fatalf("Info after Free: %+v", in)
	}
	errnoIs(t, b.Free(), syscall.ENOENT)
	errnoIs(t, b.Sync(), syscall.ENOENT)
	errnoIs(t, b.Resize(context.Background(), 1), syscall.ENOENT)
	errnoIs(t, b.SetAccess(verbs.LocalWrite), syscall.ENOENT)
	errnoIs(t, b.Move(e.d), syscall.ENOENT)
	errnoIs(t, b.Allocate(context.Background(), 0, 1, 0), syscall.ENOENT)
	_, err := b.ReadAt(make([]byte, 1), 0)
	errnoIs(t, err, syscall.ENOENT)
	_, err = b.WriteAt([]byte{1}, 0)
	errnoIs(t, err, syscall.ENOENT)
	if st := e.m.Stats(); st.Buffers != 0 || st.PinnedBytes != 0 || e.d.Buffers() != 0 {
		t.Fatalf("Stats after Free: %+v", st)
	}
	if err := e.d.Close(); err != nil {
		t.Fatalf("domain Close after Free: %v", err)
	}

	// A failed dereg frees nothing: the device could still write there.
	e2 := setup(t, buffer.Options{}, 0)
	b = e2.create(t, page)
	e2.dev.mu.Lock()
	e2.dev.failDereg = func(verbs.MR) error { return syscall.EBUSY }
	e2.dev.mu.Unlock()
	errnoIs(t, b.Free(), syscall.EBUSY)
	check(t, e2, b, page, buffer.Registered)
	e2.dev.mu.Lock()
	e2.dev.failDereg = nil
	e2.dev.mu.Unlock()
}

// TestDeregFailureUndo makes deregistering the old region fail during a
// grow: the new region and mapping must be undone.
func TestDeregFailureUndo(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, page)
	copy(b.Mem(), pattern(page, 7))
	before := b.Info()
	e.dev.mu.Lock()
	e.dev.failDereg = func(mr verbs.MR) error {
		if mr.Length() == page {
			return fmt.Errorf("injected: %w", syscall.EIO)
		}
		return nil
	}
	e.dev.mu.Unlock()
	errnoIs(t, b.Resize(context.Background(), 5*page), syscall.EIO)
	e.dev.mu.Lock()
	e.dev.failDereg = nil
	e.dev.mu.Unlock()
	check(t, e, b, page, buffer.Registered)
	if b.Info() != before || !bytes.Equal(b.Mem(), pattern(page, 7)) {
		t.Fatal("failed Resize changed the buffer")
	}
	if mrs, _ := e.dev.counts(); mrs != 1 || e.m.Regions() != 1 {
		t.Fatalf("%d regions after the undo", mrs)
	}
	if st := e.m.Stats(); st.RegisteredBytes != page || st.PinnedBytes != page {
		t.Fatalf("Stats %+v", st)
	}
}

func TestReadWriteAllocate(t *testing.T) {
	e := setup(t, buffer.Options{MaxPinned: 8 * page}, 0)
	b := e.create(t, 0)
	n, err := b.WriteAt([]byte("hello\n"), 0)
	if err != nil || n != 6 {
		t.Fatalf("WriteAt: %d %v", n, err)
	}
	check(t, e, b, 6, buffer.Registered)
	if string(b.Mem()) != "hello\n" {
		t.Fatalf("mapping holds %q", b.Mem())
	}
	if _, err := b.WriteAt([]byte("world"), 2*page); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 2*page+5, buffer.Registered)
	p := make([]byte, 10)
	n, err = b.ReadAt(p, 2*page)
	if err != nil || n != 5 || string(p[:n]) != "world" {
		t.Fatalf("ReadAt at the end: %d %v %q", n, err, p[:n])
	}
	if n, err := b.ReadAt(p, 10*page); n != 0 || err != nil {
		t.Fatalf("ReadAt past the end: %d %v", n, err)
	}
	// A write that would pass max_pinned fails before writing.
	_, err = b.WriteAt([]byte("x"), 20*page)
	errnoIs(t, err, syscall.EFBIG)
	check(t, e, b, 2*page+5, buffer.Registered)

	if err := b.Allocate(context.Background(), 0, 4*page, 0); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 4*page, buffer.Registered)
	if err := b.Allocate(context.Background(), 0, 6*page, unix.FALLOC_FL_KEEP_SIZE); err != nil {
		t.Fatal(err)
	}
	check(t, e, b, 4*page, buffer.Registered)
	punched := b.MR()
	if err := b.Allocate(context.Background(), 0, page, unix.FALLOC_FL_KEEP_SIZE|unix.FALLOC_FL_PUNCH_HOLE); err != nil {
		t.Fatal(err)
	}
	if got := b.Mem()[:6]; !bytes.Equal(got, make([]byte, 6)) {
		t.Fatalf("punched hole reads %q", got)
	}
	if b.MR() == punched {
		t.Fatal("a punched hole kept the region that pins the removed pages")
	}
	deadMR(t, punched)
	check(t, e, b, 4*page, buffer.Registered)
	errnoIs(t, b.Allocate(context.Background(), 0, 9*page, 0), syscall.EFBIG)
	check(t, e, b, 4*page, buffer.Registered)
	errnoIs(t, b.Allocate(context.Background(), 0, page, unix.FALLOC_FL_ZERO_RANGE), syscall.EOPNOTSUPP)
}

// TestManagerClose tears down buffers in several domains and checks that
// nothing stays registered, mapped or locked.
func TestManagerClose(t *testing.T) {
	lckBefore := vmLck(t)
	e := setup(t, buffer.Options{}, 0)
	d2, err := e.m.NewDomain(verbs.LocalWrite | verbs.RemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	var bufs []*buffer.Buffer
	var mrs []verbs.MR
	for i, d := range []*buffer.Domain{e.d, d2, e.d, d2} {
		b, err := e.m.Create(d, uint64(i)*100*page, 0)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
		if mr := b.MR(); mr != nil {
			mrs = append(mrs, mr)
		}
	}
	if vmLck(t) == lckBefore {
		t.Fatal("VmLck did not change while 600 KiB were registered")
	}
	pds := []verbs.PD{e.d.VerbsPD(), d2.VerbsPD()}
	freed, err := e.m.Close()
	if err != nil {
		t.Fatal(err)
	}
	if want := (buffer.Freed{Regions: 3, PDs: 2, UnpinnedBytes: 600 * page}); freed != want {
		t.Fatalf("Close freed %+v, want %+v", freed, want)
	}
	if again, err := e.m.Close(); err != nil || again != (buffer.Freed{}) {
		t.Fatalf("second Close: %+v, %v", again, err)
	}
	if got := vmLck(t); got != lckBefore {
		t.Fatalf("VmLck %s after Close, %s before", got, lckBefore)
	}
	if n, p := e.dev.counts(); n != 0 || p != 0 {
		t.Fatalf("%d regions, %d PDs after Close", n, p)
	}
	for _, mr := range mrs {
		deadMR(t, mr)
	}
	for _, pd := range pds {
		errnoIs(t, pd.Dealloc(), syscall.EINVAL)
	}
	for _, b := range bufs {
		if b.File() != nil || b.MappedLen() != 0 {
			t.Fatal("buffer still has its file after Close")
		}
		errnoIs(t, b.Resize(context.Background(), 1), syscall.ENODEV)
		errnoIs(t, b.Free(), syscall.ENODEV)
	}
	if st := e.m.Stats(); st.Buffers != 0 || st.PDs != 0 || st.RegisteredBytes != 0 || st.PinnedBytes != 0 || len(st.Users) != 0 {
		t.Fatalf("Stats after Close: %+v", st)
	}
	_, err = e.m.Create(e.d, 0, 0)
	errnoIs(t, err, syscall.ENODEV)
	_, err = e.m.NewDomain(verbs.LocalWrite)
	errnoIs(t, err, syscall.ENODEV)
	errnoIs(t, d2.Close(), syscall.ENODEV)
	errnoIs(t, d2.SetDefaultAccess(verbs.LocalWrite), syscall.ENODEV)
}

func TestStateString(t *testing.T) {
	for s, want := range map[buffer.State]string{buffer.Empty: "empty", buffer.Registered: "registered", buffer.Unregistered: "unregistered"} {
		if s.String() != want {
			t.Errorf("%d: %q", s, s.String())
		}
	}
}

// TestClientTruncatesDuringRegistration shrinks the file while Sync
// registers the grown size, as a client racing the daemon can: the
// registration fails on pages past EOF, and Sync must learn the new size
// and register that instead of blaming a limit.
func TestClientTruncatesDuringRegistration(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	b := e.create(t, 2*page)
	f := outside(t, b)
	if _, err := f.WriteAt([]byte("x"), 8*page); err != nil {
		t.Fatal(err)
	}
	calls := 0
	e.dev.mu.Lock()
	e.dev.failReg = func(length uint64, _ verbs.Access) error {
		calls++
		if calls == 1 {
			if err := f.Truncate(page); err != nil {
				t.Error(err)
			}
		}
		return nil
	}
	e.dev.mu.Unlock()
	if err := b.Sync(); err != nil {
		t.Fatalf("Sync: %v", err)
	}
	e.dev.mu.Lock()
	e.dev.failReg = nil
	e.dev.mu.Unlock()
	check(t, e, b, page, buffer.Registered)
	if calls != 2 {
		t.Fatalf("%d registrations, want 2 (the raced one and the retry)", calls)
	}
	if strings.Contains(e.log.String(), "RLIMIT_MEMLOCK") {
		t.Fatalf("a client's truncate was logged as a limit:\n%s", e.log.String())
	}
}
