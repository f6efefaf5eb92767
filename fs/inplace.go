package fs

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/source"
	"mrfs/tree"
	"mrfs/verbs"
)

// Registration in place (DESIGN.md "Memory you bring"): `ln -s SOURCE
// DIR/NAME`, or the directory attribute user.mrfs.register that `mrfs
// register` sets, makes NAME a buffer file of SOURCE's own pages.

// xattrRegister is set on a directory to register a source in place
// with an access of its own: {"name": ..., "source": ..., "access": ...}.
const xattrRegister = xattrPrefix + "register"

var _ = (fusefs.NodeReadlinker)((*bufferNode)(nil))

// Symlink registers target in place as name. What it makes is a buffer
// file, not a link; but the kernel takes a SYMLINK reply only for a link,
// so the reply is a link node of its own that the kernel may not keep
// (timeouts 0): the next lookup of name finds the file.
//
// A target that is a JSON object, {"source": PATH, "access": FLAGS}, is
// `mrfs register`'s request where it cannot set user.mrfs.register: in a
// sticky directory the kernel lets only the directory's owner set its
// attributes, but anyone who may write it make a link.
func (n *dirNode) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fusefs.Inode, syscall.Errno) {
	src, access, err := parseLinkTarget(target)
	if err == nil {
		_, err = n.register(ctx, name, src, access)
	}
	if err != nil {
		return nil, toErrno(n.fsys.log, "register "+target+" in place as "+name, err)
	}
	// The link's inode number is its own: node ids are inode numbers,
	// and the kernel must not see the file's change its type.
	link := n.NewInode(ctx, &fusefs.Inode{}, fusefs.StableAttr{Mode: syscall.S_IFLNK, Ino: n.fsys.Tree.NewIno()})
	out.Mode = syscall.S_IFLNK | 0o777
	out.Size = uint64(len(target))
	out.SetEntryTimeout(0)
	out.SetAttrTimeout(0)
	return link, 0
}

// Readlink: a file registered in place is not a link.
func (n *bufferNode) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	return nil, syscall.EINVAL
}

// registerRequest is user.mrfs.register's value (a link's target has no
// name: the link's is).
type registerRequest struct {
	Name   string  `json:"name"`
	Source string  `json:"source"`
	Access *string `json:"access"`
}

// access is the request's access, nil when it gives none.
func (r registerRequest) access() (*verbs.Access, error) {
	if r.Access == nil {
		return nil, nil
	}
	a, err := verbs.ParseAccess(*r.Access)
	if err != nil {
		return nil, err
	}
	return &a, nil
}

// parseLinkTarget is a link's source and access: the target itself, or
// the request of a target that is a JSON object.
func parseLinkTarget(target string) (string, *verbs.Access, error) {
	if !strings.HasPrefix(target, "{") {
		return target, nil, nil
	}
	var r registerRequest
	if err := json.Unmarshal([]byte(target), &r); err != nil || r.Name != "" || r.Source == "" {
		return "", nil, fmt.Errorf("a link target that is a JSON object is {\"source\": PATH, \"access\": FLAGS}: %w", syscall.EINVAL)
	}
	a, err := r.access()
	return r.Source, a, err
}

func (n *dirNode) setRegister(ctx context.Context, data []byte) syscall.Errno {
	var r registerRequest
	err := json.Unmarshal(data, &r)
	if err != nil {
		err = fmt.Errorf("%s is {\"name\": NAME, \"source\": PATH, \"access\": FLAGS}: %w", xattrRegister, syscall.EINVAL)
	}
	var access *verbs.Access
	if err == nil {
		access, err = r.access()
	}
	var f *tree.File
	if err == nil {
		f, err = n.register(ctx, r.Name, r.Source, access)
	}
	if err == nil {
		// The kernel may hold the name as absent (a lookup cached): tell
		// it, once this request (which holds the directory's lock) is
		// answered.
		n.fsys.forget.now(f)
	}
	return toErrno(n.fsys.log, "register "+r.Source+" in place as "+r.Name, err)
}

// register opens target as the caller would, for writing when the
// access asked writes, and makes name of it in n's directory. The file
// is its caller's alone (0600; 0400 when read-only): the source's pages
// are as private as the caller keeps them.
func (n *dirNode) register(ctx context.Context, name, target string, access *verbs.Access) (*tree.File, error) {
	c := caller(ctx)
	f, err := n.registerAs(ctx, c, name, target, access)
	if err != nil {
		// The caller's tool sees an errno only: the why is here.
		n.fsys.log.Info("registration in place refused", "name", name, "source", target, "uid", c.UID, "err", err)
	}
	return f, err
}

func (n *dirNode) registerAs(ctx context.Context, c tree.Caller, name, target string, access *verbs.Access) (*tree.File, error) {
	a := n.dir.Domain().DefaultAccess()
	if access != nil {
		a = *access
	}
	var pid uint32
	if fc, ok := fuse.FromContext(ctx); ok {
		pid = fc.Pid
	}
	if err := tree.CheckName(name); err != nil {
		return nil, err
	}
	src, err := source.Open(target, source.Caller{UID: c.UID, GID: c.GID, Groups: c.Groups, PID: pid, CapEff: procCapEff(pid)}, a.Writable())
	if err != nil {
		return nil, err
	}
	mode := uint32(0o600)
	if !a.Writable() {
		mode = 0o400
	}
	// Its FUSE node is made when the kernel looks the name up.
	f, err := n.dir.Register(reqOf(ctx), name, c.Owner, mode, src, access, nil)
	if err != nil {
		return nil, err
	}
	n.fsys.log.Info("registered in place", "name", name, "source", target, "pd", n.dir.Domain().PD(), "access", a.String())
	return f, nil
}
