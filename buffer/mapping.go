package buffer

import (
	"fmt"
	"mrfs/internal/bytesize"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

var pageSize = uint64(os.Getpagesize())

// pageRound rounds n up to whole pages: the kernel pins, maps and accounts
// whole pages.
func pageRound(n uint64) uint64 { return (n + pageSize - 1) &^ (pageSize - 1) }

// mapping is the daemon's MAP_SHARED view of a memfd. It is kept as a raw
// pointer and length (not a []byte from unix.Mmap) because shrinking unmaps
// only its tail, which unix.Munmap's bookkeeping does not allow.
type mapping struct {
	base unsafe.Pointer // nil: nothing mapped
	len  uint64         // mapped bytes, whole pages
}

// mapMemfd maps the first size bytes of fd (rounded up to pages).
func mapMemfd(fd int, size uint64) (mapping, error) {
	n := pageRound(size)
	p, err := unix.MmapPtr(fd, 0, nil, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return mapping{}, fmt.Errorf("mmap %s of memfd: %w", bytesize.Format(n), err)
	}
	return mapping{base: p, len: n}, nil
}

// unmap drops the whole mapping; unmapping nothing is fine.
func (mp *mapping) unmap() error {
	if mp.base == nil {
		return nil
	}
	if err := unix.MunmapPtr(mp.base, uintptr(mp.len)); err != nil {
		return fmt.Errorf("munmap %s: %w", bytesize.Format(mp.len), err)
	}
	*mp = mapping{}
	return nil
}

// shrink unmaps the pages past the first size bytes (rounded up to pages),
// so the daemon holds no mapping past a smaller end of file.
func (mp *mapping) shrink(size uint64) error {
	keep := pageRound(size)
	if keep == 0 {
		return mp.unmap()
	}
	if mp.base == nil || keep >= mp.len {
		return nil
	}
	if err := unix.MunmapPtr(unsafe.Add(mp.base, keep), uintptr(mp.len-keep)); err != nil {
		return fmt.Errorf("munmap tail of %s: %w", bytesize.Format(mp.len-keep), err)
	}
	mp.len = keep
	return nil
}

// memfdSize is the memfd's size as the kernel knows it now.
func memfdSize(fd int) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("fstat memfd: %w", err)
	}
	return uint64(st.Size), nil
}

func truncate(fd int, size uint64) error {
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fmt.Errorf("ftruncate memfd to %s: %w", bytesize.Format(size), err)
	}
	return nil
}
