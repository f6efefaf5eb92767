package soft

import (
	"runtime/debug"
	"sync/atomic"
	"unsafe"

	"mrfs/verbs"
)

// Responder serves one-sided operations against the PD's regions, as the
// responder of an RC queue pair in this PD would (verbs.Responder). The
// soft backend's TCP transport (remote/server) calls it.
func (p *pd) Responder() verbs.Responder { return responder{p} }

var _ verbs.ResponderPD = (*pd)(nil)

type responder struct{ p *pd }

// target is what the checks hand to the copy: the address in the daemon's
// mapping where the operation starts.
type target struct {
	addr uintptr
	n    uint64
}

// check runs rxe's responder checks in its order (rxe_resp.c: check_rkey;
// rxe_mr.c: lookup_mr, mr_check_range; then the atomic alignment check):
//
//  1. the region by its rkey (rxe finds it by the index rkey>>8 and then
//     compares the whole key; soft keys are random and looked up whole),
//     the region's PD this PD, the access bit granted, the region live;
//  2. [iova, iova+n) inside the region's iova range;
//  3. for atomics, iova 8-byte aligned.
//
// The zero-length exception is the caller's: it skips check entirely.
// Called with d.mem held for reading.
func (r responder) check(iova uint64, rkey uint32, n uint64, need verbs.Access, atomic bool) (target, verbs.WCStatus) {
	d := r.p.ctx.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.mrs[rkey]
	if m == nil || m.pd != r.p || m.access&need != need || m.state != mrLive || r.p.ctx.closed {
		return target{}, verbs.WCRemAccessErr
	}
	base := uint64(m.addr) // iova == addr: RegMR registers with iova = addr
	if iova < base || n > m.length || iova-base > m.length-n {
		return target{}, verbs.WCRemAccessErr
	}
	if atomic && iova&7 != 0 {
		return target{}, verbs.WCRemInvReqErr
	}
	return target{addr: m.addr + uintptr(iova-base), n: n}, verbs.WCSuccess
}

// access runs fn on the target's memory with d.mem held for reading, so
// that no Dereg (or Close) completes while fn runs: after those
// return the buffer layer may unmap the range. A fault while touching the
// memory (a client truncated the memfd under the daemon's mapping: SIGBUS)
// becomes IBV_WC_REM_OP_ERR: the request passed every check, and it is
// the responder that could not carry it out (docs/REMOTE.md).
func (r responder) access(iova uint64, rkey uint32, n uint64, need verbs.Access, atomic bool, fn func(mem unsafe.Pointer)) (st verbs.WCStatus) {
	d := r.p.ctx.dev
	d.mem.RLock()
	defer d.mem.RUnlock()
	t, st := r.check(iova, rkey, n, need, atomic)
	if st != verbs.WCSuccess {
		return st
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if e := recover(); e != nil {
			if _, fault := e.(interface{ Addr() uintptr }); !fault {
				panic(e) // a bug, not a fault on the mapping
			}
			st = verbs.WCRemOpErr
		}
	}()
	fn(ptr(t.addr))
	return verbs.WCSuccess
}

// ptr turns a registered address into a pointer. The memory is a mapping
// (never the Go heap), so the GC has nothing to track; the detour through
// a pointer variable only keeps vet's uintptr check quiet.
func ptr(addr uintptr) unsafe.Pointer {
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}

func (r responder) Read(dst []byte, iova uint64, rkey uint32) verbs.WCStatus {
	if len(dst) == 0 {
		return verbs.WCSuccess // C9-88: a zero-length READ checks no key
	}
	return r.access(iova, rkey, uint64(len(dst)), verbs.RemoteRead, false, func(mem unsafe.Pointer) {
		copy(dst, unsafe.Slice((*byte)(mem), len(dst)))
	})
}

func (r responder) Write(iova uint64, rkey uint32, src []byte) verbs.WCStatus {
	if len(src) == 0 {
		return verbs.WCSuccess // C9-88: a zero-length WRITE checks no key
	}
	return r.access(iova, rkey, uint64(len(src)), verbs.RemoteWrite, false, func(mem unsafe.Pointer) {
		copy(unsafe.Slice((*byte)(mem), len(src)), src)
	})
}

// The atomics use sync/atomic on the word in the mapping, so they are
// atomic against each other from any number of peers, as a NIC's are
// (IBV_ATOMIC_HCA). The word is in host byte order, as rxe reads it.

func (r responder) CompareSwap(iova uint64, rkey uint32, compare, swap uint64) (old uint64, st verbs.WCStatus) {
	st = r.access(iova, rkey, 8, verbs.RemoteAtomic, true, func(mem unsafe.Pointer) {
		w := (*uint64)(mem)
		for {
			old = atomic.LoadUint64(w)
			if old != compare || atomic.CompareAndSwapUint64(w, old, swap) {
				return
			}
		}
	})
	return old, st
}

func (r responder) FetchAdd(iova uint64, rkey uint32, add uint64) (old uint64, st verbs.WCStatus) {
	st = r.access(iova, rkey, 8, verbs.RemoteAtomic, true, func(mem unsafe.Pointer) {
		old = atomic.AddUint64((*uint64)(mem), add) - add
	})
	return old, st
}
