package verbstest

import (
	"bytes"
	"encoding/binary"

	"mrfs/verbs"
)

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

// MatrixOff is where the matrix's operations act: an aligned word inside
// the buffer, not at its start.
const MatrixOff = 64

// The operands of the matrix's operations: a WRITE of MatrixData, a CAS
// of the word (compared with its value) to MatrixSwap, a FADD of
// MatrixAdd.
var MatrixData = []byte("ABCDEFGH")

const (
	MatrixSwap = 9
	MatrixAdd  = 3
)

// MatrixBuffer is what a buffer holds before each operation of the
// matrix: n bytes of a pattern, with the word 5 at MatrixOff.
func MatrixBuffer(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i * 7)
	}
	binary.NativeEndian.PutUint64(b[MatrixOff:], 5)
	return b
}

// Word is the word at MatrixOff of b.
func Word(b []byte) uint64 { return binary.NativeEndian.Uint64(b[MatrixOff:]) }

// Apply returns the bytes b after op succeeded on them (a READ changes
// nothing); b is left as it was.
func (op Op) Apply(b []byte) []byte {
	b = bytes.Clone(b)
	w := b[MatrixOff : MatrixOff+8]
	switch op.Name {
	case "WRITE":
		copy(w, MatrixData)
	case "CAS":
		binary.NativeEndian.PutUint64(w, MatrixSwap)
	case "FADD":
		binary.NativeEndian.PutUint64(w, binary.NativeEndian.Uint64(w)+MatrixAdd)
	}
	return b
}
