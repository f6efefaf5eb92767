package fs

import (
	"context"
	"errors"
	"io"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/buffer"
)

// handle is what both kinds of open share: a descriptor of the buffer's
// file opened for this open (the daemon keeps none per buffer). After an
// unlink it is the open file's only way to its memory, so fstat, ftruncate,
// fallocate and lseek of an unlinked file go through it, as on any
// filesystem.
type handle struct {
	node     *bufferNode
	writable bool       // opened for writing: flush reports registration failures
	bfd      *buffer.Fd // closed at release
}

var _ = (fusefs.FileLseeker)((*handle)(nil))

// fdHolder is a handle that holds its client's descriptor of the file:
// ftruncate and fallocate through it act on the file after an unlink too.
type fdHolder interface{ fd() *buffer.Fd }

var (
	_ fdHolder = (*passthroughHandle)(nil)
	_ fdHolder = (*directHandle)(nil)
)

// fd is the handle's descriptor, for calls through the handle
// (ftruncate, fallocate), which act on the file also after an unlink.
func (h *handle) fd() *buffer.Fd { return h.bfd }

func (h *handle) Flush(ctx context.Context) syscall.Errno {
	if fd := h.orphan(); fd != nil {
		fd.Sync()
		return 0
	}
	return h.node.flush(h.writable)
}

func (h *handle) Release(ctx context.Context) syscall.Errno {
	if fd := h.orphan(); fd != nil {
		fd.Sync() // what its client wrote is charged; the last close frees it all
	}
	h.release()
	h.node.sync()
	return 0
}

// releaser is a handle that holds something to give back even when no
// RELEASE comes (a Create that fails after making its handle).
type releaser interface{ release() }

func (h *handle) release() { h.bfd.Close() }

// Lseek answers SEEK_DATA and SEEK_HOLE (the kernel asks the daemon for
// those) from the file itself.
func (h *handle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	n, err := h.bfd.Seek(int64(off), int(whence))
	if err != nil {
		return 0, toErrno(h.node.fsys.log, "lseek", err)
	}
	return uint64(n), 0
}

// orphan is the descriptor to act on when the file was unlinked (nothing
// is registered any more), else nil.
func (h *handle) orphan() *buffer.Fd {
	if h.node.f.Unlinked() {
		return h.bfd
	}
	return nil
}

// passthroughHandle hands the kernel the buffer's file: reads, writes and
// mmap go to the registered pages without the daemon. Writes past EOF grow
// the file unseen; flush and release learn the new size.
type passthroughHandle struct{ handle }

var (
	_ = (fusefs.FilePassthroughFder)((*passthroughHandle)(nil))
	_ = (fusefs.FileFlusher)((*passthroughHandle)(nil))
	_ = (fusefs.FileReleaser)((*passthroughHandle)(nil))
)

func (h *passthroughHandle) PassthroughFd() (int, bool) { return h.bfd.N, true }

// directHandle serves reads and writes through the daemon (degraded mode:
// no passthrough). Opened with FOPEN_DIRECT_IO, so the kernel keeps no
// stale copy and MAP_SHARED fails with ENODEV.
type directHandle struct{ handle }

var (
	_ = (fusefs.FileReader)((*directHandle)(nil))
	_ = (fusefs.FileWriter)((*directHandle)(nil))
	_ = (fusefs.FileFlusher)((*directHandle)(nil))
	_ = (fusefs.FileReleaser)((*directHandle)(nil))
)

func (h *directHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n, err := h.bfd.ReadAt(dest, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, toErrno(h.node.fsys.log, "read", err)
	}
	return fuse.ReadResultData(dest[:n]), 0
}

func (h *directHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	n, err := h.bfd.WriteAt(data, off)
	if err != nil {
		return uint32(n), toErrno(h.node.fsys.log, "write", err)
	}
	h.node.f.Touch(true)
	return uint32(n), 0
}
