package fs

import (
	"context"
	"sort"
	"syscall"
	"time"

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
	// entries is the directory's namespace, guarded by fsys.treeMu. It,
	// not go-fuse's tree, answers LOOKUP and READDIR: with entry timeouts
	// of 0 the kernel revalidates names with LOOKUPs that are not
	// serialized against UNLINK and RENAME, and go-fuse's default lookup
	// puts the node it found back under the name after they removed it.
	entries map[string]fusefs.InodeEmbedder
}

func newDirNode(fsys *filesystem, dom *buffer.Domain, m meta) *dirNode {
	d := &dirNode{fsys: fsys, dom: dom, entries: map[string]fusefs.InodeEmbedder{}}
	d.meta = m
	return d
}

var (
	_ = (fusefs.NodeLookuper)((*dirNode)(nil))
	_ = (fusefs.NodeReaddirer)((*dirNode)(nil))
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

// dirAttrTimeout: a directory's attributes change only through requests
// the kernel itself sends, so it may cache them; this saves GETATTRs of
// the parent on every create and unlink (default_permissions checks).
const dirAttrTimeout = time.Second

func (d *dirNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	d.fillDirAttr(&out.Attr)
	out.SetTimeout(dirAttrTimeout)
	return 0
}

func (d *dirNode) fillDirAttr(out *fuse.Attr) {
	d.fillAttr(out)
	out.Nlink = 2
	out.Size = 4096
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

// Lookup answers from the directory's own namespace.
func (d *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	d.fsys.treeMu.RLock()
	child := d.entries[name]
	d.fsys.treeMu.RUnlock()
	switch c := child.(type) {
	case *bufferNode:
		c.sync()
		c.fillEntry(out)
	case *dirNode:
		c.fillDirAttr(&out.Attr)
		out.SetAttrTimeout(dirAttrTimeout)
	default:
		return nil, syscall.ENOENT
	}
	return child.EmbeddedInode(), 0
}

func (d *dirNode) Readdir(ctx context.Context) (fusefs.DirStream, syscall.Errno) {
	d.fsys.treeMu.RLock()
	list := make([]fuse.DirEntry, 0, len(d.entries))
	for name, child := range d.entries {
		in := child.EmbeddedInode()
		list = append(list, fuse.DirEntry{Name: name, Mode: in.Mode(), Ino: in.StableAttr().Ino})
	}
	d.fsys.treeMu.RUnlock()
	sort.Slice(list, func(i, j int) bool { return list[i].Name < list[j].Name })
	return fusefs.NewListDirStream(list), 0
}

// Create makes a buffer of the configured default size, registered in
// this directory's PD with its default access.
func (d *dirNode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	if len(name) > maxNameLen {
		return nil, nil, 0, syscall.ENAMETOOLONG
	}
	// Registration can take long: it happens outside the tree lock.
	buf, err := d.fsys.mgr.Create(d.dom, d.fsys.DefaultSize)
	if err != nil {
		return nil, nil, 0, toErrno(d.fsys.log, "create "+name, err)
	}
	caller, _ := fuse.FromContext(ctx)
	n := &bufferNode{fsys: d.fsys, buf: buf}
	n.meta = newMeta(caller, d.fsys.perm(mode))
	fh, fuseFlags, err := n.newHandle(flags)
	if err == nil {
		d.fsys.treeMu.Lock()
		if d.entries[name] != nil {
			err = syscall.EEXIST // created meanwhile by another client
		} else {
			d.entries[name] = n
		}
		d.fsys.treeMu.Unlock()
	}
	if err != nil {
		if r, ok := fh.(releaser); ok {
			r.release()
		}
		buf.Free()
		return nil, nil, 0, toErrno(d.fsys.log, "create "+name, err)
	}
	child := d.NewPersistentInode(ctx, n, fusefs.StableAttr{Mode: syscall.S_IFREG})
	n.fillEntry(out)
	d.touch(true)
	d.fsys.log.Debug("created", "name", name, "pd", d.dom.PD(), "size", buf.Info().Size)
	return child, fh, fuseFlags, 0
}

func (d *dirNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if len(name) > maxNameLen {
		return nil, syscall.ENAMETOOLONG
	}
	dom, err := d.fsys.mgr.NewDomain(d.fsys.DefaultAccess)
	if err != nil {
		return nil, toErrno(d.fsys.log, "mkdir "+name, err)
	}
	caller, _ := fuse.FromContext(ctx)
	n := newDirNode(d.fsys, dom, newMeta(caller, d.fsys.perm(mode)))
	d.fsys.treeMu.Lock()
	exists := d.entries[name] != nil
	if !exists {
		d.entries[name] = n
	}
	d.fsys.treeMu.Unlock()
	if exists {
		dom.Close()
		return nil, syscall.EEXIST
	}
	child := d.NewPersistentInode(ctx, n, fusefs.StableAttr{Mode: syscall.S_IFDIR})
	n.fillDirAttr(&out.Attr)
	out.SetAttrTimeout(dirAttrTimeout)
	d.touch(true)
	d.fsys.log.Debug("pd allocated", "dir", name, "pd", dom.PD())
	return child, 0
}

// Rmdir deallocates the directory's PD; ENOTEMPTY while it holds
// anything. Remote peers attached to the PD are disconnected.
func (d *dirNode) Rmdir(ctx context.Context, name string) syscall.Errno {
	d.fsys.treeMu.Lock()
	defer d.fsys.treeMu.Unlock()
	sub, ok := d.entries[name].(*dirNode)
	switch {
	case d.entries[name] == nil:
		return syscall.ENOENT
	case !ok:
		return syscall.ENOTDIR
	case len(sub.entries) > 0:
		return syscall.ENOTEMPTY
	}
	if err := sub.dom.Close(); err != nil {
		return toErrno(d.fsys.log, "rmdir "+name, err)
	}
	delete(d.entries, name)
	d.touch(true)
	return 0
}

// Unlink deregisters the buffer at once; its memory goes when the last
// client lets go (the kernel holds the memfd for open files and maps).
func (d *dirNode) Unlink(ctx context.Context, name string) syscall.Errno {
	d.fsys.treeMu.Lock()
	defer d.fsys.treeMu.Unlock()
	n, ok := d.entries[name].(*bufferNode)
	switch {
	case d.entries[name] == nil:
		return syscall.ENOENT
	case !ok:
		return syscall.EISDIR
	}
	if err := n.buf.Free(); err != nil {
		return toErrno(d.fsys.log, "unlink "+name, err)
	}
	delete(d.entries, name)
	d.touch(true)
	return 0
}

// Rename renames; a buffer moved to another directory is re-registered in
// that directory's PD first, and an entry renamed over is released last,
// so a failure changes nothing.
func (d *dirNode) Rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	dst, ok := newParent.(*dirNode)
	if !ok {
		return syscall.EXDEV
	}
	if len(newName) > maxNameLen {
		return syscall.ENAMETOOLONG
	}
	d.fsys.treeMu.Lock()
	defer d.fsys.treeMu.Unlock()
	src := d.entries[name]
	if src == nil {
		return syscall.ENOENT
	}
	old := dst.entries[newName]
	if old == src {
		return 0
	}
	// The kernel refuses moving a directory into its own subtree.
	_, srcIsDir := src.(*dirNode)
	switch {
	case flags&unix.RENAME_EXCHANGE != 0:
		if old == nil {
			return syscall.ENOENT
		}
		// Exchanging buffers between PDs would need two moves that can
		// each fail halfway; nothing asks for it.
		_, srcBuf := src.(*bufferNode)
		_, oldBuf := old.(*bufferNode)
		if d.dom != dst.dom && (srcBuf || oldBuf) {
			return syscall.EINVAL
		}
		d.entries[name], dst.entries[newName] = old, src
		d.touch(true)
		dst.touch(true)
		return 0
	case flags&^uint32(unix.RENAME_NOREPLACE) != 0:
		return syscall.EINVAL
	case flags&unix.RENAME_NOREPLACE != 0 && old != nil:
		return syscall.EEXIST
	}

	switch o := old.(type) {
	case *bufferNode:
		if srcIsDir {
			return syscall.ENOTDIR
		}
	case *dirNode:
		if !srcIsDir {
			return syscall.EISDIR
		}
		if len(o.entries) > 0 {
			return syscall.ENOTEMPTY
		}
	}
	if n, ok := src.(*bufferNode); ok && d.dom != dst.dom {
		if err := n.buf.Move(dst.dom); err != nil {
			return toErrno(d.fsys.log, "move "+name, err)
		}
	}
	if old != nil {
		var err error
		switch o := old.(type) {
		case *bufferNode:
			err = o.buf.Free()
		case *dirNode:
			err = o.dom.Close()
		}
		if err != nil {
			// The move (if any) already happened; the replaced object
			// could not be released, which leaves it to teardown.
			d.fsys.log.Error("rename: releasing the replaced entry failed", "name", newName, "err", err)
		}
	}
	delete(d.entries, name)
	dst.entries[newName] = src
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
