package soft

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"
	"syscall"

	"mrfs/internal/bytesize"
	"mrfs/verbs"
)

// device is the state rxe keeps per ib_device: its regions by key and the
// PD numbering, shared by every context opened on it.
type device struct {
	name string           // immutable
	attr verbs.DeviceAttr // immutable

	// guards: the memory of every live region. A responder holds it for
	// reading across its checks and its copy; Dereg and
	// Close hold it for writing while they take a region away, so once
	// they return no responder touches that memory and the caller may
	// unmap it. Taken before mu.
	mem sync.RWMutex

	// guards: every field below, every context's closed and pds, every
	// pd's dead and mrs, and every mr's mutable fields. Taken before
	// pins.mu.
	mu     sync.Mutex
	mrs    map[uint32]*mr // by key: live regions and ones being registered
	pds    map[uint32]*pd // allocated PDs by handle
	lastPD uint32
}

func newDevice(opt Options) *device {
	maxMRSize := opt.MaxMRSize
	if maxMRSize == 0 {
		maxMRSize = ^uint64(0)
	}
	return &device{
		name: opt.DeviceName,
		attr: verbs.DeviceAttr{
			MaxMR:       opt.MaxMR,
			MaxMRSize:   maxMRSize,
			PageSizeCap: 0xFFFFF000,
			MaxPD:       opt.MaxPD,
			Access:      deviceAccess,
		},
		mrs: map[uint32]*mr{},
		pds: map[uint32]*pd{},
	}
}

// newKey is a fresh key for a region: 32 random bits, nonzero and held
// by no live or registering region. Unlike rxe's index<<8 | random byte,
// a key says nothing about its neighbours: a peer that knows its own keys
// still guesses another's one time in 2^32. Called with d.mu held and
// fewer than MaxMR (at most 2^24-1) regions, so a try collides at most one
// time in 256.
func (d *device) newKey() uint32 {
	var b [4]byte
	for {
		randRead(b[:])
		k := binary.LittleEndian.Uint32(b[:])
		if _, used := d.mrs[k]; k != 0 && !used {
			return k
		}
	}
}

// randRead fills keys with random bytes; crypto/rand's Read never fails.
// Tests replace it to force collisions.
var randRead = func(b []byte) { rand.Read(b) }

// context is an open device (ibv_context).
type context struct {
	dev *device // immutable
	// guarded by dev.mu
	closed bool
	pds    map[*pd]struct{}
}

func (c *context) Name() string           { return c.dev.name }
func (c *context) Attr() verbs.DeviceAttr { return c.dev.attr }

// AllocPD numbers PDs from 1 per device; a full pool (max_pd) is EINVAL,
// as rxe's pool answers.
func (c *context) AllocPD() (verbs.PD, error) {
	d := c.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed {
		return nil, fmt.Errorf("alloc_pd on %s: device closed: %w", d.name, syscall.ENODEV)
	}
	if len(d.pds) >= d.attr.MaxPD {
		return nil, fmt.Errorf("alloc_pd on %s: all %d protection domains in use (max_pd): %w", d.name, d.attr.MaxPD, syscall.EINVAL)
	}
	for {
		d.lastPD++
		if d.lastPD == 0 {
			d.lastPD = 1
		}
		if _, used := d.pds[d.lastPD]; !used {
			break
		}
	}
	p := &pd{ctx: c, handle: d.lastPD}
	d.pds[p.handle] = p
	c.pds[p] = struct{}{}
	return p, nil
}

// Close closes the context even while it holds PDs and regions: like
// ibv_close_device it frees no child objects, which stay as Go values
// whose every call then fails with ENODEV. What the kernel releases when
// the device file is closed is released here too: the regions' keys
// and pinned pages, and the PDs' numbers. Close twice is ENODEV.
func (c *context) Close() error {
	d := c.dev
	d.mem.Lock()
	defer d.mem.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if c.closed {
		return fmt.Errorf("close %s: already closed: %w", d.name, syscall.ENODEV)
	}
	c.closed = true
	for k, m := range d.mrs {
		if m.pd.ctx == c && m.state == mrLive {
			// A region still registering finishes its own cleanup when
			// it sees the context closed.
			m.state = mrDead
			delete(d.mrs, k)
			m.pd.nmr--
			unpin(m.pinned())
		}
	}
	for p := range c.pds {
		p.dead = true
		delete(d.pds, p.handle)
	}
	c.pds = nil
	return nil
}

// pd is a protection domain.
type pd struct {
	ctx    *context // immutable
	handle uint32   // immutable
	// guarded by ctx.dev.mu
	dead bool
	nmr  int // regions that count against the PD (usecnt)
}

func (p *pd) Handle() uint32 { return p.handle }

// Dealloc frees the PD: EBUSY while it holds regions (the kernel's
// usecnt check), EINVAL once it is gone.
func (p *pd) Dealloc() error {
	d := p.ctx.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case p.ctx.closed:
		return fmt.Errorf("dealloc_pd %d: device closed: %w", p.handle, syscall.ENODEV)
	case p.dead:
		return fmt.Errorf("dealloc_pd %d: already deallocated: %w", p.handle, syscall.EINVAL)
	case p.nmr > 0:
		return fmt.Errorf("dealloc_pd %d: it still holds %d memory regions: %w", p.handle, p.nmr, syscall.EBUSY)
	}
	p.dead = true
	delete(d.pds, p.handle)
	delete(p.ctx.pds, p)
	return nil
}

func (p *pd) RegMR(addr uintptr, length uint64, access verbs.Access) (verbs.MR, error) {
	m, err := p.ctx.dev.register(p, addr, length, access)
	if err != nil {
		return nil, fmt.Errorf("reg_mr %s in pd %d: %w", bytesize.Format(length), p.handle, err)
	}
	return m, nil
}
