//go:build rdma

package ibv

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"mrfs/verbs"
	"mrfs/verbs/verbstest"
)

const noDevice = "no RDMA device (the host kernel has none): run tests/vm/run for real verbs"

// rdma returns New() when it sees at least one device, and skips
// the test otherwise: a missing capability of this machine, not a
// failure. Inside the tests/vm guest (MRFS_VM_GUEST=1) a device must be
// there, so a skip would hide a broken provider: it fails instead.
func rdma(t testing.TB) verbs.Provider {
	t.Helper()
	skip := t.Skip
	if os.Getenv("MRFS_VM_GUEST") == "1" {
		skip = func(args ...any) { t.Fatal(append([]any{"in the VM guest: "}, args...)...) }
	}
	p, err := New()
	if errors.Is(err, syscall.ENOSYS) {
		skip(noDevice)
	}
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	devs, err := p.Devices()
	if err != nil {
		t.Fatalf("Devices: %v", err)
	}
	if len(devs) == 0 {
		skip(noDevice)
	}
	return p
}

// options are DefaultOptions, and rxe's options for an rxe device whose
// name does not say so (this package leaves zero_based out only on rxe).
func options(t *testing.T, p verbs.Provider) verbstest.Options {
	opt := verbstest.DefaultOptions(p)
	devs, err := p.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if !opt.RxeKeys && devs[0].Attr.Access&verbs.ZeroBased == 0 {
		opt = verbstest.RxeOptions()
	}
	t.Logf("device %s: %+v; suite options %+v", devs[0].Name, devs[0].Attr, opt)
	return opt
}

func TestConformance(t *testing.T) {
	p := rdma(t)
	verbstest.RunWith(t, func(t *testing.T) verbs.Provider { return rdma(t) }, options(t, p))
}

// New works everywhere: without kernel support it fails with an errno,
// with it Devices answers.
func TestNew(t *testing.T) {
	p, err := New()
	if err != nil {
		if verbs.Errno(err) == 0 {
			t.Fatalf("New: %v carries no errno", err)
		}
		t.Logf("New: %v", err)
		return
	}
	if p.Name() != "rdma" {
		t.Errorf("Name() = %q, want rdma", p.Name())
	}
	if _, err := p.Devices(); err != nil {
		t.Errorf("Devices: %v", err)
	}
}

func TestDeviceAttr(t *testing.T) {
	base := verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic | verbs.RelaxedOrdering
	for _, c := range []struct {
		name   string
		raw    rawAttr
		access verbs.Access
	}{
		// rxe as tests/vm reports it: memory windows, no ODP.
		{"rxe0", rawAttr{capFlags: capMemWindow, vendorID: rxeVendorID}, base | verbs.MWBind},
		{"soft-roce", rawAttr{vendorID: rxeVendorID}, base}, // renamed rxe
		{"rxe_eth1", rawAttr{odp: true}, base | verbs.OnDemand},
		{"mlx5_0", rawAttr{capFlags: capMemWindow, vendorID: 0x02c9, odp: true},
			base | verbs.MWBind | verbs.OnDemand | verbs.ZeroBased},
		{"irdma0", rawAttr{vendorID: 0x8086}, base | verbs.ZeroBased},
	} {
		c.raw.maxMR, c.raw.maxPD, c.raw.maxMRSize, c.raw.pageSizeCap = 524287, 1<<20, ^uint64(0), 0xFFFFF000
		a := deviceAttr(c.name, c.raw)
		want := verbs.DeviceAttr{MaxMR: 524287, MaxMRSize: ^uint64(0), PageSizeCap: 0xFFFFF000, MaxPD: 1 << 20, Access: c.access}
		if a != want {
			t.Errorf("%s: %+v, want %+v", c.name, a, want)
		}
	}
}

func TestCheckAccess(t *testing.T) {
	attr := verbs.DeviceAttr{Access: verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead}
	for _, c := range []struct {
		a    verbs.Access
		want syscall.Errno
	}{
		{0, 0},
		{verbs.LocalWrite | verbs.RemoteWrite, 0},
		{verbs.RemoteWrite, syscall.EINVAL},
		{verbs.LocalWrite | verbs.ZeroBased, syscall.EOPNOTSUPP},
		// The kernel's EINVAL comes before the device's EOPNOTSUPP.
		{verbs.RemoteAtomic | verbs.ZeroBased, syscall.EINVAL},
	} {
		if got := verbs.Errno(checkAccess(c.a, attr)); got != c.want {
			t.Errorf("checkAccess(%s) = %v, want %v", c.a, got, c.want)
		}
	}
}

// open opens the first device and a PD, closed at cleanup.
func open(t *testing.T) (verbs.Device, verbs.PD) {
	t.Helper()
	dev, err := rdma(t).Open("")
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

// What would be a use-after-free in C is answered in Go with the soft
// model's errnos.
func TestGuards(t *testing.T) {
	dev, pd := open(t)
	addr, _ := verbstest.Map(t, 64<<10)

	mr, err := pd.RegMR(addr, 64<<10, verbs.LocalWrite|verbs.RemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	verbstest.WantErrno(t, pd.Dealloc(), syscall.EBUSY) // the kernel's usecnt
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	verbstest.WantErrno(t, mr.Dereg(), syscall.EINVAL)
	if err := pd.Dealloc(); err != nil {
		t.Fatal(err)
	}
	verbstest.WantErrno(t, pd.Dealloc(), syscall.EINVAL)
	_, err = pd.RegMR(addr, 4096, 0)
	verbstest.WantErrno(t, err, syscall.EINVAL)
	want := fmt.Sprintf("reg_mr 4 KiB in pd %d on %s: ", pd.Handle(), dev.Name())
	if !strings.HasPrefix(err.Error(), want) {
		t.Errorf("error %q does not start with %q", err, want)
	}

	pd2, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	mr2, err := pd2.RegMR(addr, 4096, verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	key := mr2.LKey()

	// Close with a PD and a region left: the kernel frees them; every
	// later call answers ENODEV.
	if err := dev.Close(); err != nil {
		t.Fatalf("Close with a live PD and region: %v", err)
	}
	verbstest.WantErrno(t, mr2.Dereg(), syscall.ENODEV)
	verbstest.WantErrno(t, pd2.Dealloc(), syscall.ENODEV)
	_, err = pd2.RegMR(addr, 4096, 0)
	verbstest.WantErrno(t, err, syscall.ENODEV)
	_, err = dev.AllocPD()
	verbstest.WantErrno(t, err, syscall.ENODEV)
	verbstest.WantErrno(t, dev.Close(), syscall.ENODEV)
	if mr2.LKey() != key {
		t.Errorf("getters after Close: lkey 0x%x, want 0x%x", mr2.LKey(), key)
	}
}

// Close waits for calls in flight and fails later ones with ENODEV;
// nothing reaches a freed context (run with -race).
func TestCloseWhileRegistering(t *testing.T) {
	dev, pd := open(t)
	addr, _ := verbstest.Map(t, 8*4096)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for {
				mr, err := pd.RegMR(addr+uintptr(w*4096), 4096, verbs.LocalWrite)
				if err == nil {
					err = mr.Dereg()
				}
				if err != nil {
					if !errors.Is(err, syscall.ENODEV) {
						t.Errorf("want ENODEV once closed: %v", err)
					}
					return
				}
			}
		})
	}
	time.Sleep(50 * time.Millisecond)
	if err := dev.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
}

var benchSizes = []struct {
	name string
	n    int
}{{"4KiB", 4 << 10}, {"1MiB", 1 << 20}, {"64MiB", 64 << 20}, {"1GiB", 1 << 30}}

// warm maps n bytes of a memfd and touches every page, so that the
// benchmark measures pinning, not first-touch faults.
func warm(b *testing.B, n int) uintptr {
	addr, mem := verbstest.Map(b, n)
	for i := 0; i < n; i += 4096 {
		mem[i] = 1
	}
	return addr
}

// BenchmarkRegMR registers and deregisters a warm memfd mapping through
// the provider; reg-ns/op and dereg-ns/op split the two.
func BenchmarkRegMR(b *testing.B) {
	dev, err := rdma(b).Open("")
	if err != nil {
		b.Fatal(err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		b.Fatal(err)
	}
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			addr := warm(b, s.n)
			b.SetBytes(int64(s.n))
			var reg, dereg time.Duration
			for b.Loop() {
				t0 := time.Now()
				mr, err := pd.RegMR(addr, uint64(s.n), verbs.LocalWrite|verbs.RemoteWrite|verbs.RemoteRead)
				if err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := mr.Dereg(); err != nil {
					b.Fatal(err)
				}
				reg, dereg = reg+t1.Sub(t0), dereg+time.Since(t1)
			}
			b.ReportMetric(float64(reg.Nanoseconds())/float64(b.N), "reg-ns/op")
			b.ReportMetric(float64(dereg.Nanoseconds())/float64(b.N), "dereg-ns/op")
		})
	}
}

// BenchmarkRegMRRaw is the baseline without this package's Go layer:
// the cgo wrappers alone, to show what the locking and checks cost.
func BenchmarkRegMRRaw(b *testing.B) {
	rdma(b)
	devs, free, err := getDevices()
	if err != nil {
		b.Fatal(err)
	}
	ctx, err := devs[0].open()
	free()
	if err != nil {
		b.Fatal(err)
	}
	defer ctx.close()
	pd, err := ctx.allocPD()
	if err != nil {
		b.Fatal(err)
	}
	defer pd.dealloc()
	access := uint32(verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead)
	for _, s := range benchSizes {
		b.Run(s.name, func(b *testing.B) {
			addr := warm(b, s.n)
			b.SetBytes(int64(s.n))
			for b.Loop() {
				mr, err := pd.regMR(addr, uint64(s.n), uint64(addr), access)
				if err != nil {
					b.Fatal(err)
				}
				if errno := mr.dereg(); errno != 0 {
					b.Fatal(errno)
				}
			}
		})
	}
}
