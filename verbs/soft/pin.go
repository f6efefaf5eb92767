package soft

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/verbs"
)

// Pinning is process-wide, like the kernel's mm->pinned_vm and mlock
// state: every provider in the process shares it, so two providers that
// register the same page never unlock it under each other.
var pins struct {
	// guards: pinned, refs, and the mlock/munlock calls themselves (so a
	// page cannot be unlocked by one region while another is locking it).
	// Lock order: a device's mu before pins.mu.
	mu sync.Mutex
	// pinned counts pages like pinned_vm: every registration adds its
	// whole pages, overlapping ones counted again.
	pinned uint64
	refs   pageRefs
}

var pageSize = uint64(os.Getpagesize())

// pinning describes the pages one registration holds.
type pinning struct {
	first, end uint64 // page numbers [first, end)
}

func (p pinning) pages() uint64 { return p.end - p.first }

// pagesOf is the pages that [addr, addr+length) touches.
func pagesOf(addr uintptr, length uint64) pinning {
	start := uint64(addr)
	return pinning{first: start / pageSize, end: (start + length + pageSize - 1) / pageSize}
}

// pin runs ib_umem_get's checks in the kernel's order and then locks the
// pages with mlock. Errors wrap the kernel's errno.
func pin(addr uintptr, length uint64) (pinning, error) {
	start := uint64(addr)
	if start+length < start || start+length > ^uint64(0)-pageSize+1 {
		return pinning{}, fmt.Errorf("address 0x%x + length %d overflows: %w", start, length, syscall.EINVAL)
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		return pinning{}, fmt.Errorf("getrlimit RLIMIT_MEMLOCK: %w", err)
	}
	privileged := verbs.CanLockMemory()
	if lim.Cur == 0 && !privileged {
		return pinning{}, fmt.Errorf("RLIMIT_MEMLOCK is 0 and the process lacks CAP_IPC_LOCK; raise it with `ulimit -l`: %w", syscall.EPERM)
	}
	p := pagesOf(addr, length)
	if p.pages() == 0 || p.pages() > 0xFFFFFFFF {
		return pinning{}, fmt.Errorf("%d pages: %w", p.pages(), syscall.EINVAL)
	}

	pins.mu.Lock()
	defer pins.mu.Unlock()
	limit := lim.Cur / pageSize // RLIM_INFINITY stays huge
	if !privileged && pins.pinned+p.pages() > limit {
		return pinning{}, fmt.Errorf("pinned memory would be %s, over RLIMIT_MEMLOCK %s; raise it with `ulimit -l` or run with CAP_IPC_LOCK: %w",
			bytesize.Format((pins.pinned+p.pages())*pageSize), bytesize.Format(lim.Cur), syscall.ENOMEM)
	}
	pins.refs.add(p.first, p.end, 1)
	if err := mlock(p.first*pageSize, p.pages()*pageSize); err != nil {
		// mlock may have locked a prefix before failing: unlock what no
		// other region holds.
		for _, z := range pins.refs.add(p.first, p.end, -1) {
			_ = munlock(z.start*pageSize, (z.end-z.start)*pageSize)
		}
		if err == syscall.ENOMEM {
			// ENOMEM is a hole in the range (msync tells), a page that
			// cannot be faulted in, or mlock's own RLIMIT_MEMLOCK check.
			if msync(p.first*pageSize, p.pages()*pageSize) == syscall.ENOMEM {
				return pinning{}, fmt.Errorf("range 0x%x+%d is not mapped: %w", start, length, syscall.EFAULT)
			}
			if privileged || lim.Cur == unix.RLIM_INFINITY {
				// No limit applies: a page could not be made (a full
				// tmpfs, a file shorter than the range). The kernel's
				// pin meets that fault as SIGBUS and answers EFAULT.
				return pinning{}, fmt.Errorf("range 0x%x+%d: a page cannot be faulted in: %w", start, length, syscall.EFAULT)
			}
			return pinning{}, fmt.Errorf("mlock refused by RLIMIT_MEMLOCK %s: %w", bytesize.Format(lim.Cur), syscall.ENOMEM)
		}
		return pinning{}, fmt.Errorf("mlock: %w", err)
	}
	pins.pinned += p.pages()
	return p, nil
}

// unpin releases one registration's pages and munlocks those no other
// live registration holds. Errors are ignored as ib_umem_release does:
// the caller may have unmapped the range already.
func unpin(p pinning) {
	if p.pages() == 0 {
		return
	}
	pins.mu.Lock()
	defer pins.mu.Unlock()
	pins.pinned -= p.pages()
	for _, z := range pins.refs.add(p.first, p.end, -1) {
		_ = munlock(z.start*pageSize, (z.end-z.start)*pageSize)
	}
}

// The raw calls take addresses, not slices: the memory is the caller's
// mapping and never a Go object.
func mlock(addr, n uint64) error   { return call(unix.SYS_MLOCK, addr, n, 0) }
func munlock(addr, n uint64) error { return call(unix.SYS_MUNLOCK, addr, n, 0) }
func msync(addr, n uint64) error   { return call(unix.SYS_MSYNC, addr, n, unix.MS_ASYNC) }

func call(trap, a, b, c uint64) error {
	if _, _, e := unix.Syscall(uintptr(trap), uintptr(a), uintptr(b), uintptr(c)); e != 0 {
		return e
	}
	return nil
}

// span is a half-open range of page numbers.
type span struct{ start, end uint64 }

// seg is a span every page of which is held by refs registrations.
type seg struct {
	span
	refs int32
}

// pageRefs counts, per page, the live registrations that hold it, as a
// sorted list of disjoint segments with refs > 0: a 1 GiB region is one
// entry, and adjacent segments with equal counts are merged.
type pageRefs struct {
	segs []seg
}

// add adds d to the count of every page in [start, end) and returns the
// spans whose count fell to zero. Pages not held before are counted from
// zero; d must not take a count below zero.
func (r *pageRefs) add(start, end uint64, d int32) []span {
	segs := r.segs
	i := sort.Search(len(segs), func(k int) bool { return segs[k].end > start })
	j := sort.Search(len(segs), func(k int) bool { return segs[k].start >= end })
	// Rebuild segs[lo:hi], which includes one neighbour on each side so
	// that merging can reach them.
	lo, hi := max(i-1, 0), min(j+1, len(segs))
	out := make([]seg, 0, hi-lo+4)
	out = append(out, segs[lo:i]...)
	var zero []span
	put := func(s, e uint64, refs int32) {
		if s >= e {
			return
		}
		if refs <= 0 {
			if n := len(zero); n > 0 && zero[n-1].end == s {
				zero[n-1].end = e
			} else {
				zero = append(zero, span{s, e})
			}
			return
		}
		if n := len(out); n > 0 && out[n-1].end == s && out[n-1].refs == refs {
			out[n-1].end = e
			return
		}
		out = append(out, seg{span{s, e}, refs})
	}
	cur := start
	for _, g := range segs[i:j] {
		put(g.start, start, g.refs) // part before the range
		if cur < g.start {
			put(cur, g.start, d) // gap: held by nobody before
		}
		s, e := max(g.start, start), min(g.end, end)
		put(s, e, g.refs+d)
		put(end, g.end, g.refs) // part after the range
		cur = e
	}
	put(cur, end, d)
	for _, g := range segs[j:hi] {
		put(g.start, g.end, g.refs)
	}
	r.segs = slices.Replace(segs, lo, hi, out...)
	return zero
}
