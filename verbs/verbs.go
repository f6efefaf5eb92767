// Package verbs is mrfs's view of RDMA verbs: access flags, the objects
// mrfs uses (device, protection domain, memory region) as interfaces, and
// errors that carry the errno a real libibverbs call would set.
//
// Two packages implement it: verbs/soft, a pure-Go model that follows the
// kernel's rules, and verbs/ibv, libibverbs through cgo (build tag rdma).
// Both must pass the suite in verbs/verbstest.
package verbs

import (
	"errors"
	"syscall"
)

// Provider enumerates and opens the devices of one backend.
type Provider interface {
	// Name is the backend's name in the config: "soft" or "rdma".
	Name() string
	// Devices lists the devices this backend can open.
	Devices() ([]DeviceInfo, error)
	// Open opens a device by name; "" opens the first one.
	Open(name string) (Device, error)
}

// Lister is a Provider that names the devices present without opening
// them, cheaply enough to ask every second (a mount watching devices
// come and go).
type Lister interface {
	Names() ([]string, error)
}

// DeviceInfo describes a device before it is opened.
type DeviceInfo struct {
	Name string
	Attr DeviceAttr
}

// DeviceAttr holds the limits of a device, as ibv_query_device reports them.
type DeviceAttr struct {
	MaxMR       int    // memory regions the device can hold
	MaxMRSize   uint64 // largest region in bytes
	PageSizeCap uint64 // bitmask of supported page sizes
	MaxPD       int    // protection domains the device can hold
	// Access is every flag the device accepts in reg_mr; registering with
	// another fails with EOPNOTSUPP.
	Access Access
}

// Device is an open device (ibv_context).
type Device interface {
	Name() string
	Attr() DeviceAttr
	// AllocPD allocates a protection domain.
	AllocPD() (PD, error)
	// Close closes the device. Like ibv_close_device it does not free
	// child objects: deregister and deallocate them first.
	Close() error
}

// PD is a protection domain (ibv_pd).
type PD interface {
	// Handle is the PD's number on its device.
	Handle() uint32
	// RegMR registers [addr, addr+length) with iova == addr. The memory
	// must be mapped by the caller (mmap, never the Go heap) and stay
	// mapped until Dereg.
	RegMR(addr uintptr, length uint64, access Access) (MR, error)
	// Dealloc frees the PD; EBUSY while it holds regions.
	Dealloc() error
}

// MR is a registered memory region (ibv_mr). Its keys, range, access
// and PD never change: mrfs re-registers by registering anew and then
// deregistering the old region, never with ibv_rereg_mr, whose failure
// (IBV_REREG_MR_ERR_CMD) would leave the region unusable.
type MR interface {
	LKey() uint32
	RKey() uint32
	// Addr is the registered virtual address; IOVA is the address a
	// remote peer targets. They are equal for RegMR.
	Addr() uintptr
	IOVA() uint64
	Length() uint64
	Access() Access
	PD() PD
	// Dereg deregisters the region; EINVAL if it is already gone.
	Dereg() error
}

// DeviceKeys is one device's keys for a region registered on several.
type DeviceKeys struct {
	Device     string
	LKey, RKey uint32
}

// DeviceError is a refusal by one of several devices (verbs/multi).
type DeviceError struct {
	Device string
	Err    error
}

func (e *DeviceError) Error() string { return "device " + e.Device + ": " + e.Err.Error() }
func (e *DeviceError) Unwrap() error { return e.Err }

// MultiMR is a region registered on several devices (verbs/multi): the
// MR's own keys are the first device's, Keys lists every device's.
type MultiMR interface {
	MR
	Keys() []DeviceKeys
}

// MultiPD is a PD on several devices (verbs/multi). On is its part on
// the named device, nil when it has none: a queue pair of a connection
// that came through that device is made there, where the device's own
// keys of the PD's regions are valid.
type MultiPD interface {
	PD
	On(device string) PD
}

// Errno returns the errno an error from this package carries, or 0.
func Errno(err error) syscall.Errno {
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	return 0
}
