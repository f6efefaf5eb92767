package fs

import (
	"context"
	"errors"
	"io"
	"mrfs/buffer"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// handle is what both kinds of open share.
type handle struct {
	node     *bufferNode
	writable bool // opened for writing: flush reports registration failures
}

func (h *handle) Flush(ctx context.Context) syscall.Errno {
	return h.node.flush(h.writable)
}

func (h *handle) Release(ctx context.Context) syscall.Errno {
	h.node.sync()
	return 0
}

// passthroughHandle hands the kernel the buffer's memfd: reads, writes and
// mmap go to the registered pages without the daemon. Writes past EOF grow
// the memfd unseen; flush and release learn the new size.
type passthroughHandle struct {
	handle
	fd *buffer.Fd // closed at release
}

var (
	_ = (fusefs.FilePassthroughFder)((*passthroughHandle)(nil))
	_ = (fusefs.FileFlusher)((*passthroughHandle)(nil))
	_ = (fusefs.FileReleaser)((*passthroughHandle)(nil))
)

func (h *passthroughHandle) PassthroughFd() (int, bool) { return h.fd.N, true }

func (h *passthroughHandle) Release(ctx context.Context) syscall.Errno {
	h.release()
	return h.handle.Release(ctx)
}

// releaser is a handle that holds something to give back even when no
// RELEASE comes (a Create that fails after making its handle).
type releaser interface{ release() }

func (h *passthroughHandle) release() { h.fd.Close() }

// directHandle serves reads and writes through the daemon (degraded mode:
// no passthrough). Opened with FOPEN_DIRECT_IO, so the kernel keeps no
// stale copy and MAP_SHARED fails with ENODEV.
type directHandle struct {
	handle
}

var (
	_ = (fusefs.FileReader)((*directHandle)(nil))
	_ = (fusefs.FileWriter)((*directHandle)(nil))
	_ = (fusefs.FileFlusher)((*directHandle)(nil))
	_ = (fusefs.FileReleaser)((*directHandle)(nil))
)

func (h *directHandle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n, err := h.node.buf.ReadAt(dest, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, toErrno(h.node.fsys.log, "read", err)
	}
	return fuse.ReadResultData(dest[:n]), 0
}

func (h *directHandle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	n, err := h.node.buf.WriteAt(data, off)
	if err != nil {
		return uint32(n), toErrno(h.node.fsys.log, "write", err)
	}
	h.node.f.Touch(true)
	return uint32(n), 0
}
