// Package multi registers memory on several devices at once, behind the
// one-device verbs interfaces: a PD of it is a PD on each device, and a
// region of it is the same pages registered in each of those PDs, so that
// everything above (buffers, pools, the namespace) works unchanged on
// several NICs. The first device present is the primary: Name, LKey and
// RKey are its own, as user.mrfs.lkey and rkey show them; Keys gives every
// device's.
//
// Every step acts on all devices in their order and undoes itself on all
// when one device refuses: a PD or region exists on every device or on
// none. A refusal names the device (verbs.DeviceError).
//
// Devices come and go (Detach, Attach): a device that leaves takes its
// parts of every PD and region with it and the others keep theirs; one
// that joins gets a part of every PD and region, in its configured place
// among the others, or none at all.
//
// Locking: device.mu is held shared by every call on the device, its PDs
// and its regions, and exclusively while a device leaves or joins, so
// that parts only change when nothing else runs. device.liveMu (taken
// under mu) guards the sets of live PDs and regions. A region's Dereg is
// serialized by its caller, as for any verbs.MR.
package multi

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"

	"mrfs/verbs"
)

// Open opens each named device of p, in order, as one device (with one
// name, that device itself). On a failure it closes what it opened.
func Open(p verbs.Provider, names []string) (verbs.Device, error) {
	devs, err := open(p, names)
	if err != nil {
		return nil, err
	}
	return Join(devs), nil
}

// OpenJoined is Open that joins even one device, so that devices can
// join it later (verbs.devices = "all").
func OpenJoined(p verbs.Provider, names []string) (*Device, error) {
	devs, err := open(p, names)
	if err != nil {
		return nil, err
	}
	return join(devs), nil
}

func open(p verbs.Provider, names []string) ([]verbs.Device, error) {
	if len(names) == 0 {
		return nil, fmt.Errorf("open devices: none named: %w", syscall.EINVAL)
	}
	var devs []verbs.Device
	for _, n := range names {
		dev, err := p.Open(n)
		if err != nil {
			for _, d := range devs {
				d.Close()
			}
			return nil, fmt.Errorf("open device %s: %w", n, err)
		}
		devs = append(devs, dev)
	}
	return devs, nil
}

// Join makes open devices one device, devs[0] the primary; it owns them
// (Close closes each). One device is returned as it is.
func Join(devs []verbs.Device) verbs.Device {
	if len(devs) == 1 {
		return devs[0]
	}
	return join(devs)
}

func join(devs []verbs.Device) *Device {
	d := &Device{devs: devs, order: map[string]int{}, pds: map[*pd]struct{}{}}
	for i, dev := range devs {
		d.order[dev.Name()] = i
	}
	return d
}

// Device is several devices as one.
type Device struct {
	// guards: devs, order, and the parts of every PD and region. Shared
	// by every call; exclusive in Detach, Attach and Close.
	mu    sync.RWMutex
	devs  []verbs.Device // present, in order; devs[0] is the primary
	order map[string]int // each name's place: the configured ones first, then in joining order

	// guards: pds, and each pd's mrs. Taken under mu.
	liveMu sync.Mutex
	pds    map[*pd]struct{} // allocated and not yet deallocated on every device
}

var (
	_ verbs.Device      = (*Device)(nil)
	_ verbs.ResponderPD = (*pd)(nil)
	_ verbs.MultiMR     = (*mr)(nil)
	_ verbs.MultiPD     = (*pd)(nil)
)

// Name is the primary device's name.
func (d *Device) Name() string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.devs[0].Name()
}

// Parts is the devices present, the primary first.
func (d *Device) Parts() []verbs.Device {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return slices.Clone(d.devs)
}

// Names is the names of the devices present, in order.
func (d *Device) Names() []string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	out := make([]string, len(d.devs))
	for i, dev := range d.devs {
		out[i] = dev.Name()
	}
	return out
}

// Attr is what every device allows: the smallest of each limit and the
// access flags all of them accept.
func (d *Device) Attr() verbs.DeviceAttr {
	d.mu.RLock()
	defer d.mu.RUnlock()
	a := d.devs[0].Attr()
	for _, dev := range d.devs[1:] {
		b := dev.Attr()
		a.MaxMR = min(a.MaxMR, b.MaxMR)
		a.MaxMRSize = min(a.MaxMRSize, b.MaxMRSize)
		a.MaxPD = min(a.MaxPD, b.MaxPD)
		a.PageSizeCap &= b.PageSizeCap
		a.Access &= b.Access
	}
	return a
}

// Limiting is the name of the device whose limit (of those Attr takes
// the smallest of) is the smallest, the first of equals: the device a
// refusal at that limit is about.
func (d *Device) Limiting(limit func(verbs.DeviceAttr) int) string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	best := d.devs[0]
	for _, dev := range d.devs[1:] {
		if limit(dev.Attr()) < limit(best.Attr()) {
			best = dev
		}
	}
	return best.Name()
}

// AllocPD allocates a PD on each device.
func (d *Device) AllocPD() (verbs.PD, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	p := &pd{dev: d, mrs: map[*mr]struct{}{}}
	for _, dev := range d.devs {
		part, err := dev.AllocPD()
		if err != nil {
			if uerr := p.deallocLocked(); uerr != nil && len(p.parts) > 0 {
				err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
			}
			return nil, &verbs.DeviceError{Device: dev.Name(), Err: err}
		}
		p.parts = append(p.parts, pdPart{dev, part})
	}
	p.handle = p.parts[0].pd.Handle()
	d.liveMu.Lock()
	d.pds[p] = struct{}{}
	d.liveMu.Unlock()
	return p, nil
}

// Close closes every device; errors are joined.
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
	for _, dev := range d.devs {
		if err := dev.Close(); err != nil {
			errs = append(errs, &verbs.DeviceError{Device: dev.Name(), Err: err})
		}
	}
	return errors.Join(errs...)
}

// Detach takes the named device out: every PD and region loses its part
// there and keeps the others', and the device is closed, which frees
// what was registered on it (call it once the device is gone, after the
// queue pairs in its PDs are destroyed). The last device cannot leave
// (EBUSY): nothing would be left to hold the regions' keys.
func (d *Device) Detach(name string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	i := slices.IndexFunc(d.devs, func(dev verbs.Device) bool { return dev.Name() == name })
	if i < 0 {
		return fmt.Errorf("detach device %s: not joined: %w", name, syscall.ENODEV)
	}
	if len(d.devs) == 1 {
		return fmt.Errorf("detach device %s: it is the last device: %w", name, syscall.EBUSY)
	}
	gone := d.devs[i]
	d.liveMu.Lock()
	for p := range d.pds {
		p.parts = slices.DeleteFunc(p.parts, func(pp pdPart) bool { return pp.dev == gone })
		for m := range p.mrs {
			m.parts = slices.DeleteFunc(m.parts, func(mp mrPart) bool { return mp.dev == gone })
			if len(m.parts) > 0 {
				m.primary = m.parts[0].mr
			}
		}
	}
	d.liveMu.Unlock()
	d.devs = slices.Delete(d.devs, i, i+1)
	if err := gone.Close(); err != nil {
		return &verbs.DeviceError{Device: name, Err: fmt.Errorf("close: %w", err)}
	}
	return nil
}

// Attach joins an open device: a part of every PD and region is made on
// it, and it takes its place among the others (its configured one; a
// device never seen before comes last). If any of that fails, nothing of
// it stays, the device is closed, and the error names it. Attach owns
// dev either way.
func (d *Device) Attach(dev verbs.Device) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	name := dev.Name()
	if slices.ContainsFunc(d.devs, func(x verbs.Device) bool { return x.Name() == name }) {
		dev.Close()
		return fmt.Errorf("attach device %s: already joined: %w", name, syscall.EEXIST)
	}
	if _, ok := d.order[name]; !ok {
		d.order[name] = len(d.order)
	}
	fail := func(err error) error {
		if cerr := dev.Close(); cerr != nil { // frees whatever was made on it
			err = errors.Join(err, fmt.Errorf("close: %w", cerr))
		}
		return &verbs.DeviceError{Device: name, Err: err}
	}
	type made struct {
		p   *pd
		pd  verbs.PD
		mrs map[*mr]verbs.MR
	}
	var all []made
	d.liveMu.Lock()
	defer d.liveMu.Unlock()
	for p := range d.pds {
		part, err := dev.AllocPD()
		if err != nil {
			return fail(fmt.Errorf("pd %d: %w", p.handle, err))
		}
		mk := made{p, part, map[*mr]verbs.MR{}}
		for m := range p.mrs {
			r, err := part.RegMR(m.addr, m.length, m.access)
			if err != nil {
				return fail(fmt.Errorf("region of %d bytes at 0x%x in pd %d: %w", m.length, m.addr, p.handle, err))
			}
			mk.mrs[m] = r
		}
		all = append(all, mk)
	}
	at := d.place(name, d.devs)
	d.devs = slices.Insert(d.devs, at, dev)
	for _, mk := range all {
		mk.p.parts = slices.Insert(mk.p.parts, d.place(name, pdDevs(mk.p.parts)), pdPart{dev, mk.pd})
		for m, r := range mk.mrs {
			m.parts = slices.Insert(m.parts, d.place(name, mrDevs(m.parts)), mrPart{dev, r})
			m.primary = m.parts[0].mr
		}
	}
	return nil
}

// place is where the named device goes among devs, by order.
func (d *Device) place(name string, devs []verbs.Device) int {
	at := 0
	for at < len(devs) && d.order[devs[at].Name()] < d.order[name] {
		at++
	}
	return at
}

func pdDevs(ps []pdPart) []verbs.Device {
	out := make([]verbs.Device, len(ps))
	for i, p := range ps {
		out[i] = p.dev
	}
	return out
}

func mrDevs(ps []mrPart) []verbs.Device {
	out := make([]verbs.Device, len(ps))
	for i, p := range ps {
		out[i] = p.dev
	}
	return out
}

type pdPart struct {
	dev verbs.Device
	pd  verbs.PD
}

type pd struct {
	dev    *Device
	handle uint32   // the first device's PD number when allocated: it names the PD for good
	parts  []pdPart // one per device present, in order, until deallocated
	mrs    map[*mr]struct{}
}

// Handle is the PD's number: the first device's when it was allocated.
func (p *pd) Handle() uint32 { return p.handle }

// RegMR registers the range on every device, with the same access.
func (p *pd) RegMR(addr uintptr, length uint64, access verbs.Access) (verbs.MR, error) {
	p.dev.mu.RLock()
	defer p.dev.mu.RUnlock()
	if len(p.parts) == 0 {
		return nil, fmt.Errorf("reg_mr in pd %d: deallocated: %w", p.handle, syscall.EINVAL)
	}
	m := &mr{pd: p, addr: addr, length: length, access: access}
	for _, part := range p.parts {
		r, err := part.pd.RegMR(addr, length, access)
		if err != nil {
			if len(m.parts) > 0 {
				if uerr := m.deregLocked(); uerr != nil {
					err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
				}
			}
			return nil, &verbs.DeviceError{Device: part.dev.Name(), Err: err}
		}
		m.parts = append(m.parts, mrPart{part.dev, r})
	}
	m.primary = m.parts[0].mr
	p.dev.liveMu.Lock()
	p.mrs[m] = struct{}{}
	p.dev.liveMu.Unlock()
	return m, nil
}

// Dealloc deallocates the PD on every device, the last first. It stops
// at a refusal: the devices before it keep their part for a later call.
func (p *pd) Dealloc() error {
	p.dev.mu.RLock()
	defer p.dev.mu.RUnlock()
	if len(p.parts) == 0 {
		return fmt.Errorf("dealloc_pd %d: already deallocated: %w", p.handle, syscall.EINVAL)
	}
	return p.deallocLocked()
}

// deallocLocked is Dealloc with mu held.
func (p *pd) deallocLocked() error {
	for i := len(p.parts) - 1; i >= 0; i-- {
		if err := p.parts[i].pd.Dealloc(); err != nil {
			return &verbs.DeviceError{Device: p.parts[i].dev.Name(), Err: err}
		}
		p.parts = p.parts[:i]
	}
	p.dev.liveMu.Lock()
	delete(p.dev.pds, p)
	p.dev.liveMu.Unlock()
	return nil
}

// On is the PD's part on the named device; nil when the PD has none
// there (no such device, or deallocated).
func (p *pd) On(device string) verbs.PD {
	p.dev.mu.RLock()
	defer p.dev.mu.RUnlock()
	for _, part := range p.parts {
		if part.dev.Name() == device {
			return part.pd
		}
	}
	return nil
}

// Responder serves the soft transport with the primary device's
// regions, when its backend serves one.
func (p *pd) Responder() verbs.Responder {
	p.dev.mu.RLock()
	defer p.dev.mu.RUnlock()
	if len(p.parts) == 0 {
		return nil
	}
	if rp, ok := p.parts[0].pd.(verbs.ResponderPD); ok {
		return rp.Responder()
	}
	return nil
}

type mrPart struct {
	dev verbs.Device
	mr  verbs.MR
}

type mr struct {
	pd      *pd
	addr    uintptr // what was registered, for a device that joins
	length  uint64
	access  verbs.Access
	primary verbs.MR // parts[0]'s, kept for its keys once deregistered
	parts   []mrPart // registered and not deregistered, in order
}

func (m *mr) first() verbs.MR {
	m.pd.dev.mu.RLock()
	defer m.pd.dev.mu.RUnlock()
	return m.primary
}

func (m *mr) LKey() uint32         { return m.first().LKey() }
func (m *mr) RKey() uint32         { return m.first().RKey() }
func (m *mr) Addr() uintptr        { return m.addr }
func (m *mr) IOVA() uint64         { return m.first().IOVA() }
func (m *mr) Length() uint64       { return m.length }
func (m *mr) Access() verbs.Access { return m.access }
func (m *mr) PD() verbs.PD         { return m.pd }

// Keys is every device's keys.
func (m *mr) Keys() []verbs.DeviceKeys {
	m.pd.dev.mu.RLock()
	defer m.pd.dev.mu.RUnlock()
	out := make([]verbs.DeviceKeys, len(m.parts))
	for i, p := range m.parts {
		out[i] = verbs.DeviceKeys{Device: p.dev.Name(), LKey: p.mr.LKey(), RKey: p.mr.RKey()}
	}
	return out
}

// Dereg deregisters the region on every device, the last first, so
// that the primary's keys stay while any part does. It stops at a
// refusal: the devices before it keep their part, for a later Dereg.
func (m *mr) Dereg() error {
	m.pd.dev.mu.RLock()
	defer m.pd.dev.mu.RUnlock()
	if len(m.parts) == 0 {
		return fmt.Errorf("dereg_mr key 0x%x: region is not registered: %w", m.primary.LKey(), syscall.EINVAL)
	}
	return m.deregLocked()
}

// deregLocked is Dereg with mu held.
func (m *mr) deregLocked() error {
	for i := len(m.parts) - 1; i >= 0; i-- {
		if err := m.parts[i].mr.Dereg(); err != nil {
			return &verbs.DeviceError{Device: m.parts[i].dev.Name(), Err: err}
		}
		m.parts = m.parts[:i]
	}
	m.pd.dev.liveMu.Lock()
	delete(m.pd.mrs, m)
	m.pd.dev.liveMu.Unlock()
	return nil
}
