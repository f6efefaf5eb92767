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
	// Remove takes the file out of the store: descriptors and mappings
	// made before keep its memory until they go. Later calls fail.
	Remove() error
}

var pageSize = uint64(os.Getpagesize())

// PageRound rounds n up to whole pages.
func PageRound(n uint64) uint64 { return (n + pageSize - 1) &^ (pageSize - 1) }

// mapFd maps the first length bytes of fd.
func mapFd(fd int, length uint64) (unsafe.Pointer, error) {
	n := PageRound(length)
	p, err := unix.MmapPtr(fd, 0, nil, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
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

// errRemoved answers calls on a file taken out of the store.
var errRemoved = fmt.Errorf("the file was removed: %w", syscall.ENOENT)
