package verbstest

import (
	"os"
	"sync"
	"syscall"
	"testing"

	"mrfs/verbs"
)

var page = os.Getpagesize()

const remoteAccess = verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic

// Where rxe (verbs/ibv on Soft-RoCE, kernel 6.1 and rdma-core 44 in
// tests/vm) and the soft model differ, and how the suite handles it.
// Everywhere else both must give the same outcome; verbs/soft runs the
// suite with RxeOptions but PinField to check that. (mrfs never calls
// ibv_rereg_mr, which rdma-core's rxe provider lacks: it registers anew
// and deregisters the old region; see verbs.MR.)
//
//   - pinned pages: the kernel counts them in pinned_vm, shown as VmPin;
//     soft mlocks them, shown as VmLck (Options.PinField). VmLck counts
//     a page once however many regions hold it, VmPin once per region;
//     the suite measures with one region only.
//   - rkey without remote access: rxe before Linux 6.5 gives rkey 0 to a
//     region registered without remote_* flags (measured on 6.1); newer
//     rxe (measured on 6.12) and soft give rkey == lkey
//     (Options.LocalRKeyZero accepts both). Soft does not model the old
//     behaviour.
//   - zero_based: rxe in 6.1 has no access filter in reg_user_mr and
//     accepts it without honouring it; newer rxe answers EOPNOTSUPP.
//     verbs/ibv refuses any flag outside DeviceAttr.Access itself, so
//     both providers answer EOPNOTSUPP.
//   - unmapped pages: EFAULT from the kernel's pin on both, unless
//     libibverbs fork protection is on (RDMAV_FORK_SAFE or ibv_fork_init
//     on a kernel that does not copy pinned pages at fork, before 5.13):
//     then its madvise(MADV_DONTFORK) fails first and reg_mr gives
//     ENOMEM. On 6.1 libibverbs finds fork protection unneeded.
//   - keys: rxe uses index<<8 | a random byte with a cyclic index, so
//     a live rkey is guessed 1 time in 256 once its (sequential) index is
//     known (Options.RxeKeys; mlx5's low byte is even a counter). Soft
//     keys are 32 random bits, for mrfs's own sake (docs/DESIGN.md), so
//     soft does not promise RxeKeys; both give live regions distinct keys
//     with lkey == rkey. Randomness is checked on soft only.
//   - MR indices: rxe hands out [1, 0x80000] while reporting max_mr
//     0x7FFFF. The suite never fills rxe (MaxExhaust).
//   - Close with live regions: the kernel releases them when the device
//     file closes and libibverbs frees nothing; soft releases them
//     itself. Both then answer ENODEV to every call.

type testCase struct {
	name string
	run  func(t *testing.T, e *env)
}

var cases = []testCase{
	{"Devices", testDevices},
	{"OpenDefault", testOpenDefault},
	{"OpenUnknown", testOpenUnknown},
	{"Attr", testAttr},
	{"PD", testPD},
	{"RegDereg", testRegDereg},
	{"MaxMRSize", testMaxMRSize},
	{"RegUnaligned", testRegUnaligned},
	{"AccessValid", testAccessValid},
	{"AccessInvalid", testAccessInvalid},
	{"AccessUnsupported", testAccessUnsupported},
	{"LengthZero", testLengthZero},
	{"Unmapped", testUnmapped},
	{"DeregTwice", testDeregTwice},
	{"DeallocBusy", testDeallocBusy},
	{"Keys", testKeys},
	{"KeyIndexCyclic", testKeyIndexCyclic},
	{"Pinning", testPinning},
	{"MaxMR", testMaxMR},
	{"Concurrent", testConcurrent},
}

func testDevices(t *testing.T, e *env) {
	p := e.newProvider(t)
	if p.Name() == "" {
		t.Error("provider has no name")
	}
	devs, err := p.Devices()
	if err != nil {
		t.Fatalf("Devices: %v", err)
	}
	if len(devs) == 0 {
		t.Fatal("Devices lists none")
	}
	seen := map[string]bool{}
	for _, info := range devs {
		if info.Name == "" || seen[info.Name] {
			t.Errorf("device name %q is empty or listed twice", info.Name)
		}
		seen[info.Name] = true
		dev, err := p.Open(info.Name)
		if err != nil {
			t.Fatalf("Open(%q): %v", info.Name, err)
		}
		if dev.Name() != info.Name {
			t.Errorf("Open(%q).Name() = %q", info.Name, dev.Name())
		}
		if dev.Attr() != info.Attr {
			t.Errorf("Open(%q).Attr() = %+v, Devices said %+v", info.Name, dev.Attr(), info.Attr)
		}
		if err := dev.Close(); err != nil {
			t.Errorf("Close %q: %v", info.Name, err)
		}
	}
}

func testOpenDefault(t *testing.T, e *env) {
	p := e.newProvider(t)
	devs, err := p.Devices()
	if err != nil || len(devs) == 0 {
		t.Fatalf("Devices: %v, %d devices", err, len(devs))
	}
	dev, err := p.Open("")
	if err != nil {
		t.Fatalf("Open(\"\"): %v", err)
	}
	defer dev.Close()
	if dev.Name() != devs[0].Name {
		t.Errorf("Open(\"\") opened %q, want the first device %q", dev.Name(), devs[0].Name)
	}
}

func testOpenUnknown(t *testing.T, e *env) {
	dev, err := e.newProvider(t).Open("mrfs-no-such-device")
	if err == nil {
		dev.Close()
		t.Fatal("Open of an unknown device succeeded")
	}
	WantErrno(t, err, syscall.ENODEV)
}

func testAttr(t *testing.T, e *env) {
	e.open()
	a := e.attr
	if a.MaxMR <= 0 || a.MaxPD <= 0 {
		t.Errorf("MaxMR %d, MaxPD %d: want > 0", a.MaxMR, a.MaxPD)
	}
	if a.MaxMRSize < uint64(page) {
		t.Errorf("MaxMRSize %d is below one page", a.MaxMRSize)
	}
	if a.PageSizeCap&uint64(page) == 0 {
		t.Errorf("PageSizeCap 0x%x lacks the system page size %d", a.PageSizeCap, page)
	}
	// Every device can do plain local and remote read/write.
	if need := verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead; a.Access&need != need {
		t.Errorf("Access %s lacks some of %s", a.Access, need)
	}
	if err := (a.Access | verbs.LocalWrite).Validate(); err != nil {
		t.Errorf("Access %s has flags no kernel accepts: %v", a.Access, err)
	}
}

func testPD(t *testing.T, e *env) {
	e.open()
	pd2 := e.allocPD()
	if e.pd.Handle() == pd2.Handle() {
		t.Errorf("two PDs share handle %d", pd2.Handle())
	}
	if err := pd2.Dealloc(); err != nil {
		t.Errorf("Dealloc: %v", err)
	}
	if err := e.pd.Dealloc(); err != nil {
		t.Errorf("Dealloc: %v", err)
	}
}

func testRegDereg(t *testing.T, e *env) {
	e.open()
	const n = 64 << 10
	addr, mem := Map(t, n)
	a := verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead
	mr := e.reg(e.pd, addr, n, a)
	if mr.Addr() != addr || mr.IOVA() != uint64(addr) || mr.Length() != n || mr.Access() != a {
		t.Errorf("region says addr 0x%x iova 0x%x length %d access %s; want 0x%x, 0x%x, %d, %s",
			mr.Addr(), mr.IOVA(), mr.Length(), mr.Access(), addr, addr, n, a)
	}
	if mr.PD().Handle() != e.pd.Handle() {
		t.Errorf("region in pd %d, want %d", mr.PD().Handle(), e.pd.Handle())
	}
	// Registered memory stays ordinary memory for the process.
	mem[0], mem[n-1] = 1, 2
	if mem[0] != 1 || mem[n-1] != 2 {
		t.Error("registered memory does not keep writes")
	}
	if err := mr.Dereg(); err != nil {
		t.Fatalf("Dereg: %v", err)
	}
}

// A region of max_mr_size bytes registers; one byte more is EINVAL.
// Only a device with a small limit is tested (rxe has none).
func testMaxMRSize(t *testing.T, e *env) {
	e.open()
	max := e.attr.MaxMRSize
	if max > 64<<20 {
		t.Skipf("max_mr_size is %d: too big to register past here", max)
	}
	addr, _ := Map(t, int(max)+page)
	mr := e.reg(e.pd, addr, max, verbs.LocalWrite)
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	_, err := e.pd.RegMR(addr, max+1, verbs.LocalWrite)
	WantErrno(t, err, syscall.EINVAL)
}

// The kernel requires no alignment: it pins the enclosing pages.
func testRegUnaligned(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, 2*page)
	mr := e.reg(e.pd, addr+100, uint64(page), verbs.LocalWrite)
	if mr.Addr() != addr+100 || mr.Length() != uint64(page) {
		t.Errorf("region 0x%x+%d, want 0x%x+%d", mr.Addr(), mr.Length(), addr+100, page)
	}
}

// Every combination of ValidAccess is valid (0 is local read only), as
// is every flag the device lists (with local_write), except the two that
// change what a registration means.
func testAccessValid(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, page)
	for _, a := range ValidAccess {
		if e.attr.Access&a != a {
			continue // remote_atomic is optional
		}
		if err := e.reg(e.pd, addr, uint64(page), a).Dereg(); err != nil {
			t.Errorf("Dereg: %v", err)
		}
	}
	for bit := verbs.Access(1); bit != 0; bit <<= 1 {
		if e.attr.Access&bit == 0 || bit == verbs.ZeroBased || bit == verbs.OnDemand {
			continue
		}
		if err := e.reg(e.pd, addr, uint64(page), bit|verbs.LocalWrite).Dereg(); err != nil {
			t.Errorf("Dereg: %v", err)
		}
	}
}

// ib_check_mr_access: remote write or atomic without local write, and
// bits outside IB_ACCESS_SUPPORTED, are EINVAL.
func testAccessInvalid(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, page)
	for _, a := range append([]verbs.Access{verbs.LocalWrite | 1<<12, verbs.LocalWrite | 1<<31}, InvalidAccess...) {
		t.Run(a.String(), func(t *testing.T) {
			e.regErr(e.pd, addr, uint64(page), a, syscall.EINVAL)
		})
	}
}

// Flags the device does not list are EOPNOTSUPP: on rxe that is
// zero_based (the driver's filter) and on_demand without ODP (the core).
func testAccessUnsupported(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, page)
	tried := 0
	for _, a := range []verbs.Access{verbs.ZeroBased, verbs.OnDemand} {
		if e.attr.Access&a != 0 {
			t.Logf("device supports %s; not checked", a)
			continue
		}
		tried++
		e.regErr(e.pd, addr, uint64(page), a|verbs.LocalWrite, syscall.EOPNOTSUPP)
	}
	if tried == 0 {
		t.Skip("the device supports zero_based and on_demand")
	}
}

func testLengthZero(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, page)
	e.regErr(e.pd, addr, 0, verbs.LocalWrite, syscall.EINVAL)
}

// Pinning an unmapped page fails with EFAULT (gup's check_vma_flags).
func testUnmapped(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, 3*page)
	Unmap(t, addr+uintptr(page), page)
	e.regErr(e.pd, addr, uint64(3*page), verbs.LocalWrite, syscall.EFAULT)
}

func testDeregTwice(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, page)
	mr := e.reg(e.pd, addr, uint64(page), verbs.LocalWrite)
	if err := mr.Dereg(); err != nil {
		t.Fatalf("Dereg: %v", err)
	}
	WantErrno(t, mr.Dereg(), syscall.EINVAL)
}

// A PD that holds a region cannot be deallocated (pd->usecnt).
func testDeallocBusy(t *testing.T, e *env) {
	e.open()
	addr, _ := Map(t, page)
	mr := e.reg(e.pd, addr, uint64(page), verbs.LocalWrite)
	WantErrno(t, e.pd.Dealloc(), syscall.EBUSY)
	if err := mr.Dereg(); err != nil {
		t.Fatalf("Dereg: %v", err)
	}
	if err := e.pd.Dealloc(); err != nil {
		t.Fatalf("Dealloc after Dereg: %v", err)
	}
}

// Live regions have distinct keys; rxe-style keys carry a distinct
// index in [1, MaxMR] above a byte, with lkey == rkey.
func testKeys(t *testing.T, e *env) {
	e.open()
	n := min(16, e.attr.MaxMR)
	addr, _ := Map(t, n*page)
	lkeys, rkeys, idx := map[uint32]bool{}, map[uint32]bool{}, map[uint32]bool{}
	for i := range n {
		a := verbs.LocalWrite
		if i%2 == 0 {
			a |= verbs.RemoteRead | verbs.RemoteWrite
		}
		mr := e.reg(e.pd, addr+uintptr(i*page), uint64(page), a)
		// rkey 0 means "no remote key" where the option allows it.
		rkey0 := e.opt.LocalRKeyZero && a&remoteAccess == 0 && mr.RKey() == 0
		if lkeys[mr.LKey()] || !rkey0 && rkeys[mr.RKey()] {
			t.Errorf("region %d reuses a live key: lkey 0x%x rkey 0x%x", i, mr.LKey(), mr.RKey())
		}
		lkeys[mr.LKey()] = true
		if !rkey0 {
			rkeys[mr.RKey()] = true
		}
		if !e.opt.RxeKeys {
			continue
		}
		if !rkey0 && mr.LKey() != mr.RKey() {
			t.Errorf("lkey 0x%x != rkey 0x%x", mr.LKey(), mr.RKey())
		}
		ix := mr.LKey() >> 8
		if ix < 1 || ix > uint32(e.attr.MaxMR) || idx[ix] {
			t.Errorf("key 0x%x: index %d is outside [1, %d] or reused", mr.LKey(), ix, e.attr.MaxMR)
		}
		idx[ix] = true
	}
}

// rxe's index allocator is cyclic: a freed index is not handed out
// again at once.
func testKeyIndexCyclic(t *testing.T, e *env) {
	if !e.opt.RxeKeys {
		t.Skip("the provider does not promise rxe-style keys")
	}
	e.open()
	if e.attr.MaxMR < 2 {
		t.Skip("MaxMR < 2")
	}
	addr, _ := Map(t, page)
	a := e.reg(e.pd, addr, uint64(page), verbs.LocalWrite)
	ia := a.LKey() >> 8
	if err := a.Dereg(); err != nil {
		t.Fatal(err)
	}
	b := e.reg(e.pd, addr, uint64(page), verbs.LocalWrite)
	if ib := b.LKey() >> 8; ib == ia {
		t.Errorf("index %d reused at once after Dereg; rxe allocates cyclically", ia)
	}
}

func testPinning(t *testing.T, e *env) {
	if e.opt.PinField == "" {
		t.Skip("the provider states no /proc/self/status field for pinned pages")
	}
	e.open()
	addr, _ := Map(t, 4*page)
	base := statusKB(t, e.opt.PinField)
	mr := e.reg(e.pd, addr+100, uint64(2*page), verbs.LocalWrite) // touches 3 pages
	want := base + uint64(3*page)/1024
	if got := statusKB(t, e.opt.PinField); got != want {
		t.Errorf("%s %d kB while registered, want %d kB", e.opt.PinField, got, want)
	}
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	if got := statusKB(t, e.opt.PinField); got != base {
		t.Errorf("%s %d kB after Dereg, want %d kB", e.opt.PinField, got, base)
	}
}

// Past max_mr regions, registration fails with EINVAL (rxe's pool) and
// works again once one is freed.
func testMaxMR(t *testing.T, e *env) {
	e.open()
	if e.attr.MaxMR > e.opt.MaxExhaust {
		t.Skipf("MaxMR %d is too large to fill quickly (limit %d); covered by providers with a small MaxMR", e.attr.MaxMR, e.opt.MaxExhaust)
	}
	addr, _ := Map(t, page)
	mrs := make([]verbs.MR, 0, e.attr.MaxMR)
	for range e.attr.MaxMR {
		mrs = append(mrs, e.reg(e.pd, addr, uint64(page), 0))
	}
	e.regErr(e.pd, addr, uint64(page), 0, syscall.EINVAL)
	if err := mrs[len(mrs)/2].Dereg(); err != nil {
		t.Fatal(err)
	}
	e.reg(e.pd, addr, uint64(page), 0)
	e.regErr(e.pd, addr, uint64(page), 0, syscall.EINVAL)
}

// Verbs calls are thread-safe; regions registered concurrently get
// distinct keys. Every round holds all its regions live at once, so that
// a key given twice is caught whichever region got it first; then all
// are deregistered concurrently, and the next round registers again.
func testConcurrent(t *testing.T, e *env) {
	e.open()
	const rounds = 3
	live := min(64, e.attr.MaxMR)
	workers := min(8, live)
	per := live / workers
	addr, _ := Map(t, workers*per*page)
	for round := range rounds {
		var mu sync.Mutex // guards lkeys, rkeys, mrs
		lkeys, rkeys := map[uint32]int{}, map[uint32]int{}
		var mrs []verbs.MR
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for i := range per {
					n := w*per + i
					// remote_read: a remote key even where rkey 0 means none.
					mr, err := e.pd.RegMR(addr+uintptr(n*page), uint64(page), verbs.LocalWrite|verbs.RemoteRead)
					if err != nil {
						t.Errorf("round %d: RegMR: %v", round, err)
						return
					}
					mu.Lock()
					mrs = append(mrs, mr)
					if o, ok := lkeys[mr.LKey()]; ok {
						t.Errorf("round %d: lkey 0x%x given to regions %d and %d, both live", round, mr.LKey(), o, n)
					}
					if o, ok := rkeys[mr.RKey()]; ok {
						t.Errorf("round %d: rkey 0x%x given to regions %d and %d, both live", round, mr.RKey(), o, n)
					}
					lkeys[mr.LKey()], rkeys[mr.RKey()] = n, n
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		for _, mr := range mrs {
			wg.Go(func() {
				if err := mr.Dereg(); err != nil {
					t.Errorf("round %d: Dereg: %v", round, err)
				}
			})
		}
		wg.Wait()
	}
}
