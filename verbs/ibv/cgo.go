//go:build rdma

package ibv

// This is the package's only cgo file: thin wrappers that call one
// libibverbs function each and return Go values and a syscall.Errno. All
// decisions live in the pure-Go files. No Go pointer is ever kept by C:
// the only Go memory C sees is an out-parameter for the length of one
// call, and memory to register is the caller's mmap, passed as an integer.

/*
#cgo LDFLAGS: -libverbs
#include <stdint.h>
#include <infiniband/verbs.h>

// The address to register arrives as an integer (the caller's mapping,
// never Go memory) and becomes a pointer only on the C side.
static struct ibv_mr *mrfs_reg_mr(struct ibv_pd *pd, uintptr_t addr, size_t length,
				  uint64_t iova, unsigned int access)
{
	return ibv_reg_mr_iova2(pd, (void *)addr, length, iova, access);
}

static int mrfs_rereg_mr(struct ibv_mr *mr, int flags, struct ibv_pd *pd,
			 uintptr_t addr, size_t length, int access)
{
	return ibv_rereg_mr(mr, flags, pd, (void *)addr, length, access);
}
*/
import "C"

import (
	"syscall"
	"unsafe"
)

// Values from verbs.h that the pure-Go files need.
const (
	capMemWindow = uint32(C.IBV_DEVICE_MEM_WINDOW)

	reregErrInput        = int(C.IBV_REREG_MR_ERR_INPUT)
	reregErrDontForkNew  = int(C.IBV_REREG_MR_ERR_DONT_FORK_NEW)
	reregErrDoForkOld    = int(C.IBV_REREG_MR_ERR_DO_FORK_OLD)
	reregErrCmd          = int(C.IBV_REREG_MR_ERR_CMD)
	reregErrCmdDoForkNew = int(C.IBV_REREG_MR_ERR_CMD_AND_DO_FORK_NEW)
)

// cDevice is an ibv_device of a device list; valid until the list is
// freed, so a device must be opened before that.
type cDevice struct{ p *C.struct_ibv_device }

// getDevices wraps ibv_get_device_list. free releases the list (devices
// opened from it stay open).
func getDevices() (devs []cDevice, free func(), err error) {
	var n C.int
	list, err := C.ibv_get_device_list(&n)
	if list == nil {
		return nil, nil, errnoOf(err)
	}
	for _, p := range unsafe.Slice(list, int(n)) {
		devs = append(devs, cDevice{p})
	}
	return devs, func() { C.ibv_free_device_list(list) }, nil
}

// name wraps ibv_get_device_name.
func (d cDevice) name() string { return C.GoString(C.ibv_get_device_name(d.p)) }

// cContext is an open device.
type cContext struct{ p *C.struct_ibv_context }

// open wraps ibv_open_device.
func (d cDevice) open() (cContext, error) {
	p, err := C.ibv_open_device(d.p)
	if p == nil {
		return cContext{}, errnoOf(err)
	}
	return cContext{p}, nil
}

// close wraps ibv_close_device, which returns -1 with errno on failure.
func (c cContext) close() error {
	if r, err := C.ibv_close_device(c.p); r != 0 {
		return errnoOf(err)
	}
	return nil
}

// rawAttr is what ibv_query_device_ex reports that mrfs uses.
type rawAttr struct {
	maxMR, maxPD       int
	maxMRSize          uint64
	pageSizeCap        uint64
	capFlags, vendorID uint32
	odp                bool // odp_caps.general_caps has IBV_ODP_SUPPORT
}

// query wraps ibv_query_device_ex, which returns an errno value. It
// falls back to ibv_query_device by itself when the provider lacks the
// extended query; odp_caps is then zero.
func (c cContext) query() (rawAttr, error) {
	var a C.struct_ibv_device_attr_ex
	if r := C.ibv_query_device_ex(c.p, nil, &a); r != 0 {
		return rawAttr{}, syscall.Errno(r)
	}
	o := &a.orig_attr
	return rawAttr{
		maxMR:       int(o.max_mr),
		maxPD:       int(o.max_pd),
		maxMRSize:   uint64(o.max_mr_size),
		pageSizeCap: uint64(o.page_size_cap),
		capFlags:    uint32(o.device_cap_flags),
		vendorID:    uint32(o.vendor_id),
		odp:         uint64(a.odp_caps.general_caps)&uint64(C.IBV_ODP_SUPPORT) != 0,
	}, nil
}

// cPD is a protection domain.
type cPD struct{ p *C.struct_ibv_pd }

// allocPD wraps ibv_alloc_pd.
func (c cContext) allocPD() (cPD, error) {
	p, err := C.ibv_alloc_pd(c.p)
	if p == nil {
		return cPD{}, errnoOf(err)
	}
	return cPD{p}, nil
}

// handle is pd->handle, the kernel's number for the PD.
func (p cPD) handle() uint32 { return uint32(p.p.handle) }

// dealloc wraps ibv_dealloc_pd, which returns an errno value (not -1).
func (p cPD) dealloc() syscall.Errno { return syscall.Errno(C.ibv_dealloc_pd(p.p)) }

// cMR is a memory region. libibverbs keeps the same ibv_mr across a
// successful rereg and updates its fields in place.
type cMR struct{ p *C.struct_ibv_mr }

// mrFields are the ibv_mr fields mrfs reads.
type mrFields struct {
	lkey, rkey uint32
	addr       uintptr
	length     uint64
}

// regMR wraps ibv_reg_mr_iova2 (ibv_reg_mr is a macro).
func (p cPD) regMR(addr uintptr, length, iova uint64, access uint32) (cMR, error) {
	m, err := C.mrfs_reg_mr(p.p, C.uintptr_t(addr), C.size_t(length), C.uint64_t(iova), C.uint(access))
	if m == nil {
		return cMR{}, errnoOf(err)
	}
	return cMR{m}, nil
}

func (m cMR) fields() mrFields {
	return mrFields{
		lkey:   uint32(m.p.lkey),
		rkey:   uint32(m.p.rkey),
		addr:   uintptr(m.p.addr),
		length: uint64(m.p.length),
	}
}

// rereg wraps ibv_rereg_mr: code is 0 or an IBV_REREG_MR_ERR_* value,
// errno what libibverbs or the kernel set. pd may be the zero cPD (NULL)
// when the PD does not change.
func (m cMR) rereg(flags int, pd cPD, addr uintptr, length uint64, access int) (code int, errno syscall.Errno) {
	r, err := C.mrfs_rereg_mr(m.p, C.int(flags), pd.p, C.uintptr_t(addr), C.size_t(length), C.int(access))
	if r == 0 {
		return 0, 0
	}
	return int(r), errnoOf(err)
}

// dereg wraps ibv_dereg_mr, which returns an errno value (not -1). On
// success the ibv_mr is freed.
func (m cMR) dereg() syscall.Errno { return syscall.Errno(C.ibv_dereg_mr(m.p)) }
