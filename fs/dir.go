package fs

import (
	"context"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/tree"
)

// dirNode is the FUSE inode of a directory (a protection domain).
type dirNode struct {
	fusefs.Inode
	fsys *filesystem
	dir  *tree.Dir
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

// newDirNode makes d's FUSE node and keeps it in d's Aux slot.
func newDirNode(fsys *filesystem, d *tree.Dir) *dirNode {
	n := &dirNode{fsys: fsys, dir: d}
	d.SetAux(n)
	return n
}

// dirAttrTimeout: a directory's attributes change only through requests
// the kernel itself sends, so it may cache them; this saves GETATTRs of
// the parent on every create and unlink (default_permissions checks).
const dirAttrTimeout = time.Second

// entryTimeout is how long the kernel may trust a name, and the absence
// of one: names change only through this mount's own requests, which the
// kernel sees, so a cached name is never wrong. It saves the LOOKUP
// before a create (the name was absent) and before an unlink.
const entryTimeout = time.Minute

func (n *dirNode) Getattr(ctx context.Context, f fusefs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	n.fillDirAttr(&out.Attr)
	out.SetTimeout(dirAttrTimeout)
	return 0
}

func (n *dirNode) fillDirAttr(out *fuse.Attr) {
	fillMeta(n.dir, out)
	out.Nlink = n.dir.Nlink()
	out.Size = 4096
}

func (n *dirNode) Setattr(ctx context.Context, f fusefs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if _, ok := in.GetSize(); ok {
		return syscall.EISDIR
	}
	if err := n.dir.SetMeta(change(in)); err != nil {
		return toErrno(n.fsys.log, "setattr", err)
	}
	n.Getattr(ctx, f, out)
	// The kernel takes the inode number of every reply, and go-fuse fills
	// it only in GETATTR's: without it stat shows 0 until the next one.
	out.Ino = n.StableAttr().Ino
	return 0
}

// Lookup answers from the tree, not go-fuse's own children: with entry
// timeouts of 0 the kernel revalidates names with LOOKUPs that are not
// serialized against UNLINK and RENAME, and go-fuse's default lookup
// would put back a node they just removed.
func (n *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	if n.fsys.OnLookup != nil {
		n.fsys.OnLookup(name)
	}
	c, err := n.dir.Lookup(name)
	if err != nil {
		return nil, toErrno(n.fsys.log, "lookup", err)
	}
	switch c := c.(type) {
	case *tree.File:
		child := n.fileNode(ctx, name, c)
		child.sync()
		child.fillEntry(out)
		n.fsys.forget.add(c)
		return &child.Inode, 0
	default:
		d := c.(*tree.Dir).Aux().(*dirNode)
		d.fillDirAttr(&out.Attr)
		out.SetAttrTimeout(dirAttrTimeout)
		out.SetEntryTimeout(entryTimeout)
		return &d.Inode, 0
	}
}

// fileNode is f's FUSE node: the one go-fuse holds under name, or a new
// one when the kernel has forgotten the file (forget.go) or never knew
// it. Two lookups racing to make one end up with the same: go-fuse keeps
// the first node registered for an inode number.
func (n *dirNode) fileNode(ctx context.Context, name string, f *tree.File) *bufferNode {
	if in := n.GetChild(name); in != nil {
		if b, ok := in.Operations().(*bufferNode); ok && b.f == f {
			return b
		}
	}
	child := &bufferNode{fsys: n.fsys, f: f}
	n.newFileInode(ctx, child)
	return child
}

// newFileInode gives child its go-fuse inode, under its file's inode
// number (the tree's: the same each time the kernel is given the file).
// It is not persistent: go-fuse drops it at the kernel's FORGET.
func (n *dirNode) newFileInode(ctx context.Context, child *bufferNode) *fusefs.Inode {
	return n.NewInode(ctx, child, fusefs.StableAttr{Mode: syscall.S_IFREG, Ino: child.f.Ino()})
}

func (n *dirNode) Readdir(ctx context.Context) (fusefs.DirStream, syscall.Errno) {
	entries := n.dir.Entries()
	list := make([]fuse.DirEntry, 0, len(entries))
	for _, e := range entries {
		mode := uint32(syscall.S_IFREG)
		if _, ok := e.Node.(*tree.Dir); ok {
			mode = syscall.S_IFDIR
		}
		list = append(list, fuse.DirEntry{Name: e.Name, Mode: mode, Ino: e.Node.Ino()})
	}
	return fusefs.NewListDirStream(list), 0
}

// Create makes a buffer file (tree.Dir.Create) and opens it.
func (n *dirNode) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, fusefs.FileHandle, uint32, syscall.Errno) {
	var (
		child     *bufferNode
		fh        fusefs.FileHandle
		fuseFlags uint32
	)
	f, err := n.dir.Create(reqOf(ctx), name, owner(fuse.FromContext(ctx)), mode, func(f *tree.File) error {
		child = &bufferNode{fsys: n.fsys, f: f}
		var err error
		fh, fuseFlags, err = child.newHandle(flags)
		return err
	})
	if err != nil {
		if r, ok := fh.(releaser); ok {
			r.release()
		}
		return nil, nil, 0, toErrno(n.fsys.log, "create "+name, err)
	}
	in := n.newFileInode(ctx, child)
	child.holdInode()
	child.fillEntry(out)
	n.fsys.forget.add(f)
	n.fsys.log.Debug("created", "name", name, "pd", n.dir.Domain().PD(), "size", f.Buffer().Info().Size)
	return in, fh, fuseFlags, 0
}

func (n *dirNode) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	var child *dirNode
	sub, err := n.dir.Mkdir(reqOf(ctx), name, owner(fuse.FromContext(ctx)), mode, func(d *tree.Dir) {
		child = newDirNode(n.fsys, d)
	})
	if err != nil {
		return nil, toErrno(n.fsys.log, "mkdir "+name, err)
	}
	in := n.NewPersistentInode(ctx, child, fusefs.StableAttr{Mode: syscall.S_IFDIR, Ino: sub.Ino()})
	child.fillDirAttr(&out.Attr)
	out.SetAttrTimeout(dirAttrTimeout)
	out.SetEntryTimeout(entryTimeout)
	n.fsys.log.Debug("pd allocated", "dir", name, "pd", sub.Domain().PD())
	return in, 0
}

func (n *dirNode) Rmdir(ctx context.Context, name string) syscall.Errno {
	return toErrno(n.fsys.log, "rmdir "+name, n.dir.Rmdir(reqOf(ctx), name))
}

func (n *dirNode) Unlink(ctx context.Context, name string) syscall.Errno {
	return toErrno(n.fsys.log, "unlink "+name, n.dir.Unlink(reqOf(ctx), name))
}

func (n *dirNode) Rename(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	dst, ok := newParent.(*dirNode)
	if !ok {
		return syscall.EXDEV
	}
	return toErrno(n.fsys.log, "rename "+name, n.dir.Rename(reqOf(ctx), name, dst.dir, newName, flags))
}

// Only buffers and directories exist in mrfs.
func (n *dirNode) Mknod(ctx context.Context, name string, mode uint32, dev uint32, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}

func (n *dirNode) Link(ctx context.Context, target fusefs.InodeEmbedder, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	return nil, syscall.EPERM
}
