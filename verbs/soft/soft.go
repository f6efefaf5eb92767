// Package soft is mrfs's pure-Go verbs backend: a model of Soft-RoCE (rxe)
// on Linux that needs no NIC. It is not a stub. It validates reg_mr in the
// kernel's order with the kernel's errnos, pins pages with mlock and
// accounts them against RLIMIT_MEMLOCK (unless CAP_IPC_LOCK) the way
// ib_umem_get accounts pinned_vm, enforces max_mr and max_pd, and refuses
// to deallocate a PD that still holds regions. Its keys are the one place
// it departs from rxe on purpose: 32 random bits (nonzero, unique among
// live regions, lkey == rkey) instead of rxe's index<<8 | random byte, so
// that a key cannot be guessed from another. shared/reference/verbs-semantics.md lists the rules and their
// sources.
//
// It also plays the responder of an RC queue pair (pd.Responder): one-sided
// READ, WRITE and atomics checked in rxe's order and completed with the
// work-completion status a requester would see, for the soft TCP
// transport of remote/server.
//
// Locking: each device has one mutex (device.mu) for its PDs, regions and
// keys, and one RWMutex (device.mem) that responders hold for
// reading while they touch registered memory and that Dereg and Close
// take for writing; pinning has one process-wide mutex (pins.mu).
// Lock order is device.mem, device.mu, pins.mu. mlock runs without
// device.mu but under pins.mu, so pinning is serialized process-wide: a
// page must not be unlocked by one region's Dereg while another region is
// locking it.
package soft

import (
	"fmt"
	"strings"
	"syscall"

	"mrfs/verbs"
)

// Options configure the soft device.
type Options struct {
	DeviceName string // "" -> "soft0"
	// Devices is how many devices the provider has (0 -> 1), named
	// DeviceName and then soft1, soft2...: independent devices, each
	// with its own keys, PDs and limits, for tests of several NICs.
	Devices int
	MaxMR   int // 0 -> 524287 (rxe's max_mr); capped at 1<<24-1 (maxMR)
	// MaxMRSize caps a region's length (EINVAL past it), as devices do
	// that register at most so much at once; 0: rxe's, no limit.
	MaxMRSize uint64
	// MaxPD caps the protection domains (EINVAL past it); 0: rxe's 1<<20.
	MaxPD int
	// Present says whether a device is there (nil: all are), as if NICs
	// came and went: one that is not is neither listed nor opened
	// (ENODEV), and contexts open on it work on, as on an rxe device
	// whose deletion waits for them.
	Present func(name string) bool
}

// Limits of rxe (rxe_param.h) that the model copies.
const (
	rxeMaxMR = 1<<19 - 1
	rxeMaxPD = 1 << 20
	// maxMR keeps at most one key in 256 taken, so that a fresh random
	// key is found in a try or two.
	maxMR = 1<<24 - 1
)

// deviceAccess is what rxe accepts in reg_mr: ZERO_BASED and ON_DEMAND
// (without ODP) are refused with EOPNOTSUPP.
const deviceAccess = verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead |
	verbs.RemoteAtomic | verbs.MWBind | verbs.RelaxedOrdering

// New returns a provider with one soft device.
func New(opt Options) verbs.Provider {
	if opt.DeviceName == "" {
		opt.DeviceName = "soft0"
	}
	if opt.MaxMR <= 0 {
		opt.MaxMR = rxeMaxMR
	}
	opt.MaxMR = min(opt.MaxMR, maxMR)
	if opt.MaxPD <= 0 {
		opt.MaxPD = rxeMaxPD
	}
	p := &provider{present: opt.Present}
	for i := range max(opt.Devices, 1) {
		o := opt
		if i > 0 {
			o.DeviceName = fmt.Sprintf("soft%d", i)
		}
		p.devs = append(p.devs, newDevice(o))
	}
	return p
}

type provider struct {
	devs    []*device // immutable after New
	present func(name string) bool
}

var _ verbs.Lister = (*provider)(nil)

func (p *provider) Name() string { return "soft" }

// here is the devices present.
func (p *provider) here() []*device {
	var out []*device
	for _, d := range p.devs {
		if p.present == nil || p.present(d.name) {
			out = append(out, d)
		}
	}
	return out
}

func (p *provider) Devices() ([]verbs.DeviceInfo, error) {
	var out []verbs.DeviceInfo
	for _, d := range p.here() {
		out = append(out, verbs.DeviceInfo{Name: d.name, Attr: d.attr})
	}
	return out, nil
}

// Names is the names of the devices present.
func (p *provider) Names() ([]string, error) {
	var out []string
	for _, d := range p.here() {
		out = append(out, d.name)
	}
	return out, nil
}

// Open returns a new context on the named device ("": the first).
// Contexts share the device's regions and PD numbering, as contexts of
// one rxe device do.
func (p *provider) Open(name string) (verbs.Device, error) {
	here := p.here()
	for _, d := range here {
		if name == "" || name == d.name {
			return &context{dev: d, pds: map[*pd]struct{}{}}, nil
		}
	}
	names := make([]string, len(here))
	for i, d := range here {
		names[i] = d.name
	}
	return nil, fmt.Errorf("open device %q: soft has only %s (verbs.soft_devices sets how many it has): %w", name, strings.Join(names, ", "), syscall.ENODEV)
}
