//go:build rdma

// Package ibv is mrfs's libibverbs backend (provider "rdma"), built only
// with the build tag rdma because it links libibverbs through cgo. It
// drives real NICs and Soft-RoCE (rxe).
//
// cgo.go is the only file that imports "C": one thin wrapper per
// libibverbs call. Everything else is here, in Go: what a device
// promises (DeviceAttr), and guards against what would be a
// use-after-free in C. libibverbs frees an ibv_pd or ibv_mr when it is
// deallocated or deregistered, and the whole context on
// ibv_close_device, so this package answers a second Dereg or Dealloc,
// a RegMR in a deallocated PD (EINVAL) and any call after Device.Close
// (ENODEV) itself, with the errnos of verbs/soft, and never passes a
// freed pointer to C.
//
// Locking: each device has an RWMutex held shared by every call into
// libibverbs on that context or its children and exclusively by Close;
// each PD has an RWMutex held shared by registrations into it and
// exclusively by Dealloc; each MR has a mutex for its Go-side state that
// is never held across a libibverbs call. Lock order: device.mu, pd.mu,
// mr.mu. libibverbs itself is thread-safe, so registrations on one
// device run in parallel.
package ibv

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"syscall"

	"mrfs/internal/bytesize"
	"mrfs/verbs"
)

// New returns the libibverbs provider. It fails when libibverbs cannot
// list devices at all, for instance ENOSYS from a kernel without RDMA
// support (no ib_uverbs); a kernel with RDMA but no device gives a
// provider with no devices.
func New() (verbs.Provider, error) {
	_, free, err := getDevices()
	if err != nil {
		if err == syscall.ENOSYS {
			return nil, fmt.Errorf("libibverbs cannot list RDMA devices: the kernel has no RDMA support (load ib_uverbs and a driver, e.g. rdma_rxe): %w", err)
		}
		return nil, fmt.Errorf("libibverbs cannot list RDMA devices: %w", err)
	}
	free()
	return provider{}, nil
}

type provider struct{}

func (provider) Name() string { return "rdma" }

// Devices opens each device once to query its attributes.
func (provider) Devices() ([]verbs.DeviceInfo, error) {
	devs, free, err := getDevices()
	if err != nil {
		return nil, fmt.Errorf("ibv_get_device_list: %w", err)
	}
	defer free()
	infos := make([]verbs.DeviceInfo, 0, len(devs))
	for _, d := range devs {
		name := d.name()
		ctx, err := d.open()
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", name, err)
		}
		raw, err := ctx.query()
		ctx.close()
		if err != nil {
			return nil, fmt.Errorf("query_device %s: %w", name, err)
		}
		infos = append(infos, verbs.DeviceInfo{Name: name, Attr: deviceAttr(name, raw)})
	}
	return infos, nil
}

// Names lists the devices present (ibv_get_device_list, which rescans
// each time), opening none.
//
// It also lets librdmacm sync its own list (rdma_get_devices): it then
// closes its context of a device that went away and that nothing holds,
// which the device's removal waits for. Open, through rdma_get_devices,
// has librdmacm open a context of every device, used or not.
func (provider) Names() ([]string, error) {
	devs, free, err := getDevices()
	if err != nil {
		return nil, fmt.Errorf("ibv_get_device_list: %w", err)
	}
	defer free()
	names := make([]string, len(devs))
	for i, d := range devs {
		names[i] = d.name()
	}
	if _, release, err := getCMContexts(); err == nil {
		release()
	}
	return names, nil
}

// Open opens a device by name; "" opens the first one.
func (provider) Open(name string) (verbs.Device, error) {
	devs, free, err := getDevices()
	if err != nil {
		return nil, fmt.Errorf("ibv_get_device_list: %w", err)
	}
	defer free() // after open: an open device outlives the list
	var (
		found cDevice
		ok    bool
		names []string
	)
	for _, d := range devs {
		n := d.name()
		names = append(names, n)
		if !ok && (name == "" || n == name) {
			found, ok, name = d, true, n
		}
	}
	if !ok {
		if len(names) == 0 {
			return nil, fmt.Errorf("open RDMA device: libibverbs lists no devices: %w", syscall.ENODEV)
		}
		return nil, fmt.Errorf("open RDMA device %q: no such device (have %s): %w", name, strings.Join(names, ", "), syscall.ENODEV)
	}
	// librdmacm's context for the device, when it has one: a queue pair
	// that rdma_cm connects must live in a PD of the very context of its
	// cm id, so mrfs's PDs are allocated there. Without the rdma_cm
	// device (no rdma_ucm module) the device is opened on its own
	// context and connections are refused (Listen, Dial: EXDEV).
	d := &device{name: name}
	if ctx, release, ok := getCMContext(name); ok {
		d.ctx, d.release = ctx, release
	} else {
		ctx, err := found.open()
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", name, err)
		}
		d.ctx = ctx
	}
	raw, err := d.ctx.query()
	if err != nil {
		d.closeContext()
		return nil, fmt.Errorf("query_device %s: %w", name, err)
	}
	d.attr = deviceAttr(name, raw)
	return d, nil
}

// OpenID is the device of a connection id whose route is resolved, on
// the id's own context (librdmacm's, which the id holds: close the
// device before destroying the id). Unlike Open it makes librdmacm open
// no other device: a process that holds contexts of devices it does not
// use keeps their removal (rdma link delete) waiting.
func OpenID(id CMID) (verbs.Device, error) {
	ctx := id.c.context()
	if ctx.p == nil {
		return nil, fmt.Errorf("open the device of an rdma_cm id: no route resolved: %w", syscall.ENODEV)
	}
	d := &device{name: ctx.deviceName(), ctx: ctx, release: func() {}}
	raw, err := ctx.query()
	if err != nil {
		return nil, fmt.Errorf("query_device %s: %w", d.name, err)
	}
	d.attr = deviceAttr(d.name, raw)
	return d, nil
}

// closeContext closes a context of its own, or gives librdmacm's back.
func (d *device) closeContext() error {
	if d.release != nil {
		d.release()
		return nil
	}
	return d.ctx.close()
}

// rxeVendorID is what rxe reports as vendor_id (rxe_param.h,
// RXE_VENDOR_ID); older kernels reported 0, hence also the name check.
const rxeVendorID = 0xFFFFFF

// isRxe reports whether a device is Soft-RoCE: rxe devices are named
// rxe* by convention (`rdma link add rxe0 type rxe`), and a custom name
// still carries rxe's vendor id.
func isRxe(name string, raw rawAttr) bool {
	return strings.HasPrefix(name, "rxe") || raw.vendorID == rxeVendorID
}

// deviceAttr turns what the device reports into what mrfs promises.
// Access lists the flags registrations may use: every device takes the
// local/remote ones and relaxed_ordering (an optional flag, ignored where
// unsupported); mw_bind needs memory windows, on_demand needs ODP, and
// zero_based is left out on rxe, which refuses it (newer kernels) or
// accepts it without meaning it (6.1).
func deviceAttr(name string, raw rawAttr) verbs.DeviceAttr {
	rxe := isRxe(name, raw)
	a := verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic | verbs.RelaxedOrdering
	if raw.capFlags&capMemWindow != 0 {
		a |= verbs.MWBind
	}
	if raw.odp {
		a |= verbs.OnDemand
	}
	if !rxe {
		a |= verbs.ZeroBased
	}
	return verbs.DeviceAttr{
		MaxMR:       raw.maxMR,
		MaxMRSize:   raw.maxMRSize,
		PageSizeCap: raw.pageSizeCap,
		MaxPD:       raw.maxPD,
		Access:      a,
	}
}

// device is an open device (ibv_context).
type device struct {
	name string           // immutable
	attr verbs.DeviceAttr // immutable

	// guards: closed, and the context's lifetime. Every call into
	// libibverbs on ctx or on a PD or MR of it holds mu shared for the
	// whole call; Close holds it exclusively, so ibv_close_device never
	// frees the context under a call in flight and no call starts after.
	// Taken before pd.mu and mr.mu.
	mu     sync.RWMutex
	ctx    cContext
	closed bool
	// release gives back librdmacm's reference to ctx when ctx is
	// librdmacm's (rdma_get_devices); nil when ctx is this device's own.
	// librdmacm keeps the contexts of the devices present open, so Close
	// cannot count on the kernel to free what is left in them: it frees
	// the live PDs and regions itself, from live. (The context of a
	// device that went away closes once nothing holds it: then the
	// device's removal, which waits for it, completes.)
	release func()

	// guards: live. Taken with mu held (shared by the calls that add
	// and remove, exclusively by Close).
	liveMu sync.Mutex
	live   map[any]struct{} // *pd and *mr not yet freed
}

// track and untrack keep the set of live PDs and regions.
func (d *device) track(o any) {
	d.liveMu.Lock()
	if d.live == nil {
		d.live = make(map[any]struct{})
	}
	d.live[o] = struct{}{}
	d.liveMu.Unlock()
}

func (d *device) untrack(o any) {
	d.liveMu.Lock()
	delete(d.live, o)
	d.liveMu.Unlock()
}

func (d *device) Name() string           { return d.name }
func (d *device) Attr() verbs.DeviceAttr { return d.attr }

func (d *device) AllocPD() (verbs.PD, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return nil, fmt.Errorf("alloc_pd on %s: device closed: %w", d.name, syscall.ENODEV)
	}
	c, err := d.ctx.allocPD()
	if err != nil {
		return nil, fmt.Errorf("alloc_pd on %s: %w", d.name, err)
	}
	p := &pd{dev: d, c: c, handle: c.handle()}
	d.track(p)
	return p, nil
}

// Close closes the context. On a context of its own, like
// ibv_close_device, it frees no child objects: the kernel releases the
// PDs and regions (and unpins their pages) when the device file closes,
// the C structs libibverbs allocated for them are never freed. On
// librdmacm's context, which stays open, it deregisters the regions and
// deallocates the PDs left, so that the same holds: nothing stays
// pinned. Either way the Go values answer ENODEV from then on. Close
// twice is ENODEV, as in verbs/soft.
func (d *device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("close %s: already closed: %w", d.name, syscall.ENODEV)
	}
	// Closed even if ibv_close_device fails: the context is in an unknown
	// state and must not be used again.
	d.closed = true
	var errs []error
	if d.release != nil {
		errs = d.freeLiveLocked()
	}
	if err := d.closeContext(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close %s: %w", d.name, err)
	}
	return nil
}

// freeLiveLocked deregisters the live regions, then deallocates the
// live PDs. d.mu is held exclusively: no call is in flight.
func (d *device) freeLiveLocked() []error {
	d.liveMu.Lock()
	defer d.liveMu.Unlock()
	var errs []error
	for o := range d.live {
		if m, ok := o.(*mr); ok {
			m.mu.Lock()
			if !m.dead {
				if errno := m.c.dereg(); errno != 0 {
					errs = append(errs, fmt.Errorf("dereg_mr key 0x%x: %w", m.lkey, errno))
				}
				m.dead = true
			}
			m.mu.Unlock()
			delete(d.live, o)
		}
	}
	for o := range d.live {
		if p, ok := o.(*pd); ok {
			p.mu.Lock()
			if !p.dead {
				// EBUSY when a queue pair is left in it: its owner
				// destroys it, and the PD goes with the process.
				if errno := p.c.dealloc(); errno != 0 {
					errs = append(errs, fmt.Errorf("dealloc_pd %d: %w", p.handle, errno))
				}
				p.dead = true
			}
			p.mu.Unlock()
		}
		delete(d.live, o)
	}
	return errs
}

// pd is a protection domain.
type pd struct {
	dev    *device // immutable
	c      cPD     // immutable
	handle uint32  // immutable: read once, so it stays valid after Dealloc

	// guards: dead, and the ibv_pd's lifetime. RegMR holds mu shared
	// across the libibverbs call; Dealloc holds it exclusively, so ibv_dealloc_pd never frees
	// the ibv_pd under a call that reads it. Taken after dev.mu, before
	// mr.mu.
	mu   sync.RWMutex
	dead bool
}

func (p *pd) Handle() uint32 { return p.handle }

// Dealloc frees the PD. The kernel answers EBUSY while it holds regions;
// that is passed through.
func (p *pd) Dealloc() error {
	d := p.dev
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return fmt.Errorf("dealloc_pd %d on %s: device closed: %w", p.handle, d.name, syscall.ENODEV)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead {
		return fmt.Errorf("dealloc_pd %d on %s: already deallocated: %w", p.handle, d.name, syscall.EINVAL)
	}
	if errno := p.c.dealloc(); errno != 0 {
		if errno == syscall.EBUSY {
			return fmt.Errorf("dealloc_pd %d on %s: it still holds memory regions: %w", p.handle, d.name, errno)
		}
		return fmt.Errorf("dealloc_pd %d on %s: %w", p.handle, d.name, errno)
	}
	p.dead = true
	d.untrack(p)
	return nil
}

// RegMR registers [addr, addr+length) with iova == addr. The
// device-independent access checks and the device's Access list are
// applied here first, in the kernel's order (EINVAL before EOPNOTSUPP):
// the list is what mrfs promises, and some kernels accept flags they do
// not honour (zero_based on rxe in 6.1).
func (p *pd) RegMR(addr uintptr, length uint64, access verbs.Access) (verbs.MR, error) {
	d := p.dev
	fail := func(err error) (verbs.MR, error) {
		return nil, fmt.Errorf("reg_mr %s in pd %d on %s: %w", bytesize.Format(length), p.handle, d.name, err)
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return fail(fmt.Errorf("device closed: %w", syscall.ENODEV))
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.dead {
		return fail(fmt.Errorf("the protection domain was deallocated: %w", syscall.EINVAL))
	}
	if err := checkAccess(access, d.attr); err != nil {
		return fail(err)
	}
	c, err := p.c.regMR(addr, length, uint64(addr), uint32(access))
	if err != nil {
		return fail(err)
	}
	f := c.fields()
	m := &mr{dev: d, c: c, pd: p, lkey: f.lkey, rkey: f.rkey, addr: f.addr, length: f.length, access: access}
	d.track(m)
	return m, nil
}

// checkAccess is the kernel's ib_check_mr_access (EINVAL) followed by
// the device's list (EOPNOTSUPP).
func checkAccess(a verbs.Access, attr verbs.DeviceAttr) error {
	if err := a.Validate(); err != nil {
		return err
	}
	if extra := a &^ attr.Access; extra != 0 {
		return fmt.Errorf("the device does not support access %s: %w", extra, syscall.EOPNOTSUPP)
	}
	return nil
}

// errnoOf turns cgo's errno result into a syscall.Errno. A libibverbs
// call that fails without setting errno becomes EIO rather than a
// success.
func errnoOf(err error) syscall.Errno {
	if e, ok := err.(syscall.Errno); ok && e != 0 {
		return e
	}
	return syscall.EIO
}
