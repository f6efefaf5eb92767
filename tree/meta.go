package tree

import (
	"fmt"
	"syscall"
	"time"
)

// Meta is the POSIX metadata mrfs keeps for a node; a file's size comes
// from its buffer.
type Meta struct {
	Mode                uint32 // permission bits and the sticky bit, never set-id bits
	UID, GID            uint32
	Atime, Mtime, Ctime time.Time
}

// meta is Meta as a node keeps it: times in nanoseconds since the epoch,
// 48 bytes smaller than three time.Time (a node per buffer, a million
// buffers).
type meta struct {
	mode, uid, gid      uint32
	atime, mtime, ctime int64
}

func newMeta(owner Owner, mode uint32) meta {
	t := now().UnixNano()
	return meta{mode: mode, uid: owner.UID, gid: owner.GID, atime: t, mtime: t, ctime: t}
}

// Meta is a snapshot of the node's metadata.
func (n *node) Meta() Meta {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.metaLocked()
}

// metaLocked is Meta. Callers hold n.mu.
func (n *node) metaLocked() Meta {
	m := n.meta
	return Meta{Mode: m.mode, UID: m.uid, GID: m.gid,
		Atime: time.Unix(0, m.atime), Mtime: time.Unix(0, m.mtime), Ctime: time.Unix(0, m.ctime)}
}

// Change is a SETATTR's metadata part: the fields that are set change.
type Change struct {
	Mode         *uint32
	UID, GID     *uint32
	Atime, Mtime *time.Time
}

// SetMeta applies c and sets the change time.
func (d *Dir) SetMeta(c Change) error {
	d.setMeta(c, d.t.j)
	return nil
}

// SetMeta charges the buffer to a new owner first (chown moves the
// charge): when that uid's quota cannot hold it, EDQUOT and nothing
// changes. A file registered in place stays its registrant's alone: a
// mode for its group or others is EPERM (the source's own modes decided
// who may reach it, and a wider mode would pass that on to any user).
func (f *File) SetMeta(c Change) error {
	if c.Mode != nil && *c.Mode&0o077 != 0 && f.buf.InPlace() {
		return fmt.Errorf("mode 0%o: a file registered in place is for its registrant only (0600 or less): %w", *c.Mode&0o7777, syscall.EPERM)
	}
	if c.UID != nil {
		if err := f.buf.SetOwner(*c.UID); err != nil {
			return err
		}
	}
	f.setMeta(c, f.t.j)
	return nil
}

// setMeta applies c and tells j of the result, under n.mu: the last
// record of a node's metadata is its last change.
func (n *node) setMeta(c Change, j Journal) {
	n.mu.Lock()
	defer n.mu.Unlock()
	defer func() { j.Meta(n.ino, n.metaLocked()) }()
	if c.Mode != nil {
		// No set-id bits: the mount clears nothing on write (the daemon
		// owns that with HANDLE_KILLPRIV_V2, and keeps none to clear).
		n.meta.mode = *c.Mode & 0o1777
	}
	if c.UID != nil {
		n.meta.uid = *c.UID
	}
	if c.GID != nil {
		n.meta.gid = *c.GID
	}
	if c.Atime != nil {
		n.meta.atime = c.Atime.UnixNano()
	}
	if c.Mtime != nil {
		n.meta.mtime = c.Mtime.UnixNano()
	}
	n.meta.ctime = now().UnixNano()
}

// Touch marks a change of the node: its change time, and its
// modification time too when data (a file's bytes, a directory's names)
// changed.
func (n *node) Touch(modified bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	t := now().UnixNano()
	n.meta.ctime = t
	if modified {
		n.meta.mtime = t
	}
}
