package store

import (
	"encoding/binary"
	"os"
	"strconv"
	"strings"
	"sync"
	"unsafe"
)

// kpageflags bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	kpfHuge = 1 << 17 // hugetlbfs
	kpfTHP  = 1 << 22 // transparent huge page
)

// PageSizeAt is the size of the page that backs the present page at p in
// this process: the PMD size (2 MiB on x86) for a transparent huge page,
// else the base page size. It reads /proc/self/pagemap and
// /proc/kpageflags, which need CAP_SYS_ADMIN for frame numbers; ok is
// false when they cannot tell.
func PageSizeAt(p unsafe.Pointer) (size uint64, ok bool) {
	pm, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return 0, false
	}
	defer pm.Close()
	var b [8]byte
	if _, err := pm.ReadAt(b[:], int64(uintptr(p)/uintptr(pageSize))*8); err != nil {
		return 0, false
	}
	e := binary.LittleEndian.Uint64(b[:])
	pfn := e & (1<<55 - 1)
	if e&(1<<63) == 0 || pfn == 0 {
		return 0, false // not present, or frame numbers hidden
	}
	kf, err := os.Open("/proc/kpageflags")
	if err != nil {
		return 0, false
	}
	defer kf.Close()
	if _, err := kf.ReadAt(b[:], int64(pfn)*8); err != nil {
		return 0, false
	}
	flags := binary.LittleEndian.Uint64(b[:])
	if flags&(kpfTHP|kpfHuge) != 0 {
		return hugeSize(), true
	}
	return pageSize, true
}

// hugeSize is the PMD size the kernel uses for transparent huge pages. It
// is read once: it is fixed at boot, and every buffer's creation asks.
var hugeSize = sync.OnceValue(func() uint64 {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
	if err == nil {
		if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 {
			return n
		}
	}
	return 2 << 20
})
