package soft

import (
	"encoding/binary"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
	"mrfs/verbs/verbstest"
)

func TestConformance(t *testing.T) {
	for _, c := range []struct {
		name string
		opt  Options
	}{
		{"default", Options{}},
		{"maxmr64", Options{MaxMR: 64}},
		{"maxmr16", Options{MaxMR: 16, DeviceName: "soft7"}},
		{"maxmr1", Options{MaxMR: 1}},
		{"maxmrsize", Options{MaxMRSize: 64 << 10}},
	} {
		t.Run(c.name, func(t *testing.T) {
			verbstest.Run(t, func(t *testing.T) verbs.Provider { return New(c.opt) })
		})
	}
}

// The suite with the options verbs/ibv runs on rxe, but for the pin
// field and the keys. The remaining differences are listed at the top of
// verbstest's cases.go.
func TestConformanceRxeMode(t *testing.T) {
	opt := verbstest.RxeOptions()
	opt.PinField, opt.RxeKeys = "VmLck", false
	verbstest.RunWith(t, func(t *testing.T) verbs.Provider { return New(Options{}) }, opt)
}

// open returns an open device and a PD of a fresh soft provider.
func open(t *testing.T, opt Options) (verbs.Device, verbs.PD) {
	t.Helper()
	dev, err := New(opt).Open("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	return dev, pd
}

func reg(t *testing.T, pd verbs.PD, addr uintptr, n uint64, a verbs.Access) verbs.MR {
	t.Helper()
	mr, err := pd.RegMR(addr, n, a)
	if err != nil {
		t.Fatalf("RegMR(0x%x, %d, %s): %v", addr, n, a, err)
	}
	t.Cleanup(func() { mr.Dereg() })
	return mr
}

func vmLck(t *testing.T) uint64 {
	t.Helper()
	v, err := verbstest.StatusKB("VmLck")
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestAttr(t *testing.T) {
	dev, _ := open(t, Options{})
	want := verbs.DeviceAttr{MaxMR: 524287, MaxMRSize: ^uint64(0), PageSizeCap: 0xFFFFF000, MaxPD: 1 << 20, Access: deviceAccess}
	if dev.Name() != "soft0" || dev.Attr() != want {
		t.Errorf("device %q attr %+v, want soft0 %+v", dev.Name(), dev.Attr(), want)
	}
	dev, _ = open(t, Options{MaxMR: 1 << 30})
	if a := dev.Attr(); a.MaxMR != maxMR {
		t.Errorf("huge MaxMR: %+v", a)
	}
}

// Keys are 32 random bits, lkey == rkey: over many registrations every
// bit of the key is sometimes set and sometimes clear (rxe's keys, an
// index above a random byte, keep their upper bits for long stretches).
func TestKeysRandom(t *testing.T) {
	_, pd := open(t, Options{MaxMR: 4})
	addr, _ := verbstest.Map(t, 4096)
	const n = 512
	var set [32]int
	for range n {
		mr := reg(t, pd, addr, 4096, 0)
		k := mr.LKey()
		if k == 0 || mr.RKey() != k {
			t.Fatalf("lkey 0x%x rkey 0x%x, want equal and nonzero", k, mr.RKey())
		}
		for b := range set {
			set[b] += int(k >> b & 1)
		}
		mr.Dereg()
	}
	for b, c := range set {
		// Binomial(512, 1/2): outside [n/4, 3n/4] about once in 10^29.
		if c < n/4 || c > 3*n/4 {
			t.Errorf("key bit %d set in %d of %d keys; a random bit would be near %d", b, c, n, n/2)
		}
	}
}

// A random key that is zero or held by a live region (or one still
// registering) is drawn again.
func TestKeyCollisions(t *testing.T) {
	_, pd := open(t, Options{})
	addr, _ := verbstest.Map(t, 4096)
	draws := []uint32{0, 0x11223344, 0x11223344, 0, 0x55667788}
	old := randRead
	t.Cleanup(func() { randRead = old })
	randRead = func(b []byte) {
		if len(draws) == 0 {
			t.Fatal("more draws than the test planned")
		}
		binary.LittleEndian.PutUint32(b, draws[0])
		draws = draws[1:]
	}
	a := reg(t, pd, addr, 4096, 0)
	b := reg(t, pd, addr, 4096, 0)
	if a.LKey() != 0x11223344 || b.LKey() != 0x55667788 {
		t.Errorf("keys 0x%x, 0x%x; want 0x11223344 (zero skipped), 0x55667788 (the live key and zero skipped)", a.LKey(), b.LKey())
	}
}

// Checks run in the kernel's order: each case trips two checks and must
// report the earlier one.
func TestCheckOrder(t *testing.T) {
	_, pd := open(t, Options{MaxMR: 1})
	addr, _ := verbstest.Map(t, 3*4096)
	verbstest.Unmap(t, addr+4096, 4096)
	// unsupported flag before length 0 and before an unmapped range
	_, err := pd.RegMR(addr, 0, verbs.ZeroBased)
	verbstest.WantErrno(t, err, syscall.EOPNOTSUPP)
	_, err = pd.RegMR(addr, 3*4096, verbs.ZeroBased)
	verbstest.WantErrno(t, err, syscall.EOPNOTSUPP)
	// invalid access before unsupported flag
	_, err = pd.RegMR(addr, 4096, verbs.ZeroBased|verbs.RemoteWrite)
	verbstest.WantErrno(t, err, syscall.EINVAL)
	// pool full before the unmapped range
	reg(t, pd, addr, 4096, 0)
	_, err = pd.RegMR(addr, 3*4096, 0)
	verbstest.WantErrno(t, err, syscall.EINVAL)
}

func TestErrorText(t *testing.T) {
	_, pd := open(t, Options{})
	addr, _ := verbstest.Map(t, 64<<10)
	_, err := pd.RegMR(addr, 64<<10, verbs.OnDemand)
	if err == nil || !strings.HasPrefix(err.Error(), "reg_mr 64 KiB in pd 1: ") {
		t.Errorf("error %q lacks the reg_mr context", err)
	}
}

func TestOverflow(t *testing.T) {
	_, pd := open(t, Options{})
	_, err := pd.RegMR(^uintptr(0)-100, 4096, 0)
	verbstest.WantErrno(t, err, syscall.EINVAL)
	_, err = pd.RegMR(^uintptr(0)-4096, 2048, 0) // fits, but its page end does not
	verbstest.WantErrno(t, err, syscall.EINVAL)
}

func TestDeallocTwice(t *testing.T) {
	_, pd := open(t, Options{})
	if err := pd.Dealloc(); err != nil {
		t.Fatal(err)
	}
	verbstest.WantErrno(t, pd.Dealloc(), syscall.EINVAL)
	addr, _ := verbstest.Map(t, 4096)
	_, err := pd.RegMR(addr, 4096, 0)
	verbstest.WantErrno(t, err, syscall.EINVAL)
}

func TestPDHandles(t *testing.T) {
	dev, pd := open(t, Options{})
	dev2, err := New(Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer dev2.Close()
	other, _ := dev2.AllocPD()
	pd2, _ := dev.AllocPD()
	if pd.Handle() != 1 || pd2.Handle() != 2 || other.Handle() != 1 {
		t.Errorf("handles %d %d (other device %d), want 1 2 (1)", pd.Handle(), pd2.Handle(), other.Handle())
	}
}

func TestMaxPD(t *testing.T) {
	dev, _ := open(t, Options{})
	dev.(*context).dev.attr.MaxPD = 3 // rxe's 1<<20 takes too long to fill
	for range 2 {
		if _, err := dev.AllocPD(); err != nil {
			t.Fatal(err)
		}
	}
	_, err := dev.AllocPD()
	verbstest.WantErrno(t, err, syscall.EINVAL)
}

// Overlapping registrations hold their pages until the last one goes, as
// re-registration over the same pages needs.
func TestOverlapKeepsPagesLocked(t *testing.T) {
	_, pd := open(t, Options{})
	addr, _ := verbstest.Map(t, 16*4096)
	base := vmLck(t)
	a := reg(t, pd, addr, 8*4096, verbs.LocalWrite)
	b := reg(t, pd, addr+4*4096, 8*4096, verbs.LocalWrite)
	if got := vmLck(t); got != base+12*4 {
		t.Fatalf("VmLck %d, want %d", got, base+12*4)
	}
	a.Dereg()
	if got := vmLck(t); got != base+8*4 {
		t.Errorf("VmLck %d after the first Dereg, want %d", got, base+8*4)
	}
	// Registering a smaller range anew, then dropping the old one (how
	// mrfs shrinks), keeps the shared pages locked throughout.
	c := reg(t, pd, addr+4*4096, 4*4096, verbs.LocalWrite)
	b.Dereg()
	if got := vmLck(t); got != base+4*4 {
		t.Errorf("VmLck %d after replacing by a smaller region, want %d", got, base+4*4)
	}
	c.Dereg()
	if got := vmLck(t); got != base {
		t.Errorf("VmLck %d after the last Dereg, want %d", got, base)
	}
	if len(pins.refs.segs) != 0 {
		t.Errorf("page refs left: %v", pins.refs.segs)
	}
}

// Two providers in one process share the page references.
func TestProvidersShareLocks(t *testing.T) {
	_, pd1 := open(t, Options{})
	_, pd2 := open(t, Options{})
	addr, _ := verbstest.Map(t, 4096)
	base := vmLck(t)
	a := reg(t, pd1, addr, 4096, 0)
	reg(t, pd2, addr, 4096, 0)
	a.Dereg()
	if got := vmLck(t); got != base+4 {
		t.Errorf("VmLck %d, want %d: one provider unlocked the other's page", got, base+4)
	}
}

func TestLargeRegionOneEntry(t *testing.T) {
	_, pd := open(t, Options{})
	const n = 64 << 20
	addr, _ := verbstest.Map(t, n)
	base := vmLck(t)
	mr := reg(t, pd, addr, n, verbs.LocalWrite)
	if len(pins.refs.segs) != 1 {
		t.Errorf("%d page-ref entries for one region", len(pins.refs.segs))
	}
	if got := vmLck(t); got != base+n/1024 {
		t.Errorf("VmLck %d, want %d", got, base+n/1024)
	}
	mr.Dereg()
}

// Close frees what the kernel frees when the device file closes; the
// children then answer ENODEV.
func TestCloseReleases(t *testing.T) {
	p := New(Options{MaxMR: 2})
	// Another context of the same device keeps its region.
	other, _ := p.Open("soft0")
	otherPD, _ := other.AllocPD()
	otherAddr, _ := verbstest.Map(t, 4096)
	otherMR := reg(t, otherPD, otherAddr, 4096, 0)
	dev, _ := p.Open("soft0")
	pd, _ := dev.AllocPD()
	addr, _ := verbstest.Map(t, 8*4096)
	base := vmLck(t)
	mr, err := pd.RegMR(addr, 8*4096, verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Close(); err != nil {
		t.Fatalf("Close with a PD and a region: %v", err)
	}
	if got := vmLck(t); got != base {
		t.Errorf("VmLck %d after Close, want %d", got, base)
	}
	if err := otherMR.Dereg(); err != nil {
		t.Errorf("the other context's region after Close: %v", err)
	}
	if err := otherPD.Dealloc(); err != nil {
		t.Errorf("the other context's PD after Close: %v", err)
	}
	other.Close()
	verbstest.WantErrno(t, mr.Dereg(), syscall.ENODEV)
	verbstest.WantErrno(t, pd.Dealloc(), syscall.ENODEV)
	_, err = pd.RegMR(addr, 4096, 0)
	verbstest.WantErrno(t, err, syscall.ENODEV)
	_, err = dev.AllocPD()
	verbstest.WantErrno(t, err, syscall.ENODEV)
	verbstest.WantErrno(t, dev.Close(), syscall.ENODEV)
	// The region left the device: max_mr counts it no more.
	dev2, _ := p.Open("")
	defer dev2.Close()
	pd2, _ := dev2.AllocPD()
	reg(t, pd2, addr, 4096, 0)
	reg(t, pd2, addr+4096, 4096, 0)
}

// Concurrent registrations, replacements and deregs over shared pages
// leave nothing locked once all are gone.
func TestConcurrentOverlap(t *testing.T) {
	dev, pd := open(t, Options{MaxMR: 32})
	pd2, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := verbstest.Map(t, 16*4096)
	base := vmLck(t)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range 200 {
				off := uintptr(rng.IntN(8) * 4096)
				mr, err := pd.RegMR(addr+off, uint64(1+rng.IntN(8*4096)), verbs.LocalWrite)
				if err != nil {
					t.Errorf("RegMR: %v", err)
					return
				}
				// Replaced by a region of another range in another PD,
				// as a resize plus move does.
				mr2, err := pd2.RegMR(addr+uintptr(rng.IntN(8)*4096), uint64(1+rng.IntN(8*4096)), verbs.LocalWrite)
				if err != nil {
					t.Errorf("RegMR in pd2: %v", err)
				}
				if err := mr.Dereg(); err != nil {
					t.Errorf("Dereg: %v", err)
				}
				if mr2 != nil {
					if err := mr2.Dereg(); err != nil {
						t.Errorf("Dereg: %v", err)
					}
				}
			}
		})
	}
	wg.Wait()
	if got := vmLck(t); got != base {
		t.Errorf("VmLck %d, want %d", got, base)
	}
	pins.mu.Lock()
	defer pins.mu.Unlock()
	if len(pins.refs.segs) != 0 {
		t.Errorf("page refs left: %v", pins.refs.segs)
	}
}

// pageRefs against a page-by-page model.
func TestPageRefs(t *testing.T) {
	var r pageRefs
	model := map[uint64]int32{}
	type held struct{ s, e uint64 }
	var live []held
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 5000 {
		if len(live) > 0 && rng.IntN(2) == 0 {
			k := rng.IntN(len(live))
			h := live[k]
			live = append(live[:k], live[k+1:]...)
			zero := r.add(h.s, h.e, -1)
			var want []span
			for p := h.s; p < h.e; p++ {
				model[p]--
				if model[p] == 0 {
					delete(model, p)
					if n := len(want); n > 0 && want[n-1].end == p {
						want[n-1].end++
					} else {
						want = append(want, span{p, p + 1})
					}
				}
			}
			if !equalSpans(zero, want) {
				t.Fatalf("step %d: freed %v, want %v", i, zero, want)
			}
		} else {
			s := uint64(rng.IntN(200))
			h := held{s, s + 1 + uint64(rng.IntN(30))}
			live = append(live, h)
			r.add(h.s, h.e, 1)
			for p := h.s; p < h.e; p++ {
				model[p]++
			}
		}
		// Segments are sorted, disjoint, positive, merged, and match.
		n := 0
		for k, g := range r.segs {
			if g.start >= g.end || g.refs <= 0 || k > 0 && (r.segs[k-1].end > g.start ||
				r.segs[k-1].end == g.start && r.segs[k-1].refs == g.refs) {
				t.Fatalf("step %d: bad segments %v", i, r.segs)
			}
			for p := g.start; p < g.end; p++ {
				if model[p] != g.refs {
					t.Fatalf("step %d: page %d has %d refs, model %d", i, p, g.refs, model[p])
				}
				n++
			}
		}
		if n != len(model) {
			t.Fatalf("step %d: %d pages held, model %d", i, n, len(model))
		}
	}
}

func equalSpans(a, b []span) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// childEnv marks the re-executed test binary that runs without
// CAP_IPC_LOCK.
const childEnv = "MRFS_SOFT_MEMLOCK_CHILD"

// TestMemlockLimits checks RLIMIT_MEMLOCK accounting (ENOMEM, and EPERM at
// 0) in a child process that lacks CAP_IPC_LOCK: as root the child is
// started through setpriv with the capability removed from its bounding
// and inheritable sets, so exec does not grant it.
func TestMemlockLimits(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		memlockChild(t)
		return
	}
	args := []string{"-test.run=^TestMemlockLimits$", "-test.v", "-test.count=1"}
	var cmd *exec.Cmd
	switch {
	case !verbs.CanLockMemory():
		cmd = exec.Command(os.Args[0], args...) // already unprivileged
	case os.Geteuid() != 0:
		t.Skip("not root: this process has CAP_IPC_LOCK but cannot start a child without it")
	default:
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Skip("setpriv (util-linux) not found: cannot drop CAP_IPC_LOCK for the child")
		}
		cmd = exec.Command(setpriv, append([]string{"--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--", os.Args[0]}, args...)...)
	}
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.CombinedOutput()
	t.Logf("child:\n%s", out)
	if err != nil {
		t.Fatalf("child failed: %v", err)
	}
	if !strings.Contains(string(out), "--- PASS: TestMemlockLimits") {
		t.Fatal("child did not pass")
	}
}

func memlockChild(t *testing.T) {
	if verbs.CanLockMemory() {
		t.Fatal("the child still has CAP_IPC_LOCK")
	}
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &old); err != nil {
		t.Fatal(err)
	}
	setLimit := func(n uint64) {
		t.Helper()
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: min(n, old.Max), Max: old.Max}); err != nil {
			t.Fatal(err)
		}
	}
	if old.Max < 64<<10 {
		t.Fatalf("hard RLIMIT_MEMLOCK %d is below the 64 KiB the test needs", old.Max)
	}
	setLimit(64 << 10)
	_, pd := open(t, Options{})
	addr, _ := verbstest.Map(t, 1<<20)

	a := reg(t, pd, addr, 32<<10, verbs.LocalWrite)
	// The same pages again count again (pinned_vm): 64 KiB, at the limit.
	reg(t, pd, addr, 32<<10, verbs.LocalWrite)
	// One more page is over, although only 32 KiB are locked.
	_, err := pd.RegMR(addr+(32<<10), 4096, verbs.LocalWrite)
	verbstest.WantErrno(t, err, syscall.ENOMEM)
	if !strings.Contains(err.Error(), "RLIMIT_MEMLOCK") {
		t.Errorf("error %q does not name the limit", err)
	}
	// ENOMEM comes before the pin finds the range unmapped.
	_, err = pd.RegMR(addr+(1<<20), 1<<20, verbs.LocalWrite)
	verbstest.WantErrno(t, err, syscall.ENOMEM)
	a.Dereg()
	reg(t, pd, addr+(32<<10), 4096, verbs.LocalWrite)

	setLimit(0)
	_, err = pd.RegMR(addr, 4096, 0)
	verbstest.WantErrno(t, err, syscall.EPERM)
	_, err = pd.RegMR(addr, 0, 0) // EPERM is checked before npages == 0
	verbstest.WantErrno(t, err, syscall.EPERM)
	_, err = pd.RegMR(^uintptr(0)-100, 4096, 0) // and the overflow before EPERM
	verbstest.WantErrno(t, err, syscall.EINVAL)
}

func BenchmarkRegDereg4K(b *testing.B) {
	dev, err := New(Options{}).Open("")
	if err != nil {
		b.Fatal(err)
	}
	defer dev.Close()
	pd, _ := dev.AllocPD()
	addr, _ := verbstest.Map(b, 4096)
	for b.Loop() {
		mr, err := pd.RegMR(addr, 4096, verbs.LocalWrite|verbs.RemoteRead)
		if err != nil {
			b.Fatal(err)
		}
		if err := mr.Dereg(); err != nil {
			b.Fatal(err)
		}
	}
}

// Asking for a device past the ones there are names the setting that
// makes more (a user listing soft0 and soft1 in verbs.devices).
func TestOpenMissingNamesSetting(t *testing.T) {
	_, err := New(Options{}).Open("soft1")
	if err == nil || !strings.Contains(err.Error(), "soft has only soft0") || !strings.Contains(err.Error(), "verbs.soft_devices") {
		t.Fatalf("opening soft1 of one device: %v", err)
	}
	dev, err := New(Options{Devices: 2}).Open("soft1")
	if err != nil {
		t.Fatalf("soft1 of two devices: %v", err)
	}
	dev.Close()
}

// A page that cannot be made (here past the end of the file mapped, as
// in a full tmpfs) fails the pin with EFAULT, as the kernel's pin meets
// the fault as SIGBUS; mrfs tells a full store from a memlock limit by it.
func TestPinFaultIsEFAULT(t *testing.T) {
	if !verbs.CanLockMemory() {
		t.Skip("needs CAP_IPC_LOCK: without it an mlock failure may be RLIMIT_MEMLOCK's")
	}
	_, pd := open(t, Options{})
	fd, err := unix.MemfdCreate("short", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 4096); err != nil {
		t.Fatal(err)
	}
	p, err := unix.MmapPtr(fd, 0, nil, 2*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.MunmapPtr(p, 2*4096)
	mr, err := pd.RegMR(uintptr(p), 2*4096, verbs.LocalWrite)
	if err == nil {
		mr.Dereg()
		t.Fatal("registered a page past the end of its file")
	}
	if verbs.Errno(err) != syscall.EFAULT {
		t.Fatalf("reg_mr of a page that cannot be faulted in: %v, want EFAULT", err)
	}
	if pins.pinned != 0 || len(pins.refs.segs) != 0 {
		t.Errorf("left pinned: %d pages, refs %v", pins.pinned, pins.refs.segs)
	}
}
