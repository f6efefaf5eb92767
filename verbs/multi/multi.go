// Package multi registers memory on several devices at once, behind the
// one-device verbs interfaces: a PD of it is a PD on each device, and a
// region of it is the same pages registered in each of those PDs, so that
// everything above (buffers, pools, the namespace) works unchanged on
// several NICs. The first device is the primary: Name, Handle, LKey and
// RKey are its own, as user.mrfs.lkey and rkey show them; Keys gives every
// device's.
//
// Every step acts on all devices in their order and undoes itself on all
// when one device refuses: a PD or region exists on every device or on
// none. A refusal names the device (verbs.DeviceError).
//
// Locking: none of its own. Each object's parts are set when it is made;
// a region's Dereg is serialized by its caller, as for any verbs.MR.
package multi

import (
	"errors"
	"fmt"
	"syscall"

	"mrfs/verbs"
)

// Open opens each named device of p, in order, as one device (with one
// name, that device itself). On a failure it closes what it opened.
func Open(p verbs.Provider, names []string) (verbs.Device, error) {
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
	return Join(devs), nil
}

// Join makes open devices one device, devs[0] the primary; it owns them
// (Close closes each). One device is returned as it is.
func Join(devs []verbs.Device) verbs.Device {
	if len(devs) == 1 {
		return devs[0]
	}
	return &device{devs: devs}
}

type device struct {
	devs []verbs.Device // immutable; devs[0] is the primary
}

var (
	_ verbs.Device      = (*device)(nil)
	_ verbs.ResponderPD = (*pd)(nil)
	_ verbs.MultiMR     = (*mr)(nil)
	_ verbs.MultiPD     = (*pd)(nil)
)

// Name is the primary device's name.
func (d *device) Name() string { return d.devs[0].Name() }

// Parts is the devices, the primary first.
func (d *device) Parts() []verbs.Device { return d.devs }

// Attr is what every device allows: the smallest of each limit and the
// access flags all of them accept.
func (d *device) Attr() verbs.DeviceAttr {
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

// AllocPD allocates a PD on each device.
func (d *device) AllocPD() (verbs.PD, error) {
	p := &pd{dev: d}
	for _, dev := range d.devs {
		part, err := dev.AllocPD()
		if err != nil {
			if len(p.parts) == 0 {
				return nil, &verbs.DeviceError{Device: dev.Name(), Err: err}
			}
			if uerr := p.Dealloc(); uerr != nil {
				err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
			}
			return nil, &verbs.DeviceError{Device: dev.Name(), Err: err}
		}
		p.parts = append(p.parts, part)
	}
	p.primary = p.parts[0]
	return p, nil
}

// Close closes every device; errors are joined.
func (d *device) Close() error {
	var errs []error
	for _, dev := range d.devs {
		if err := dev.Close(); err != nil {
			errs = append(errs, &verbs.DeviceError{Device: dev.Name(), Err: err})
		}
	}
	return errors.Join(errs...)
}

type pd struct {
	dev     *device
	primary verbs.PD   // parts[0], kept once deallocated
	parts   []verbs.PD // one per device, in the device's order, until deallocated
}

// Handle is the primary device's PD number.
func (p *pd) Handle() uint32 { return p.primary.Handle() }

// RegMR registers the range on every device, with the same access.
func (p *pd) RegMR(addr uintptr, length uint64, access verbs.Access) (verbs.MR, error) {
	m := &mr{pd: p}
	for i, part := range p.parts {
		r, err := part.RegMR(addr, length, access)
		if err != nil {
			if len(m.parts) > 0 {
				if uerr := m.Dereg(); uerr != nil {
					err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
				}
			}
			return nil, &verbs.DeviceError{Device: p.dev.devs[i].Name(), Err: err}
		}
		if i == 0 {
			m.primary = r
		}
		m.parts = append(m.parts, r)
		m.names = append(m.names, p.dev.devs[i].Name())
	}
	return m, nil
}

// Dealloc deallocates the PD on every device, the last first. It stops
// at a refusal: the devices before it keep their part (the primary's
// handle stays) for a later call.
func (p *pd) Dealloc() error {
	if len(p.parts) == 0 {
		return fmt.Errorf("dealloc_pd %d: already deallocated: %w", p.Handle(), syscall.EINVAL)
	}
	for i := len(p.parts) - 1; i >= 0; i-- {
		if err := p.parts[i].Dealloc(); err != nil {
			return &verbs.DeviceError{Device: p.dev.devs[i].Name(), Err: err}
		}
		p.parts = p.parts[:i]
	}
	return nil
}

// On is the PD's part on the named device; nil when the PD has none
// there (no such device, or deallocated).
func (p *pd) On(device string) verbs.PD {
	for i, part := range p.parts {
		if p.dev.devs[i].Name() == device {
			return part
		}
	}
	return nil
}

// Responder serves the soft transport with the primary device's
// regions, when its backend serves one.
func (p *pd) Responder() verbs.Responder {
	if rp, ok := p.primary.(verbs.ResponderPD); ok {
		return rp.Responder()
	}
	return nil
}

type mr struct {
	pd      *pd
	primary verbs.MR   // parts[0], kept for its keys once deregistered
	parts   []verbs.MR // registered and not deregistered, in the device's order
	names   []string   // parts' devices
}

func (m *mr) LKey() uint32         { return m.primary.LKey() }
func (m *mr) RKey() uint32         { return m.primary.RKey() }
func (m *mr) Addr() uintptr        { return m.primary.Addr() }
func (m *mr) IOVA() uint64         { return m.primary.IOVA() }
func (m *mr) Length() uint64       { return m.primary.Length() }
func (m *mr) Access() verbs.Access { return m.primary.Access() }
func (m *mr) PD() verbs.PD         { return m.pd }

// Keys is every device's keys.
func (m *mr) Keys() []verbs.DeviceKeys {
	out := make([]verbs.DeviceKeys, len(m.parts))
	for i, r := range m.parts {
		out[i] = verbs.DeviceKeys{Device: m.names[i], LKey: r.LKey(), RKey: r.RKey()}
	}
	return out
}

// Dereg deregisters the region on every device, the last first, so
// that the primary's keys stay while any part does. It stops at a
// refusal: the devices before it keep their part, for a later Dereg.
func (m *mr) Dereg() error {
	if len(m.parts) == 0 {
		return fmt.Errorf("dereg_mr key 0x%x: region is not registered: %w", m.LKey(), syscall.EINVAL)
	}
	for i := len(m.parts) - 1; i >= 0; i-- {
		if err := m.parts[i].Dereg(); err != nil {
			return &verbs.DeviceError{Device: m.names[i], Err: err}
		}
		m.parts, m.names = m.parts[:i], m.names[:i]
	}
	return nil
}
