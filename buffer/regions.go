package buffer

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/store"
	"mrfs/verbs"
)

// Region is one memory region of a buffer's registration.
type Region struct {
	Addr       uintptr
	Length     uint64
	LKey, RKey uint32
	// Devices is every device's keys when the region is registered on
	// several (the first's are LKey and RKey); nil on one device.
	Devices []verbs.DeviceKeys
}

// regions is a buffer's registration: consecutive memory regions that
// cover the first bytes of the daemon's mapping in order, each at most
// the device's max_mr_size. Devices cap a region's size (some NICs at
// 2 GiB); a buffer larger than that is still one file, registered in
// pieces. nil: nothing registered.
type regions []verbs.MR

// length is the bytes registered.
func (rs regions) length() uint64 {
	var n uint64
	for _, r := range rs {
		n += r.Length()
	}
	return n
}

// list is the regions as Info shows them.
func (rs regions) list() []Region {
	if len(rs) == 0 {
		return nil
	}
	out := make([]Region, len(rs))
	for i, r := range rs {
		out[i] = Region{Addr: r.Addr(), Length: r.Length(), LKey: r.LKey(), RKey: r.RKey()}
		if m, ok := r.(verbs.MultiMR); ok {
			out[i].Devices = m.Keys()
		}
	}
	return out
}

// Progress is how far a registration that takes a while has come.
type Progress struct {
	Done, Total uint64 // bytes populated and registered, of Total
}

// progress counts a running registration's bytes; nil counts nothing.
type progress struct {
	done  atomic.Uint64
	total uint64
}

func (p *progress) add(n uint64) {
	if p != nil {
		p.done.Add(n)
	}
}

// register registers the first length bytes of f's mapping at base in pd for owner,
// in place of a registration of oldLen bytes (admission and the charge of
// the file's memory are the caller's): for a big range, the pages that do
// not exist yet are populated by workers first (populate, from newFrom
// on), then the range is registered in regions of at most the device's
// max_mr_size, and the registered bytes are counted for owner. ctx ends
// the work between chunks and between regions (a FUSE INTERRUPT): nothing
// is left registered then. A device refusal that is a known limit names
// it, unless the file shrank meanwhile (errRaced); a store too full for
// the pages says so.
func (m *Manager) register(ctx context.Context, f store.File, pd verbs.PD, pdNum uint32, base unsafe.Pointer, length, oldLen, newFrom uint64, owner uint32, a verbs.Access, prog *progress) (regions, error) {
	addr := uintptr(base)
	what := fmt.Sprintf("register %s in pd %d", bytesize.Format(length), pdNum)
	src, isSource := f.(Source)
	if isSource {
		if err := fillSource(src, base, length); err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		prog.add(length)
	} else if t := m.opt.PopulateThreshold; t > 0 && length >= t && newFrom < length {
		if err := m.populate(ctx, base, newFrom, length, prog); err != nil {
			return nil, fmt.Errorf("%s: populate: %w", what, m.storeFull(err, length, true))
		}
	} else {
		prog.add(length - min(newFrom, length))
	}
	// Regions start on page boundaries, so no two share a page.
	step := m.attr.MaxMRSize &^ (pageRound(1) - 1)
	if step == 0 {
		step = length
	}
	rs := make(regions, 0, 1)
	for off := uint64(0); off < length; off += step {
		n := min(step, length-off)
		err := ctx.Err()
		var mr verbs.MR
		var took time.Duration
		if err == nil {
			start := time.Now()
			mr, err = pd.RegMR(addr+uintptr(off), n, a)
			took = time.Since(start)
		}
		if err != nil {
			if rest, derr := m.deregister(rs, owner, false); derr != nil {
				m.log.Error("leaking memory regions", "regions", len(rest), "err", derr)
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("%s: %w", what, interrupted(ctx))
			}
			if shrank(f, length) {
				err = fmt.Errorf("%w: %w", errRaced, err)
			} else if serr := m.storeFull(err, n, !isSource); serr != err {
				err = serr
			} else {
				m.mu.Lock()
				err = m.classifyLocked(err, n)
				m.mu.Unlock()
			}
			if len(rs) > 0 || n < length {
				return nil, fmt.Errorf("%s: region %d (%s at offset %s): %w", what, len(rs)+1, bytesize.Format(n), bytesize.Format(off), err)
			}
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		rs = append(rs, mr)
		m.mu.Lock()
		m.regions++
		m.mu.Unlock()
		m.events.Registered(n, took)
	}
	m.mu.Lock()
	m.pinLocked(owner, oldLen, length)
	m.mu.Unlock()
	return rs, nil
}

// shrank says whether f is now shorter than length; nil f (a pool's
// chunk, whose files cannot change size) never is.
func shrank(f store.File, length uint64) bool {
	if f == nil {
		return false
	}
	cur, _, err := f.Stat()
	return err == nil && cur < length
}

// deregister deregisters rs in order. uncharge says whether their bytes
// still count as registered: after a replacement the new registration
// already counted the net change. It stops at the first failure and returns the regions
// still registered.
func (m *Manager) deregister(rs regions, owner uint32, uncharge bool) (regions, error) {
	for i, r := range rs {
		if err := r.Dereg(); err != nil {
			return rs[i:], fmt.Errorf("deregister %s (lkey 0x%x) in pd %d: %w", bytesize.Format(r.Length()), r.LKey(), r.PD().Handle(), err)
		}
		m.mu.Lock()
		m.regions--
		if uncharge {
			m.pinLocked(owner, r.Length(), 0)
		}
		m.mu.Unlock()
		m.events.Deregistered(r.Length())
	}
	return nil, nil
}

// errInterrupted is a registration stopped by its caller (a FUSE
// INTERRUPT: Ctrl-C on truncate); the buffer is as before.
var errInterrupted = fmt.Errorf("interrupted: %w", syscall.EINTR)

// interrupted is the error for a registration ctx ended.
func interrupted(ctx context.Context) error {
	return fmt.Errorf("%w (%w)", errInterrupted, ctx.Err())
}

// fillSource makes every page of a source's mapping at base exist before
// it is pinned, for writing or (a source registered read-only, mapped
// so) for reading: a hole in a sparse source takes a page of its own
// filesystem, which may be full, or have no huge page left. Pinning would
// then fail with an errno that names neither.
func fillSource(src Source, base unsafe.Pointer, n uint64) error {
	advice := unix.MADV_POPULATE_WRITE
	if !src.Writable() {
		advice = unix.MADV_POPULATE_READ
	}
	_, _, errno := unix.Syscall(unix.SYS_MADVISE, uintptr(base), uintptr(pageRound(n)), uintptr(advice))
	switch {
	case errno == syscall.EFAULT || errno == syscall.ENOMEM:
		return fmt.Errorf("the pages of the source %s cannot all be made: its filesystem is full, or has no huge page left (madvise: %v): %w", src.Path(), errno, syscall.ENOSPC)
	case errno != 0:
		return fmt.Errorf("fill the source %s: %w", src.Path(), errno)
	}
	return nil
}
