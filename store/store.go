// Package store is where the memory of mrfs's buffers comes from: one file
// per buffer in a private tmpfs instance that the daemon makes at mount
// (NewTmpfs), or one memfd per buffer in the degraded mode without
// CAP_SYS_ADMIN (NewMemfd).
//
// The tmpfs instance is made with fsopen, fsconfig and fsmount and attached
// to no directory, so no other process can reach it. Its own options carry
// the limits: size (the pinning budget), nr_inodes and huge. The kernel then
// bounds every write, truncate and fallocate of its files, including writes
// through zero-copy opens that the daemon never sees: past the budget they
// fail with ENOSPC at that call, as on a full tmpfs. Files are reached by
// name through the instance's root, so the daemon holds no descriptor per
// file: each operation opens what it needs and closes it again, and a
// client's open gets a descriptor of its own (File.Open).
//
// A memfd has no name: the degraded store holds one descriptor per file,
// and bounds nothing by itself (the buffer layer enforces the budget on
// what it sees).
package store

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
)

// Store makes the files behind buffers.
type Store interface {
	// Kind is "tmpfs" or "memfd".
	Kind() string
	// Create makes an empty file for buffer id.
	Create(id uint64) (File, error)
	// Usage is the bytes of memory the store's files hold and its size
	// limit; ok is false for a store that has no limit of its own.
	Usage() (used, size uint64, ok bool)
	// Grain is the most memory one page of a file may take: the page
	// size, or the huge page size where pages may be huge. A huge page
	// fills its whole aligned block: one made to fill a range may take
	// memory on either side of it, up to the end of file and past it
	// (pastEnd, huge=always), or only below max(end of file, end of the
	// range) (huge=within_size).
	Grain() (size uint64, pastEnd bool)
	// Close releases the store. Files still mapped or open elsewhere keep
	// their memory until released there.
	Close() error
}

// File is the memory of one buffer.
type File interface {
	// Stat is the file's size and the memory it holds (whole pages, huge
	// or not: st_blocks).
	Stat() (size, held uint64, err error)
	Truncate(size uint64) error
	// Allocate is fallocate(2).
	Allocate(mode uint32, off, length uint64) error
	// Map maps the first length bytes (rounded up to whole pages)
	// MAP_SHARED, read-write.
	Map(length uint64) (unsafe.Pointer, error)
	// Open is a new read-write, close-on-exec descriptor of the file, for
	// a client's open; the caller closes it.
	Open() (int, error)
	// ReadAt and WriteAt are pread and pwrite.
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	// Holes is the bytes of [from, to) that hold no memory, in whole
	// pages, past the end of file too: what filling the range would add.
	Holes(from, to uint64) (uint64, error)
	// Remove takes the file out of the store: descriptors and mappings
	// made before keep its memory until they go. Later calls fail.
	Remove() error
}

var (
	_ Store = (*memfd)(nil)
	_ Store = (*tmpfs)(nil)
	_ File  = (*memfdFile)(nil)
	_ File  = (*tmpfsFile)(nil)
)

var pageSize = uint64(os.Getpagesize())

// PageRound rounds n up to whole pages.
func PageRound(n uint64) uint64 { return (n + pageSize - 1) &^ (pageSize - 1) }

// MapFd maps the first length bytes of fd shared: read-write when
// writable, else read-only.
func MapFd(fd int, length uint64, writable bool) (unsafe.Pointer, error) {
	n := PageRound(length)
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	p, err := unix.MmapPtr(fd, 0, nil, uintptr(n), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %s: %w", bytesize.Format(n), err)
	}
	return p, nil
}

func statFd(fd int) (size, held uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, 0, fmt.Errorf("fstat: %w", err)
	}
	return uint64(st.Size), uint64(st.Blocks) * 512, nil
}

func truncateFd(fd int, size uint64) error {
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fmt.Errorf("ftruncate to %s: %w", bytesize.Format(size), err)
	}
	return nil
}

func allocateFd(fd int, mode uint32, off, length uint64) error {
	if err := unix.Fallocate(fd, mode, int64(off), int64(length)); err != nil {
		return fmt.Errorf("fallocate mode 0x%x of %s at %d: %w", mode, bytesize.Format(length), off, err)
	}
	return nil
}

func preadFd(fd int, p []byte, off int64) (int, error) {
	n, err := unix.Pread(fd, p, off)
	if err != nil {
		return 0, fmt.Errorf("pread at %d: %w", off, err)
	}
	return n, nil
}

func pwriteFd(fd int, p []byte, off int64) (int, error) {
	n, err := unix.Pwrite(fd, p, off)
	if err != nil {
		return n, fmt.Errorf("pwrite at %d: %w", off, err)
	}
	return n, nil
}

// HolesFd counts the bytes of [from, to) of fd, a store file, that hold
// no memory, in whole pages (see File.Holes): cachestat (Linux 6.5)
// counts the pages the file holds in the range, past its end too (where
// fallocate with FALLOC_FL_KEEP_SIZE leaves pages that SEEK_DATA does
// not see, and that mincore calls absent until touched). Without it,
// SEEK_DATA and SEEK_HOLE count below the end, and every page past it
// counts as a hole: more than the truth, never less.
func HolesFd(fd int, from, to uint64) (uint64, error) {
	from, to = from&^(pageSize-1), PageRound(to)
	if from >= to {
		return 0, nil
	}
	held, err := cachestat(fd, from, to)
	if err == nil {
		return to - from - min(held, to-from), nil
	}
	if !errors.Is(err, syscall.ENOSYS) {
		return 0, err
	}
	size, _, err := statFd(fd)
	if err != nil {
		return 0, err
	}
	return seekHoles(fd, from, to, size)
}

// cachestat is the bytes of memory the file holds in [from, to): in its
// page cache, or (shmem) in swap.
func cachestat(fd int, from, to uint64) (uint64, error) {
	rng := struct{ off, len uint64 }{from, to - from}
	var cs struct{ cache, dirty, writeback, evicted, recentlyEvicted uint64 }
	_, _, errno := unix.Syscall6(unix.SYS_CACHESTAT, uintptr(fd), uintptr(unsafe.Pointer(&rng)), uintptr(unsafe.Pointer(&cs)), 0, 0, 0)
	if errno != 0 {
		return 0, fmt.Errorf("cachestat: %w", errno)
	}
	return (cs.cache + cs.evicted) * pageSize, nil
}

// seekHoles counts the holes of [from, to) with lseek: every page past
// size is one.
func seekHoles(fd int, from, to, size uint64) (uint64, error) {
	var holes uint64
	for off := from; off < to; {
		if off >= size {
			return holes + to - off, nil
		}
		data, err := unix.Seek(fd, int64(off), unix.SEEK_DATA)
		if err == syscall.ENXIO || err == nil && uint64(data) >= to {
			return holes + to - off, nil // no data up to the end
		}
		if err != nil {
			return 0, fmt.Errorf("lseek SEEK_DATA at %d: %w", off, err)
		}
		holes += uint64(data)&^(pageSize-1) - off
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return 0, fmt.Errorf("lseek SEEK_HOLE at %d: %w", data, err)
		}
		off = PageRound(uint64(hole))
	}
	return holes, nil
}

// errRemoved answers calls on a file taken out of the store.
var errRemoved = fmt.Errorf("the file was removed: %w", syscall.ENOENT)
