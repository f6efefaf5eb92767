package tree

import (
	"fmt"
	"slices"
	"syscall"
)

// Caller is who makes a request: its (filesystem) uid and gid and its
// supplementary groups (nil when they cannot be known).
type Caller struct {
	Owner
	Groups []uint32
}

// MayWrite says whether c may write a node of metadata m, as the
// kernel's mode check decides it: root always; the owner by the owner's
// bits, a member of the node's group (its gid or a supplementary group)
// by the group's, anyone else by the others'.
func (m Meta) MayWrite(c Caller) bool {
	switch {
	case c.UID == 0:
		return true
	case c.UID == m.UID:
		return m.Mode&0o200 != 0
	case c.GID == m.GID || slices.Contains(c.Groups, m.GID):
		return m.Mode&0o020 != 0
	}
	return m.Mode&0o002 != 0
}

// Token is the PD's token (user.mrfs.token) for c, who must be allowed
// to write d: a peer holding the token may change every buffer of the
// PD that grants remote access, so handing it out is the right of those
// who may change the PD, not of those who may only list it. EACCES for
// anyone else.
func (d *Dir) Token(c Caller) (string, error) {
	if !d.Meta().MayWrite(c) {
		return "", fmt.Errorf("the token of %s is for users who may write it: %w", d.Path(), syscall.EACCES)
	}
	return d.dom.Token(), nil
}
