package verbstest

import "mrfs/verbs"

// The access matrix every transport is tested on: each combination of
// the four flags mrfs exposes, against each one-sided operation. The
// lists are written out rather than derived from verbs.Access.Validate,
// so that a bug there cannot shrink them.

// ValidAccess lists every combination of local_write, remote_read,
// remote_write and remote_atomic that the kernel accepts
// (ib_check_mr_access: remote_write and remote_atomic need local_write),
// each flag alone among them where that is allowed.
var ValidAccess = []verbs.Access{
	0,
	verbs.LocalWrite,
	verbs.RemoteRead,
	verbs.LocalWrite | verbs.RemoteRead,
	verbs.LocalWrite | verbs.RemoteWrite,
	verbs.LocalWrite | verbs.RemoteAtomic,
	verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite,
	verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteAtomic,
	verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteAtomic,
	verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic,
}

// InvalidAccess lists the combinations the kernel refuses with EINVAL:
// remote_write or remote_atomic without local_write.
var InvalidAccess = []verbs.Access{
	verbs.RemoteWrite,
	verbs.RemoteAtomic,
	verbs.RemoteRead | verbs.RemoteWrite,
	verbs.RemoteRead | verbs.RemoteAtomic,
	verbs.RemoteWrite | verbs.RemoteAtomic,
	verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic,
}

// Op is a one-sided operation and the one access flag a responder checks
// for it (verbs-semantics.md §5): local_write plays no part.
type Op struct {
	Name string // READ, WRITE, CAS, FADD
	Need verbs.Access
}

// Ops are the one-sided operations mrfs serves.
var Ops = []Op{
	{"READ", verbs.RemoteRead},
	{"WRITE", verbs.RemoteWrite},
	{"CAS", verbs.RemoteAtomic},
	{"FADD", verbs.RemoteAtomic},
}

// AccessName is a's name for a file or test name: its canonical form,
// or "none".
func AccessName(a verbs.Access) string {
	if a == 0 {
		return "none"
	}
	return a.String()
}
