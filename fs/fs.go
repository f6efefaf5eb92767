// Package fs is mrfs's FUSE front end. It only translates FUSE calls:
// the namespace and its rules live in package tree (every directory a
// protection domain, every regular file a registered buffer), the
// buffer lifecycle in package buffer, and errors become errnos in
// errno.go.
//
// Opens of buffers are FUSE passthrough opens of the buffer's file in
// the store (one file per buffer in the mount's private tmpfs instance;
// a memfd only in the degraded mode without CAP_SYS_ADMIN), so read,
// write and mmap go straight to the registered pages. In degraded mode
// (Options.ZeroCopy false) every open is direct I/O through the daemon
// instead, and mmap fails with ENODEV. The two are never mixed.
package fs

import (
	"log/slog"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/buffer"
	"mrfs/tree"
)

// Options configure the front end.
type Options struct {
	Tree     *tree.Tree
	Backend  string // the verbs backend's name, for user.mrfs.stats
	ZeroCopy bool   // passthrough opens; false: direct I/O, no mmap
	Log      *slog.Logger
	// Remote says where peers reach the mount's PDs, e.g.
	// "tcp 127.0.0.1:7471", or "" when remote access is off; it is asked
	// at every read of user.mrfs.remote, since the transport may start
	// after the mount. nil: off.
	Remote func() string
	// Gone is the mount's devices that left and have not come back
	// (verbs/multi), for user.mrfs.state and stats. nil: none.
	Gone func() []string
	// Upgrade starts an upgrade in place to binary ("" the running
	// one's path) and returns at once (user.mrfs.upgrade, DESIGN,
	// Restart); an error is one found before it starts. nil: none.
	Upgrade func(binary string) error
	// Life is the daemon's start, the restarts the mount survived and
	// the last upgrade's failure, for stats. nil: unknown.
	Life func() Life
	// OnBacking is told each change of the backing id the kernel holds
	// for a node's passthrough opens (0: none): the journal's, which a
	// daemon restarted after a crash needs. nil: none.
	OnBacking func(node uint64, id int32)
	// OnDone is told, before its reply, each request that changed the
	// namespace (its FUSE unique), once applied: a test hook's (the tree
	// journals the request with the change), which may hold the reply
	// back for good (true). nil: none.
	OnDone func(unique uint64) (hold bool)
	// OnLookup is told each name looked up before it is answered (a test
	// hook's). nil: none.
	OnLookup func(name string)
	// OnServe is called with the daemon's descriptor of the connection
	// and the kernel's INIT once the connection is made or adopted,
	// before the first request is read (a keeper is handed them: no
	// request can end this daemon before). nil: none; not called for a
	// connection fusermount made.
	OnServe func(conn int, init []byte)
}

// Life is what stats say of the daemon's life.
type Life struct {
	Started      time.Time
	Restarts     int
	UpgradeError string
}

// filesystem is what every node shares.
type filesystem struct {
	Options
	mgr    *buffer.Manager
	log    *slog.Logger
	forget *forgetter
}

// fillMeta writes a node's metadata into a FUSE attribute.
func fillMeta(n tree.Node, out *fuse.Attr) {
	m := n.Meta()
	out.Mode = m.Mode
	out.Owner = fuse.Owner{Uid: m.UID, Gid: m.GID}
	out.SetTimes(&m.Atime, &m.Mtime, &m.Ctime)
}

// change is the metadata part of a SETATTR.
func change(in *fuse.SetAttrIn) tree.Change {
	var c tree.Change
	if mode, ok := in.GetMode(); ok {
		c.Mode = &mode
	}
	if uid, ok := in.GetUID(); ok {
		c.UID = &uid
	}
	if gid, ok := in.GetGID(); ok {
		c.GID = &gid
	}
	if t, ok := in.GetATime(); ok {
		c.Atime = &t
	}
	if t, ok := in.GetMTime(); ok {
		c.Mtime = &t
	}
	return c
}

// owner is who makes a node: the caller of the request.
func owner(caller *fuse.Caller, ok bool) tree.Owner {
	if !ok {
		return tree.Owner{}
	}
	return tree.Owner{UID: caller.Uid, GID: caller.Gid}
}
