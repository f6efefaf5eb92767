package buffer

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/store"
)

// pageRound rounds n up to whole pages: the kernel pins, maps and accounts
// whole pages.
var pageRound = store.PageRound

// mapping is the daemon's MAP_SHARED view of a buffer's file. It is kept
// as a raw pointer and length (not a []byte from unix.Mmap) because
// shrinking unmaps only its tail, which unix.Munmap's bookkeeping does
// not allow.
type mapping struct {
	base unsafe.Pointer // nil: nothing mapped
	len  uint64         // mapped bytes, whole pages
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
