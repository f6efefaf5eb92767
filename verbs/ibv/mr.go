//go:build rdma

package ibv

import (
	"fmt"
	"sync"
	"syscall"

	"mrfs/verbs"
)

type mrState int

const (
	mrLive mrState = iota
	// mrBroken: ibv_rereg_mr failed with IBV_REREG_MR_ERR_CMD; the
	// region must not be used, only deregistered (ibv_rereg_mr(3)).
	mrBroken
	mrDead // deregistered: the ibv_mr is freed
)

// mr is a memory region. Its getters read a Go copy of the ibv_mr's
// fields, taken after each change, so they never touch C memory that
// Dereg or Close may have freed.
type mr struct {
	dev *device // immutable
	c   cMR     // immutable: libibverbs updates the same ibv_mr on rereg

	// guards: every field below. Never held across a libibverbs call:
	// busy marks a Rereg or Dereg in flight, so getters do not wait for
	// the kernel (re-pinning 1 GiB takes tens of milliseconds).
	mu         sync.Mutex
	pd         *pd
	lkey, rkey uint32
	addr       uintptr
	length     uint64
	access     verbs.Access
	state      mrState
	busy       bool
}

func (m *mr) LKey() uint32 { m.mu.Lock(); defer m.mu.Unlock(); return m.lkey }
func (m *mr) RKey() uint32 { m.mu.Lock(); defer m.mu.Unlock(); return m.rkey }
func (m *mr) Addr() uintptr {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.addr
}

// IOVA equals Addr: RegMR registers with iova = addr, and the providers'
// rereg passes the new address as iova too.
func (m *mr) IOVA() uint64 { m.mu.Lock(); defer m.mu.Unlock(); return uint64(m.addr) }
func (m *mr) Length() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.length
}
func (m *mr) Access() verbs.Access {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.access
}
func (m *mr) PD() verbs.PD { m.mu.Lock(); defer m.mu.Unlock(); return m.pd }

// begin checks that the region may be used by op and marks it busy.
// Called with dev.mu held shared; returns with m.mu released.
func (m *mr) begin(op string, brokenOK bool) (what string, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	what = fmt.Sprintf("%s key 0x%x on %s", op, m.lkey, m.dev.name)
	switch {
	case m.dev.closed:
		return what, fmt.Errorf("%s: device closed: %w", what, syscall.ENODEV)
	case m.state == mrDead:
		return what, fmt.Errorf("%s: region is not registered: %w", what, syscall.EINVAL)
	case m.state == mrBroken && !brokenOK:
		return what, fmt.Errorf("%s: an earlier rereg failed; the region can only be deregistered: %w", what, syscall.EINVAL)
	case m.busy:
		// As the kernel's uobject lock answers a second destroy or
		// rereg of an object in use.
		return what, fmt.Errorf("%s: another rereg or dereg is in progress: %w", what, syscall.EBUSY)
	}
	m.busy = true
	return what, nil
}

// Rereg follows ibv_rereg_mr and the verbs.MR contract. Requests that
// cannot succeed (no flags, access the kernel or the device would
// refuse, a PD of another device or a deallocated one) are refused here
// and leave the region usable; libibverbs refuses bad input itself
// (IBV_REREG_MR_ERR_INPUT, region valid). A provider without rereg
// (rxe) answers IBV_REREG_MR_ERR_CMD with EOPNOTSUPP before doing
// anything, so the region stays as it was; after any other ERR_CMD only
// Dereg is allowed. On success the keys, address, length and PD are read
// back from the ibv_mr (keys may change).
func (m *mr) Rereg(a verbs.ReregArgs) error {
	d := m.dev
	d.mu.RLock()
	defer d.mu.RUnlock()
	what, err := m.begin("rereg_mr", false)
	if err != nil {
		return err
	}
	done := func(err error) error {
		m.mu.Lock()
		m.busy = false
		m.mu.Unlock()
		return err
	}

	// The kernel answers flags == 0 with EINVAL, which libibverbs would
	// turn into ERR_CMD and so cost the region.
	if a.Flags == 0 {
		return done(fmt.Errorf("%s: no change requested: %w", what, syscall.EINVAL))
	}
	if a.Flags&verbs.ReregAccess != 0 {
		if err := checkAccess(a.Access, d.attr); err != nil {
			return done(fmt.Errorf("%s: %w", what, err))
		}
	}
	var target *pd
	if a.Flags&verbs.ReregPD != 0 {
		p, ok := a.PD.(*pd)
		if !ok || p.dev != d {
			return done(fmt.Errorf("%s: the new pd is not of this device: %w", what, syscall.EINVAL))
		}
		target = p
		p.mu.RLock()
		defer p.mu.RUnlock()
		if p.dead {
			return done(fmt.Errorf("%s: the new pd %d was deallocated: %w", what, p.handle, syscall.EINVAL))
		}
	}
	var cpd cPD // NULL unless the PD changes
	if target != nil {
		cpd = target.c
	}

	code, errno := m.c.rereg(int(a.Flags), cpd, a.Addr, a.Length, int(a.Access))

	m.mu.Lock()
	defer m.mu.Unlock()
	m.busy = false
	switch code {
	case 0, reregErrDoForkOld:
		// DO_FORK_OLD: the new registration is valid; only the old
		// range's fork protection could not be undone.
		f := m.c.fields()
		m.lkey, m.rkey, m.addr, m.length = f.lkey, f.rkey, f.addr, f.length
		if target != nil {
			m.pd = target
		}
		if a.Flags&verbs.ReregAccess != 0 {
			m.access = a.Access
		}
		return nil
	case reregErrInput, reregErrDontForkNew:
		return fmt.Errorf("%s: %w", what, errno)
	case reregErrCmd, reregErrCmdDoForkNew:
		if errno == syscall.EOPNOTSUPP {
			return fmt.Errorf("%s: device %s does not implement rereg_mr: %w", what, d.name, errno)
		}
	}
	m.state = mrBroken
	return fmt.Errorf("%s: failed (ibv_rereg_mr returned %d); the region can now only be deregistered: %w", what, code, errno)
}

// Dereg deregisters the region: EINVAL when it is already gone, ENODEV
// after Device.Close (the kernel has released it then).
func (m *mr) Dereg() error {
	d := m.dev
	d.mu.RLock()
	defer d.mu.RUnlock()
	what, err := m.begin("dereg_mr", true)
	if err != nil {
		return err
	}
	errno := m.c.dereg()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.busy = false
	if errno != 0 {
		// libibverbs keeps the ibv_mr when the kernel refuses.
		return fmt.Errorf("%s: %w", what, errno)
	}
	m.state = mrDead
	d.untrack(m)
	return nil
}
