package soft

import (
	"fmt"
	"syscall"

	"mrfs/verbs"
)

type mrState int

const (
	mrPending mrState = iota // index reserved, pages being pinned
	mrLive
	mrDead
)

// mr is a memory region. Rereg changes it in place, so every field but
// dev is guarded by dev.mu.
type mr struct {
	dev    *device // immutable
	pd     *pd
	idx    uint32
	key    uint32 // lkey == rkey, as rxe gives user MRs
	addr   uintptr
	length uint64
	access verbs.Access
	pin    pinning
	state  mrState
	busy   bool // a Rereg is in flight; the kernel's uobject lock answers EBUSY
}

func (m *mr) LKey() uint32 { m.dev.mu.Lock(); defer m.dev.mu.Unlock(); return m.key }
func (m *mr) RKey() uint32 { m.dev.mu.Lock(); defer m.dev.mu.Unlock(); return m.key }
func (m *mr) Addr() uintptr {
	m.dev.mu.Lock()
	defer m.dev.mu.Unlock()
	return m.addr
}
func (m *mr) IOVA() uint64 { m.dev.mu.Lock(); defer m.dev.mu.Unlock(); return uint64(m.addr) }
func (m *mr) Length() uint64 {
	m.dev.mu.Lock()
	defer m.dev.mu.Unlock()
	return m.length
}
func (m *mr) Access() verbs.Access {
	m.dev.mu.Lock()
	defer m.dev.mu.Unlock()
	return m.access
}
func (m *mr) PD() verbs.PD { m.dev.mu.Lock(); defer m.dev.mu.Unlock(); return m.pd }

// register is reg_mr after the PD lookup: the checks of
// ib_uverbs_reg_mr, rxe_reg_user_mr and ib_umem_get in that order, then
// the pin. replacing is the region a rereg recreates: when the pool is
// full its index is reused with another key. The new region counts
// against p (usecnt) from the moment its index is reserved.
func (d *device) register(p *pd, addr uintptr, length uint64, access verbs.Access, replacing *mr) (*mr, error) {
	d.mu.Lock()
	if p.ctx.closed {
		d.mu.Unlock()
		return nil, fmt.Errorf("device %s closed: %w", d.name, syscall.ENODEV)
	}
	if err := access.Validate(); err != nil {
		d.mu.Unlock()
		return nil, err
	}
	if p.dead {
		d.mu.Unlock()
		return nil, fmt.Errorf("pd %d was deallocated: %w", p.handle, syscall.EINVAL)
	}
	if extra := access &^ d.attr.Access; extra != 0 {
		d.mu.Unlock()
		return nil, fmt.Errorf("device %s does not support access %s: %w", d.name, extra, syscall.EOPNOTSUPP)
	}
	idx, reused, ok := d.allocIndex(replacing)
	if !ok {
		d.mu.Unlock()
		return nil, fmt.Errorf("all %d memory regions of %s are in use (max_mr): %w", d.attr.MaxMR, d.name, syscall.EINVAL)
	}
	var avoid uint32
	if reused {
		avoid = replacing.key
	}
	m := &mr{dev: d, pd: p, idx: idx, key: newKey(idx, avoid), addr: addr, length: length, access: access, state: mrPending}
	if !reused {
		d.mrs[idx] = m
	}
	p.mrs[m] = struct{}{}
	d.mu.Unlock()

	pn, err := pin(addr, length)

	d.mu.Lock()
	defer d.mu.Unlock()
	if err == nil && p.ctx.closed {
		unpin(pn)
		err = fmt.Errorf("device %s closed: %w", d.name, syscall.ENODEV)
	}
	if err != nil {
		if !reused {
			delete(d.mrs, idx)
		}
		delete(p.mrs, m)
		m.state = mrDead
		return nil, err
	}
	m.pin = pn
	m.state = mrLive
	return m, nil
}

// Rereg recreates the region, as mlx5 does when it cannot update in
// place: the new registration is made first (so both count as pinned for
// a moment, as in the kernel), then the old one is released. Keys always
// change. On error the region is unchanged and still registered.
func (m *mr) Rereg(a verbs.ReregArgs) error {
	d := m.dev
	d.mu.Lock()
	what := fmt.Sprintf("rereg_mr key 0x%x", m.key)
	ctx := m.pd.ctx
	fail := func(format string, errno syscall.Errno, args ...any) error {
		d.mu.Unlock()
		return fmt.Errorf("%s: %s: %w", what, fmt.Sprintf(format, args...), errno)
	}
	switch {
	case ctx.closed:
		return fail("device %s closed", syscall.ENODEV, d.name)
	case m.state != mrLive:
		return fail("region is not registered", syscall.EINVAL)
	case m.busy:
		return fail("another rereg is in progress", syscall.EBUSY)
	// libibverbs' input checks, then the kernel's flags==0 check.
	case a.Flags == 0:
		return fail("no change requested", syscall.EINVAL)
	case a.Flags&^(verbs.ReregTranslation|verbs.ReregPD|verbs.ReregAccess) != 0:
		return fail("unknown flags 0x%x", syscall.EINVAL, uint32(a.Flags))
	case a.Flags&verbs.ReregTranslation != 0 && (a.Addr == 0 || a.Length == 0):
		return fail("new translation needs an address and a length", syscall.EINVAL)
	case a.Flags&verbs.ReregAccess == 0 && a.Access != 0:
		return fail("access given without ReregAccess", syscall.EINVAL)
	case d.noRereg:
		return fail("device %s does not implement rereg_mr", syscall.EOPNOTSUPP, d.name)
	}
	newPD, addr, length, access := m.pd, m.addr, m.length, m.access
	if a.Flags&verbs.ReregPD != 0 {
		p, ok := a.PD.(*pd)
		if !ok || p.ctx != ctx {
			return fail("new pd is not of this device context", syscall.EINVAL)
		}
		newPD = p
	}
	if a.Flags&verbs.ReregTranslation != 0 {
		addr, length = a.Addr, a.Length
	}
	if a.Flags&verbs.ReregAccess != 0 {
		access = a.Access
	}
	m.busy = true
	d.mu.Unlock()

	n, err := d.register(newPD, addr, length, access, m)

	d.mem.Lock() // the old registration's memory goes away below
	defer d.mem.Unlock()
	d.mu.Lock()
	m.busy = false
	if err != nil {
		d.mu.Unlock()
		return fmt.Errorf("%s: %w", what, err)
	}
	if ctx.closed { // Close ran between register and here and released both
		d.mu.Unlock()
		return fmt.Errorf("%s: device %s closed: %w", what, d.name, syscall.ENODEV)
	}
	// m takes over n's registration; n is dropped.
	old := m.pin
	delete(m.pd.mrs, m)
	delete(newPD.mrs, n)
	newPD.mrs[m] = struct{}{}
	if n.idx != m.idx {
		delete(d.mrs, m.idx)
	}
	d.mrs[n.idx] = m
	m.pd, m.idx, m.key, m.addr, m.length, m.access, m.pin = newPD, n.idx, n.key, n.addr, n.length, n.access, n.pin
	n.state = mrDead
	d.mu.Unlock()
	unpin(old)
	return nil
}

// Dereg deregisters the region: EINVAL when it is already gone.
func (m *mr) Dereg() error {
	d := m.dev
	d.mem.Lock() // wait out responders copying to or from this memory
	defer d.mem.Unlock()
	d.mu.Lock()
	switch {
	case m.pd.ctx.closed:
		d.mu.Unlock()
		return fmt.Errorf("dereg_mr key 0x%x: device %s closed: %w", m.key, d.name, syscall.ENODEV)
	case m.state != mrLive:
		d.mu.Unlock()
		return fmt.Errorf("dereg_mr key 0x%x: region is not registered: %w", m.key, syscall.EINVAL)
	case m.busy:
		d.mu.Unlock()
		return fmt.Errorf("dereg_mr key 0x%x: a rereg is in progress: %w", m.key, syscall.EBUSY)
	}
	m.state = mrDead
	delete(d.mrs, m.idx)
	delete(m.pd.mrs, m)
	pn := m.pin
	d.mu.Unlock()
	unpin(pn)
	return nil
}
