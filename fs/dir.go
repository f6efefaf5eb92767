package fs

import (
	"context"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"mrfs/buffer"
)

// dirNode is a directory, and so a protection domain. The mount root is
// the default PD.
type dirNode struct {
	fusefs.Inode
	metaNode
	fsys *filesystem
	dom  *buffer.Domain
	root bool
}

var (
	_ = (fusefs.NodeGetattrer)((*dirNode)(nil))
	_ = (fusefs.NodeSetattrer)((*dirNode)(nil))
	_ = (fusefs.NodeCreater)((*dirNode)(nil))
	_ = (fusefs.NodeMkdirer)((*dirNode)(nil))
	_ = (fusefs.NodeRmdirer)((*dirNode)(nil))
	_ = (fusefs.NodeUnlinker)((*dirNode)(nil))
	_ = (fusefs.NodeRenamer)((*dirNode)(nil))
	_ = (fusefs.NodeMknoder)((*dirNode)(nil))
	_ = (fusefs.NodeSymlinker)((*dirNode)(nil))
	_ = (fusefs.NodeLinker)((*dirNode)(nil))
	_ = (fusefs.NodeStatfser)((*dirNode)(nil))
)

func (d *dirNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	d.fillAttr(&out.Attr)
	out.Nlink = 2
	out.Size = 4096
	return 0
}

func (d *dirNode) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if _, ok := in.GetSize(); ok {
		return syscall.EISDIR
	}
	d.mu.Lock()
	d.meta.setattr(in)
	d.mu.Unlock()
	return d.Getattr(ctx, f, out)
}

// Create makes a buffer of the configured default size, registered in
// this directory's PD with its default access.
func (d *dirNode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	buf, err := d.fsys.mgr.Create(d.dom, d.fsys.DefaultSize)
	if err != nil {
		return nil, nil, 0, toErrno(d.fsys.log, "create "+name, err)
	}
	caller, _ := fuse.FromContext(ctx)
	n := &bufferNode{fsys: d.fsys, buf: buf}
	n.meta = newMeta(caller, d.fsys.perm(mode))
	child := d.NewPersistentInode(ctx, n, fusefs.StableAttr{Mode: syscall.S_IFREG})
	fh, fuseFlags := n.newHandle(flags)
	n.fillEntry(out)
	d.touch(true)
	d.fsys.log.Debug("created", "name", name, "pd", d.dom.PD(), "size", buf.Info().Size)
	return child, fh, fuseFlags, 0
}

func (d *dirNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	dom, err := d.fsys.mgr.NewDomain(d.fsys.DefaultAccess)
	if err != nil {
		return nil, toErrno(d.fsys.log, "mkdir "+name, err)
	}
	caller, _ := fuse.FromContext(ctx)
	n := &dirNode{fsys: d.fsys, dom: dom}
	n.meta = newMeta(caller, d.fsys.perm(mode))
	child := d.NewPersistentInode(ctx, n, fusefs.StableAttr{Mode: syscall.S_IFDIR})
	var a fuse.AttrOut
	n.Getattr(ctx, nil, &a)
	out.Attr = a.Attr
	d.touch(true)
	d.fsys.log.Debug("pd allocated", "dir", name, "pd", dom.PD())
	return child, 0
}

// Rmdir deallocates the directory's PD; ENOTEMPTY while it holds
// anything.
func (d *dirNode) Rmdir(ctx context.Context, name string) syscall.Errno {
	child := d.GetChild(name)
	if child == nil {
		return syscall.ENOENT
	}
	sub, ok := child.Operations().(*dirNode)
	if !ok {
		return syscall.ENOTDIR
	}
	if len(child.Children()) > 0 {
		return syscall.ENOTEMPTY
	}
	if err := sub.dom.Close(); err != nil {
		return toErrno(d.fsys.log, "rmdir "+name, err)
	}
	d.touch(true)
	return 0
}

// Unlink deregisters the buffer at once; its memory goes when the last
// client lets go (the kernel holds the memfd for open files and maps).
func (d *dirNode) Unlink(ctx context.Context, name string) syscall.Errno {
	child := d.GetChild(name)
	if child == nil {
		return syscall.ENOENT
	}
	n, ok := child.Operations().(*bufferNode)
	if !ok {
		return syscall.EISDIR
	}
	if err := n.buf.Free(); err != nil {
		return toErrno(d.fsys.log, "unlink "+name, err)
	}
	d.touch(true)
	return 0
}

// Rename renames; a buffer moved to another directory is re-registered in
// that directory's PD first, and a buffer renamed over is freed last, so a
// failure changes nothing.
func (d *dirNode) Rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	dst, ok := newParent.(*dirNode)
	if !ok {
		return syscall.EXDEV
	}
	src := d.GetChild(name)
	if src == nil {
		return syscall.ENOENT
	}
	old := dst.GetChild(newName)
	if old == src {
		return 0
	}
	switch {
	case flags&unix.RENAME_EXCHANGE != 0:
		if old == nil {
			return syscall.ENOENT
		}
		// Exchanging buffers between PDs would need two moves that can
		// each fail halfway; nothing asks for it.
		_, srcBuf := src.Operations().(*bufferNode)
		_, oldBuf := old.Operations().(*bufferNode)
		if d.dom != dst.dom && (srcBuf || oldBuf) {
			return syscall.EINVAL
		}
		d.touch(true)
		dst.touch(true)
		return 0
	case flags&^uint32(unix.RENAME_NOREPLACE) != 0:
		return syscall.EINVAL
	case flags&unix.RENAME_NOREPLACE != 0 && old != nil:
		return syscall.EEXIST
	}

	var freeOld *bufferNode
	if old != nil {
		switch o := old.Operations().(type) {
		case *bufferNode:
			if src.IsDir() {
				return syscall.ENOTDIR
			}
			freeOld = o
		case *dirNode:
			if !src.IsDir() {
				return syscall.EISDIR
			}
			if len(old.Children()) > 0 {
				return syscall.ENOTEMPTY
			}
		}
	}
	if n, ok := src.Operations().(*bufferNode); ok && d.dom != dst.dom {
		if err := n.buf.Move(dst.dom); err != nil {
			return toErrno(d.fsys.log, "move "+name, err)
		}
	}
	if old != nil {
		var err error
		if freeOld != nil {
			err = freeOld.buf.Free()
		} else {
			err = old.Operations().(*dirNode).dom.Close()
		}
		if err != nil {
			// The move (if any) already happened; the replaced object
			// could not be released, which leaves it to teardown.
			d.fsys.log.Error("rename: releasing the replaced entry failed", "name", newName, "err", err)
		}
	}
	d.touch(true)
	dst.touch(true)
	return 0
}

// Only buffers and directories exist in mrfs.
func (d *dirNode) Mknod(ctx context.Context, name string, mode uint32, dev uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

func (d *dirNode) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

func (d *dirNode) Link(ctx context.Context, target fusefs.InodeEmbedder, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}
