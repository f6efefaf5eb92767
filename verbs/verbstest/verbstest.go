// Package verbstest is the conformance suite for verbs.Provider. Every
// backend runs it: verbs/soft in its tests, and verbs/ibv against a real
// device (rxe in a VM). So each case checks a fact about verbs (the
// kernel's and libibverbs' behaviour, or the verbs package's contract),
// never a detail of one backend; what legitimately differs between
// providers is read from DeviceAttr or stated in Options.
//
// The suite registers memory and reads /proc/self/status, so run it in a
// test that is not parallel with other tests that pin memory.
package verbstest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
)

// Options state what a provider promises beyond the verbs contract.
type Options struct {
	// RxeKeys: keys are index<<8 | one byte with lkey == rkey, and the
	// index comes from a cyclic allocator over [1, MaxMR] (rxe; soft
	// keys are random).
	RxeKeys bool
	// PinField is the /proc/self/status field that grows by a region's
	// whole pages while it is registered: "VmPin" where the kernel pins
	// (pinned_vm: real devices), "VmLck" where pages are mlocked (soft).
	// "" skips the check.
	PinField string
	// MaxExhaust is the largest MaxMR the suite fills to check that one
	// more registration fails; 0 means 4096. Larger devices skip it.
	MaxExhaust int
	// LocalRKeyZero: a region registered without remote access may have
	// rkey 0 instead of its lkey (rxe before Linux 6.5, such as the 6.1
	// kernel of tests/vm).
	LocalRKeyZero bool
}

// DefaultOptions infers Options from a provider: the soft backend
// promises everything but rxe's keys; rxe devices (names starting "rxe") promise rxe
// keys, possibly rkey 0 without remote access, and pin in VmPin;
// anything else gets only the contract.
func DefaultOptions(p verbs.Provider) Options {
	if p.Name() == "soft" {
		return Options{PinField: "VmLck"}
	}
	if devs, err := p.Devices(); err == nil && len(devs) > 0 && strings.HasPrefix(devs[0].Name, "rxe") {
		return RxeOptions()
	}
	return Options{}
}

// RxeOptions returns the options for an rxe device. The soft backend
// in its rxe mode passes the same but for PinField and RxeKeys (see the
// differences listed in cases.go).
func RxeOptions() Options {
	return Options{RxeKeys: true, PinField: "VmPin", LocalRKeyZero: true}
}

// Run runs the suite with DefaultOptions. newProvider is called once per
// subtest and must return a fresh provider.
func Run(t *testing.T, newProvider func(t *testing.T) verbs.Provider) {
	t.Helper()
	RunWith(t, newProvider, DefaultOptions(newProvider(t)))
}

// RunWith runs the suite with explicit options.
func RunWith(t *testing.T, newProvider func(t *testing.T) verbs.Provider, opt Options) {
	t.Helper()
	if opt.MaxExhaust == 0 {
		opt.MaxExhaust = 4096
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.run(t, &env{t: t, newProvider: newProvider, opt: opt})
		})
	}
}

// env gives a case a provider, an open device and one PD, all released
// when the case ends.
type env struct {
	t           *testing.T
	newProvider func(t *testing.T) verbs.Provider
	opt         Options
	p           verbs.Provider
	dev         verbs.Device
	attr        verbs.DeviceAttr
	pd          verbs.PD
}

// open opens the default device and allocates a PD.
func (e *env) open() {
	e.t.Helper()
	e.p = e.newProvider(e.t)
	dev, err := e.p.Open("")
	if err != nil {
		e.t.Fatalf("Open(\"\"): %v", err)
	}
	e.t.Cleanup(func() { dev.Close() })
	e.dev, e.attr = dev, dev.Attr()
	e.pd = e.allocPD()
}

func (e *env) allocPD() verbs.PD {
	e.t.Helper()
	pd, err := e.dev.AllocPD()
	if err != nil {
		e.t.Fatalf("AllocPD: %v", err)
	}
	e.t.Cleanup(func() { pd.Dealloc() })
	return pd
}

// reg registers and fails the test on error; the region is deregistered
// at cleanup if the test has not done it.
func (e *env) reg(pd verbs.PD, addr uintptr, n uint64, a verbs.Access) verbs.MR {
	e.t.Helper()
	mr, err := pd.RegMR(addr, n, a)
	if err != nil {
		e.t.Fatalf("RegMR(0x%x, %d, %s): %v", addr, n, a, err)
	}
	e.t.Cleanup(func() { mr.Dereg() })
	return mr
}

// regErr registers expecting errno want.
func (e *env) regErr(pd verbs.PD, addr uintptr, n uint64, a verbs.Access, want syscall.Errno) {
	e.t.Helper()
	mr, err := pd.RegMR(addr, n, a)
	if err == nil {
		mr.Dereg()
		e.t.Fatalf("RegMR(0x%x, %d, %q) succeeded, want %v", addr, n, a, want)
	}
	WantErrno(e.t, err, want)
}

// WantErrno fails t unless err wraps want.
func WantErrno(t testing.TB, err error, want syscall.Errno) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("error %v (errno %d), want %v (%d)", err, verbs.Errno(err), want, want)
	}
}

// Map returns n bytes of a fresh memfd mapped MAP_SHARED, the memory
// mrfs registers; it is unmapped when the test ends. Call it before
// registering, so that the region is deregistered before the unmap.
func Map(t testing.TB, n int) (uintptr, []byte) {
	t.Helper()
	fd, err := unix.MemfdCreate("verbstest", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatalf("memfd_create: %v", err)
	}
	defer unix.Close(fd) // the mapping keeps the file
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		t.Fatalf("ftruncate: %v", err)
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("mmap %d bytes: %v", n, err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return uintptr(unsafe.Pointer(&b[0])), b
}

// Unmap unmaps part of a mapping from Map, to make a hole.
func Unmap(t testing.TB, addr uintptr, n int) {
	t.Helper()
	if _, _, e := unix.Syscall(unix.SYS_MUNMAP, addr, uintptr(n), 0); e != 0 {
		t.Fatalf("munmap 0x%x+%d: %v", addr, n, e)
	}
}

// StatusKB reads a "kB" field such as VmLck from /proc/self/status.
func StatusKB(field string) (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), field+":"); ok {
			return strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in /proc/self/status", field)
}

func statusKB(t testing.TB, field string) uint64 {
	t.Helper()
	v, err := StatusKB(field)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
