package buffer_test

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
)

// spy wraps a device to count live regions and PDs as the device sees
// them, to check that a region is still mapped when it is deregistered,
// and to inject failures.
type spy struct {
	verbs.Device
	t *testing.T

	mu         sync.Mutex
	liveMRs    int
	livePDs    int
	events     []string
	failReg    func(length uint64, a verbs.Access) error // nil: no failure
	failDereg  func(mr verbs.MR) error
	violations []string
	maxMRSize  uint64 // 0: the device's own
	maxPD      int    // 0: the device's own
}

func (s *spy) Attr() verbs.DeviceAttr {
	a := s.Device.Attr()
	if s.maxMRSize != 0 {
		a.MaxMRSize = s.maxMRSize
	}
	if s.maxPD != 0 {
		a.MaxPD = s.maxPD
	}
	return a
}

func (s *spy) log(format string, args ...any) {
	s.events = append(s.events, fmt.Sprintf(format, args...))
}

func (s *spy) counts() (mrs, pds int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.liveMRs, s.livePDs
}

func (s *spy) checkViolations(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.violations {
		t.Error(v)
	}
}

func (s *spy) AllocPD() (verbs.PD, error) {
	pd, err := s.Device.AllocPD()
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.livePDs++
	s.mu.Unlock()
	return &spyPD{PD: pd, s: s}, nil
}

type spyPD struct {
	verbs.PD
	s *spy
}

func (p *spyPD) RegMR(addr uintptr, length uint64, a verbs.Access) (verbs.MR, error) {
	s := p.s
	s.mu.Lock()
	fail, maxSize := s.failReg, s.maxMRSize
	s.mu.Unlock()
	if fail != nil {
		if err := fail(length, a); err != nil {
			return nil, err
		}
	}
	if maxSize != 0 && length > maxSize {
		return nil, fmt.Errorf("reg_mr of %d bytes past max_mr_size %d: %w", length, maxSize, syscall.EINVAL)
	}
	mr, err := p.PD.RegMR(addr, length, a)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.liveMRs++
	s.log("reg %d", length)
	s.mu.Unlock()
	return &spyMR{MR: mr, pd: p}, nil
}

func (p *spyPD) Dealloc() error {
	if err := p.PD.Dealloc(); err != nil {
		return err
	}
	p.s.mu.Lock()
	p.s.livePDs--
	p.s.mu.Unlock()
	return nil
}

type spyMR struct {
	verbs.MR
	pd *spyPD
}

func (m *spyMR) PD() verbs.PD { return m.pd }

// Keys passes a region's keys on several devices through.
func (m *spyMR) Keys() []verbs.DeviceKeys {
	if mm, ok := m.MR.(verbs.MultiMR); ok {
		return mm.Keys()
	}
	return nil
}

func (m *spyMR) Dereg() error {
	s := m.pd.s
	s.mu.Lock()
	fail := s.failDereg
	s.mu.Unlock()
	if fail != nil {
		if err := fail(m); err != nil {
			return err
		}
	}
	// The registered range must still be mapped: unmapping first would
	// leave the device writing into memory nobody sees.
	mapped := msync(m.Addr(), m.Length()) == nil
	err := m.MR.Dereg()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		if !mapped {
			s.violations = append(s.violations, fmt.Sprintf("region 0x%x+%d deregistered after its memory was unmapped", m.Addr(), m.Length()))
		}
		s.liveMRs--
		s.log("dereg %d", m.Length())
	}
	return err
}

func msync(addr uintptr, n uint64) error {
	start := addr &^ uintptr(os.Getpagesize()-1)
	if _, _, e := unix.Syscall(unix.SYS_MSYNC, start, uintptr(n)+addr-start, unix.MS_ASYNC); e != 0 {
		return e
	}
	return nil
}

// errnoIs fails the test unless err carries want.
func errnoIs(t *testing.T, err error, want syscall.Errno) {
	t.Helper()
	if err == nil {
		t.Fatalf("got nil error, want %v", want)
	}
	if !errors.Is(err, want) {
		t.Fatalf("got %v (errno %d), want %v", err, verbs.Errno(err), want)
	}
}

// Limiting passes on a joined device's (verbs/multi).
func (s *spy) Limiting(limit func(verbs.DeviceAttr) int) string {
	if l, ok := s.Device.(interface {
		Limiting(func(verbs.DeviceAttr) int) string
	}); ok {
		return l.Limiting(limit)
	}
	return s.Device.Name()
}
