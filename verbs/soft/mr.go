package soft

import (
	"fmt"
	"syscall"

	"mrfs/internal/bytesize"
	"mrfs/verbs"
)

type mrState int

const (
	mrPending mrState = iota // key reserved, pages being pinned
	mrLive
	mrDead
)

// mr is a memory region. What it registers never changes; only its state
// (and its pinning, set once the pages are locked) is guarded by dev.mu.
type mr struct {
	dev    *device      // immutable
	pd     *pd          // immutable
	key    uint32       // immutable; lkey == rkey, as rxe gives user MRs
	access verbs.Access // immutable
	addr   uintptr      // immutable
	length uint64       // immutable
	state  mrState      // live: its pages (pinned()) are locked
}

// pinned is the pages a live region holds locked.
func (m *mr) pinned() pinning { return pagesOf(m.addr, m.length) }

func (m *mr) LKey() uint32         { return m.key }
func (m *mr) RKey() uint32         { return m.key }
func (m *mr) Addr() uintptr        { return m.addr }
func (m *mr) IOVA() uint64         { return uint64(m.addr) } // RegMR registers with iova = addr
func (m *mr) Length() uint64       { return m.length }
func (m *mr) Access() verbs.Access { return m.access }
func (m *mr) PD() verbs.PD         { return m.pd }

// register is reg_mr after the PD lookup: the checks of
// ib_uverbs_reg_mr, rxe_reg_user_mr and ib_umem_get in that order, then
// the pin. The new region counts against p (usecnt) from the moment its
// key is reserved.
func (d *device) register(p *pd, addr uintptr, length uint64, access verbs.Access) (*mr, error) {
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
	if length > d.attr.MaxMRSize {
		d.mu.Unlock()
		return nil, fmt.Errorf("%s is past max_mr_size (%s) of %s: %w", bytesize.Format(length), bytesize.Format(d.attr.MaxMRSize), d.name, syscall.EINVAL)
	}
	if len(d.mrs) >= d.attr.MaxMR {
		d.mu.Unlock()
		return nil, fmt.Errorf("all %d memory regions of %s are in use (max_mr): %w", d.attr.MaxMR, d.name, syscall.EINVAL)
	}
	m := &mr{dev: d, pd: p, key: d.newKey(), addr: addr, length: length, access: access, state: mrPending}
	d.mrs[m.key] = m
	p.nmr++
	d.mu.Unlock()

	pn, err := pin(addr, length)

	d.mu.Lock()
	defer d.mu.Unlock()
	if err == nil && p.ctx.closed {
		unpin(pn)
		err = fmt.Errorf("device %s closed: %w", d.name, syscall.ENODEV)
	}
	if err != nil {
		delete(d.mrs, m.key)
		p.nmr--
		m.state = mrDead
		return nil, err
	}
	m.state = mrLive
	return m, nil
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
	}
	m.state = mrDead
	delete(d.mrs, m.key)
	m.pd.nmr--
	d.mu.Unlock()
	unpin(m.pinned())
	return nil
}
