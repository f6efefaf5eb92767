//go:build rdma

package ibv

import (
	"fmt"
	"sync"
	"syscall"

	"mrfs/verbs"
)

// mr is a memory region. Its keys, range, access and PD are copied from
// the ibv_mr at registration and never change, so the getters never
// touch C memory that Dereg or Close may have freed.
type mr struct {
	dev        *device // immutable
	c          cMR     // immutable
	pd         *pd     // immutable
	lkey, rkey uint32  // immutable
	addr       uintptr // immutable
	length     uint64  // immutable
	access     verbs.Access

	// guards: dead and busy. Never held across a libibverbs call: busy
	// marks a Dereg in flight (unpinning 1 GiB takes milliseconds).
	mu   sync.Mutex
	dead bool // deregistered: the ibv_mr is freed
	busy bool
}

func (m *mr) LKey() uint32         { return m.lkey }
func (m *mr) RKey() uint32         { return m.rkey }
func (m *mr) Addr() uintptr        { return m.addr }
func (m *mr) IOVA() uint64         { return uint64(m.addr) } // RegMR registers with iova = addr
func (m *mr) Length() uint64       { return m.length }
func (m *mr) Access() verbs.Access { return m.access }
func (m *mr) PD() verbs.PD         { return m.pd }

// Dereg deregisters the region: EINVAL when it is already gone, EBUSY
// while another Dereg of it runs (as the kernel's uobject lock answers),
// ENODEV after Device.Close (the kernel has released it then).
func (m *mr) Dereg() error {
	d := m.dev
	d.mu.RLock()
	defer d.mu.RUnlock()
	what := fmt.Sprintf("dereg_mr key 0x%x on %s", m.lkey, d.name)
	m.mu.Lock()
	switch {
	case d.closed:
		m.mu.Unlock()
		return fmt.Errorf("%s: device closed: %w", what, syscall.ENODEV)
	case m.dead:
		m.mu.Unlock()
		return fmt.Errorf("%s: region is not registered: %w", what, syscall.EINVAL)
	case m.busy:
		m.mu.Unlock()
		return fmt.Errorf("%s: another dereg is in progress: %w", what, syscall.EBUSY)
	}
	m.busy = true
	m.mu.Unlock()

	errno := m.c.dereg()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.busy = false
	if errno != 0 {
		// libibverbs keeps the ibv_mr when the kernel refuses.
		return fmt.Errorf("%s: %w", what, errno)
	}
	m.dead = true
	d.untrack(m)
	return nil
}
