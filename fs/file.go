package fs

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/buffer"
	"mrfs/tree"
)

// bufferNode is the FUSE inode of a regular file: a registered buffer.
// Its size is its store file's, learned by buffer.Sync at getattr,
// getxattr, flush and release. It lives while the kernel holds the file
// (go-fuse drops it at the FORGET): the file itself is the tree's.
type bufferNode struct {
	fusefs.Inode
	fsys *filesystem
	f    *tree.File

	mu sync.Mutex // guards: unhold, forgotten
	// unhold ends the hold on the buffer's memory that this node keeps
	// from its first zero-copy open until the kernel forgets it
	// (holdInode).
	unhold    func() (free func())
	forgotten bool
}

var (
	_ = (fusefs.NodeGetattrer)((*bufferNode)(nil))
	_ = (fusefs.NodeSetattrer)((*bufferNode)(nil))
	_ = (fusefs.NodeOpener)((*bufferNode)(nil))
	_ = (fusefs.NodeAllocater)((*bufferNode)(nil))
	_ = (fusefs.NodeFsyncer)((*bufferNode)(nil))
	_ = (fusefs.NodeOnForgetter)((*bufferNode)(nil))
)

// holdInode keeps the buffer's memory (and its charge) until the kernel
// forgets this node, once a zero-copy open made it: the client may map
// the file, and FUSE passthrough makes that a mapping of the daemon's
// own file, which outlives the descriptor. RELEASE comes at the close;
// the kernel's inode, and with it this node, stays until the munmap. So
// the memory of a file unlinked after its close, or a pool slot, is not
// freed, reused or uncharged under a mapping.
func (n *bufferNode) holdInode() {
	if !n.fsys.ZeroCopy {
		return // no client can map it shared
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.unhold == nil && !n.forgotten {
		n.unhold = n.f.Buffer().HoldInode()
	}
}

// OnForget comes at the kernel's FORGET: no descriptor and no mapping
// of the file is left in the kernel.
func (n *bufferNode) OnForget() {
	n.mu.Lock()
	unhold := n.unhold
	n.unhold, n.forgotten = nil, true
	n.mu.Unlock()
	if unhold == nil {
		return
	}
	if free := unhold(); free != nil {
		// Off the request loop: freeing truncates the file or zeroes
		// the slot. Only the last hold of a removed file gets here.
		go free()
	}
}

func (n *bufferNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	if fd := n.orphanFd(f); fd != nil {
		fd.Sync() // an unlinked file's charge follows what its client wrote
	} else {
		n.sync()
	}
	n.fillAttr(&out.Attr)
	n.fillOrphanSize(f, &out.Attr)
	out.SetTimeout(n.attrTimeout())
	return 0
}

// attrTimeout is how long the kernel may trust the file's attributes.
// A file's size can change through a zero-copy open without the kernel
// hearing of it, and stat must show it: 0. A pool file's cannot (its
// slot is sealed), so its attributes change only through this mount's
// own requests, as a directory's do; trusting them saves a GETATTR at
// its first write.
func (n *bufferNode) attrTimeout() time.Duration {
	if n.f.Buffer().InPool() {
		return dirAttrTimeout
	}
	return 0
}

// orphanFd is, for a file already unlinked, the descriptor an open
// handle f holds, else nil. The buffer is freed then (its region
// deregistered, its file out of the store), but the client still has the
// memory: fstat, ftruncate and fallocate through f act on it, as on any
// unlinked file.
func (n *bufferNode) orphanFd(f fusefs.FileHandle) *buffer.Fd {
	switch h := f.(type) {
	case *passthroughHandle:
		return h.orphan()
	case *directHandle:
		return h.orphan()
	}
	return nil
}

func (n *bufferNode) fillOrphanSize(f fusefs.FileHandle, out *fuse.Attr) {
	if fd := n.orphanFd(f); fd != nil {
		if size, err := fd.Size(); err == nil {
			out.Size = size
			out.Blocks = (size + 511) / 512
		}
	}
}

// sync learns the store file's size. A failure to re-register (a limit
// hit by a write past EOF) is recorded in the buffer's state
// (user.mrfs.state); only a writer's close is told of it (see flush).
func (n *bufferNode) sync() error {
	err := n.f.Buffer().Sync()
	if err != nil {
		n.fsys.log.Debug("sync", "err", err)
	}
	return err
}

// flush is the close() of a handle: a writer learns there that what it
// wrote could not be registered, or was taken back, past its owner's
// quota (buffer.Flush).
// A buffer already freed (unlinked, or the mount shutting down) has
// nothing left to register: its writer closes cleanly.
func (n *bufferNode) flush(writable bool) syscall.Errno {
	if !writable {
		n.sync()
		return 0
	}
	err := n.f.Buffer().Flush()
	if err == nil || errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENODEV) {
		return 0
	}
	return toErrno(n.fsys.log, "flush", err)
}

func (n *bufferNode) fillAttr(out *fuse.Attr) {
	fillMeta(n.f, out)
	size := n.f.Buffer().Info().Size
	out.Size = size
	out.Blocks = (size + 511) / 512
	out.Blksize = 4096
	out.Nlink = 1
	if n.f.Unlinked() {
		out.Nlink = 0 // still open somewhere
	}
}

func (n *bufferNode) fillEntry(out *fuse.EntryOut) {
	n.fillAttr(&out.Attr)
	out.SetAttrTimeout(n.attrTimeout())
	out.SetEntryTimeout(entryTimeout) // the name may be cached
}

func (n *bufferNode) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	size, sizeSet := in.GetSize()
	if sizeSet {
		var err error
		if h, ok := f.(fdHolder); ok {
			err = h.fd().Truncate(ctx, size) // also after an unlink
		} else {
			err = n.f.Buffer().Resize(ctx, size)
		}
		if err != nil {
			return toErrno(n.fsys.log, "truncate", err)
		}
		n.f.Touch(true)
	}
	// A truncate alone has its times from Touch, and, as a write's, they
	// are not journaled (a record less in a create's cycle).
	if c := change(in); c != (tree.Change{}) || !sizeSet {
		if err := n.f.SetMeta(c); err != nil {
			return toErrno(n.fsys.log, "setattr", err)
		}
	}
	n.fillAttr(&out.Attr)
	n.fillOrphanSize(f, &out.Attr)
	out.SetTimeout(n.attrTimeout())
	// The kernel takes the inode number of every reply, and go-fuse fills
	// it only in GETATTR's: without it stat shows 0 until the next one.
	out.Ino = n.StableAttr().Ino
	return 0
}

func (n *bufferNode) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	if flags&syscall.O_TRUNC != 0 {
		// O_TRUNC comes here (CAP_ATOMIC_O_TRUNC), not as a truncate to
		// 0: a pool file's is a zeroed slot of the same size.
		if err := n.f.Buffer().Clear(ctx); err != nil {
			return nil, 0, toErrno(n.fsys.log, "open O_TRUNC", err)
		}
		n.f.Touch(true)
	}
	fh, fuseFlags, err := n.newHandle(flags)
	if err != nil {
		return nil, 0, toErrno(n.fsys.log, "open", err)
	}
	n.holdInode()
	return fh, fuseFlags, 0
}

// newHandle returns the one kind of handle this mount uses: passthrough,
// or direct I/O in degraded mode. Mixing them on an inode makes the
// kernel fail opens with EIO.
//
// Each handle holds a descriptor of the buffer's file opened for it (the
// daemon keeps none per buffer): go-fuse registers a passthrough one with
// the kernel after Open returns, and after an unlink it is the open
// file's only way to its memory.
func (n *bufferNode) newHandle(flags uint32) (fusefs.FileHandle, uint32, error) {
	writable := flags&syscall.O_ACCMODE != syscall.O_RDONLY
	fd, err := n.f.Buffer().Open(writable)
	if err != nil {
		return nil, 0, err
	}
	h := handle{node: n, writable: writable, bfd: fd}
	if !n.fsys.ZeroCopy {
		return &directHandle{h}, fuse.FOPEN_DIRECT_IO, nil
	}
	return &passthroughHandle{h}, 0, nil
}

func (n *bufferNode) Allocate(ctx context.Context, f fusefs.FileHandle, off uint64, size uint64, mode uint32) syscall.Errno {
	var err error
	if h, ok := f.(fdHolder); ok {
		err = h.fd().Allocate(ctx, off, size, mode) // also after an unlink
	} else {
		err = n.f.Buffer().Allocate(ctx, off, size, mode)
	}
	if err != nil {
		return toErrno(n.fsys.log, "fallocate", err)
	}
	n.f.Touch(true)
	return 0
}

// Fsync has nothing to do: the bytes are memory.
func (n *bufferNode) Fsync(ctx context.Context, f fusefs.FileHandle, flags uint32) syscall.Errno {
	return 0
}
