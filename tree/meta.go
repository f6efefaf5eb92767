package tree

import "time"

// Meta is the POSIX metadata mrfs keeps for a node; a file's size comes
// from its buffer.
type Meta struct {
	Mode                uint32 // permission bits and the sticky bit, never set-id bits
	UID, GID            uint32
	Atime, Mtime, Ctime time.Time
}

func newMeta(owner Owner, mode uint32) Meta {
	t := now()
	return Meta{Mode: mode, UID: owner.UID, GID: owner.GID, Atime: t, Mtime: t, Ctime: t}
}

// Meta is a snapshot of the node's metadata.
func (n *node) Meta() Meta {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.meta
}

// Change is a SETATTR's metadata part: the fields that are set change.
type Change struct {
	Mode         *uint32
	UID, GID     *uint32
	Atime, Mtime *time.Time
}

// SetMeta applies c and sets the change time.
func (n *node) SetMeta(c Change) error {
	n.setMeta(c)
	return nil
}

// SetMeta charges the buffer to a new owner first (chown moves the
// charge): when that uid's quota cannot hold it, EDQUOT and nothing
// changes.
func (f *File) SetMeta(c Change) error {
	if c.UID != nil {
		if err := f.buf.SetOwner(*c.UID); err != nil {
			return err
		}
	}
	f.setMeta(c)
	return nil
}

func (n *node) setMeta(c Change) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if c.Mode != nil {
		// No set-id bits: the mount clears nothing on write (the daemon
		// owns that with HANDLE_KILLPRIV_V2, and keeps none to clear).
		n.meta.Mode = *c.Mode & 0o1777
	}
	if c.UID != nil {
		n.meta.UID = *c.UID
	}
	if c.GID != nil {
		n.meta.GID = *c.GID
	}
	if c.Atime != nil {
		n.meta.Atime = *c.Atime
	}
	if c.Mtime != nil {
		n.meta.Mtime = *c.Mtime
	}
	n.meta.Ctime = now()
}

// Touch marks a change of the node: its change time, and its
// modification time too when data (a file's bytes, a directory's names)
// changed.
func (n *node) Touch(modified bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	t := now()
	n.meta.Ctime = t
	if modified {
		n.meta.Mtime = t
	}
}
