// Package fs is mrfs's FUSE tree. It only translates FUSE calls: every
// directory is a protection domain (buffer.Domain), every regular file a
// registered buffer (buffer.Buffer); the lifecycle rules live in package
// buffer, errors become errnos in errno.go.
//
// Opens of buffers are FUSE passthrough opens of the buffer's memfd, so
// read, write and mmap go straight to the registered pages. In degraded
// mode (Options.ZeroCopy false) every open is direct I/O through the
// daemon instead, and mmap fails with ENODEV. The two are never mixed.
package fs

import (
	"log/slog"
	"sync"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/buffer"
	"mrfs/verbs"
)

// Options configure the tree.
type Options struct {
	Manager     *buffer.Manager
	Backend     string // the verbs backend's name, for user.mrfs.stats
	ZeroCopy    bool   // passthrough opens; false: direct I/O, no mmap
	Umask       uint32 // applied to the mode a creator asks for
	DefaultSize uint64 // bytes a new file gets
	// DefaultAccess is the default_access of a new directory; the root's
	// is set by the caller when it allocates the root domain.
	DefaultAccess verbs.Access
	Log           *slog.Logger
	// Remote says where peers reach the mount's PDs, e.g.
	// "tcp 127.0.0.1:7471", or "" when remote access is off; it is asked
	// at every read of user.mrfs.remote, since the transport may start
	// after the mount. nil: off.
	Remote func() string
}

// filesystem is what every node shares.
//
// Lock order: treeMu, then a node's metaNode.mu or its buffer's locks;
// never the reverse, so nothing holding a node or buffer lock may look up
// names.
type filesystem struct {
	Options
	mgr *buffer.Manager
	log *slog.Logger

	treeMu sync.RWMutex // guards: every dirNode.entries (the namespace)
}

// maxNameLen is NAME_MAX, as statfs reports it.
const maxNameLen = 255

// meta is the POSIX metadata mrfs keeps for a node; sizes come from the
// buffer.
type meta struct {
	mode  uint32 // permission bits only
	uid   uint32
	gid   uint32
	atime time.Time
	mtime time.Time
	ctime time.Time
}

func newMeta(caller *fuse.Caller, perm uint32) meta {
	now := time.Now()
	m := meta{mode: perm, atime: now, mtime: now, ctime: now}
	if caller != nil {
		m.uid, m.gid = caller.Uid, caller.Gid
	}
	return m
}

// fill writes m into a FUSE attribute.
func (m *meta) fill(out *fuse.Attr) {
	out.Mode = m.mode
	out.Owner = fuse.Owner{Uid: m.uid, Gid: m.gid}
	out.SetTimes(&m.atime, &m.mtime, &m.ctime)
}

// setattr applies the non-size parts of a SETATTR.
func (m *meta) setattr(in *fuse.SetAttrIn) {
	now := time.Now()
	if mode, ok := in.GetMode(); ok {
		// No set-id bits: the mount clears nothing on write
		// (HANDLE_KILLPRIV_V2 makes that the daemon's job), so never
		// store them.
		m.mode = mode & 0o1777
	}
	if uid, ok := in.GetUID(); ok {
		m.uid = uid
	}
	if gid, ok := in.GetGID(); ok {
		m.gid = gid
	}
	if t, ok := in.GetATime(); ok {
		m.atime = t
	}
	if t, ok := in.GetMTime(); ok {
		m.mtime = t
	}
	m.ctime = now
}

// metaNode is the metadata part shared by directories and buffer files.
type metaNode struct {
	mu   sync.Mutex // guards: meta
	meta meta
}

func (n *metaNode) fillAttr(out *fuse.Attr) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.meta.fill(out)
}

func (n *metaNode) touch(mtime bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now()
	n.meta.ctime = now
	if mtime {
		n.meta.mtime = now
	}
}

func (fsys *filesystem) perm(mode uint32) uint32 {
	return mode & 0o777 &^ fsys.Umask
}
