package journal

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/tree"
)

// Replay reads a journal's file whole and returns the namespace it holds:
// the last whole state record, the changes written from its offset on
// applied again, then the changes after it. A last line a crash cut short
// is ignored. EINVAL for a journal with no state, or whose records do
// not make a tree. A node that cannot be kept (a pool) is left out
// (Recover says which).
func Replay(r io.ReaderAt, size int64) (tree.State, error) {
	rec, err := Recover(r, size)
	return rec.Tree, err
}

// Recovered is what a journal holds.
type Recovered struct {
	Tree tree.State
	// Backing is the backing id the kernel held of each node with
	// passthrough opens (Journal.Backing).
	Backing map[uint64]int32
	// Done are the FUSE uniques of the last requests that changed the
	// namespace (the tree.Req of the records that completed them).
	Done map[uint64]bool
	// Lost are the nodes no later process can take back (a pool and its
	// files), left out of Tree with what they hold: their names and why.
	Lost []string
}

// Recover is Replay, with the backing ids the kernel held. A file (r
// with an Fd) is read from its first data on: the offsets only grow, and
// what compaction punched out before (days of changes, on a busy mount)
// would take as much memory, as zeros.
func Recover(r io.ReaderAt, size int64) (Recovered, error) {
	start := int64(0)
	if f, ok := r.(interface{ Fd() uintptr }); ok {
		if off, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_DATA); err == nil && off <= size {
			start = off
		}
	}
	data := make([]byte, size-start)
	if n, err := r.ReadAt(data, start); err != nil && !(err == io.EOF && int64(n) == size-start) {
		return Recovered{}, fmt.Errorf("read the journal: %w", err)
	}
	lines := split(data, start)
	// The last whole state record.
	at := -1
	var st record
	for i := len(lines) - 1; i >= 0 && at < 0; i-- {
		var r record
		if json.Unmarshal(lines[i].text, &r) == nil && r.Op == "state" && r.State != nil {
			at, st = i, r
		}
	}
	if at < 0 {
		return Recovered{}, fmt.Errorf("the journal holds no state: %w", syscall.EINVAL)
	}
	m := newModel(*st.State)
	for ino, id := range st.Backing {
		m.backing[ino] = id
	}
	for _, u := range st.Done {
		m.done[u] = true
	}
	for i, l := range lines {
		if l.off < st.Since || i == at {
			continue // older than the state, or the state itself
		}
		var r record
		if err := json.Unmarshal(l.text, &r); err != nil {
			return Recovered{}, fmt.Errorf("journal record at %d: %v: %w", l.off, err, syscall.EINVAL)
		}
		if r.Op == "state" {
			continue // an older state, made useless by the last
		}
		m.apply(r)
	}
	t, lost, err := m.state()
	return Recovered{Tree: t, Backing: m.backing, Done: m.done, Lost: lost}, err
}

// countUnder is how many nodes are under node ino, at any depth.
func countUnder(kids map[uint64][]*tree.NodeState, ino uint64) int {
	n := 0
	for _, k := range kids[ino] {
		n += 1 + countUnder(kids, k.Ino)
	}
	return n
}

// line is a whole line of the journal and where it starts.
type line struct {
	off  int64
	text []byte
}

// split cuts data, the journal from offset start on, into whole lines,
// skipping the zeros of the pages Compact freed (and a line they cut,
// which is older than any state it follows) and a last line without its
// newline.
func split(data []byte, start int64) []line {
	var out []line
	off := 0
	for off < len(data) {
		if data[off] == 0 {
			off++
			continue
		}
		nl := bytes.IndexByte(data[off:], '\n')
		if nl < 0 {
			break // cut short by a crash
		}
		if !bytes.Contains(data[off:off+nl], []byte{0}) {
			out = append(out, line{off: start + int64(off), text: data[off : off+nl]})
		}
		off += nl + 1
	}
	return out
}

// model is the namespace as records build it.
type model struct {
	nodes   map[uint64]*tree.NodeState
	lastIno uint64
	// files: the inode of each buffer's file id, so that a kept record
	// finds its node.
	files map[uint64]uint64
	// backing: the kernel's backing id of each node with one.
	backing map[uint64]int32
	done    map[uint64]bool
}

func newModel(st tree.State) *model {
	m := &model{nodes: map[uint64]*tree.NodeState{}, lastIno: st.LastIno, files: map[uint64]uint64{}, backing: map[uint64]int32{}, done: map[uint64]bool{}}
	for _, ns := range st.Nodes {
		m.made(ns)
	}
	return m
}

func (m *model) made(ns tree.NodeState) {
	n := ns
	if ns.File != nil {
		k := *ns.File
		n.File = &k
		m.files[k.File] = n.Ino
	}
	if ns.Dir != nil {
		d := *ns.Dir
		n.Dir = &d
	}
	if old := m.nodes[n.Ino]; old != nil && old.File != nil && (n.File == nil || old.File.File != n.File.File) {
		delete(m.files, old.File.File)
	}
	m.nodes[n.Ino] = &n
	m.lastIno = max(m.lastIno, n.Ino)
}

// apply applies r. A record of a node that is not there is one whose
// node a later record removes (records written again after a state that
// no longer has it): it is skipped.
func (m *model) apply(r record) {
	if r.Unique != 0 { // a made, named or removed; or an earlier program's "done"
		m.done[r.Unique] = true
	}
	n := m.nodes[r.Ino]
	switch r.Op {
	case "made":
		if r.Node != nil {
			m.made(*r.Node)
		}
	case "named":
		if n != nil {
			n.Parent, n.Name = r.Parent, r.Name
		}
	case "removed":
		if n != nil && n.File != nil {
			delete(m.files, n.File.File)
		}
		delete(m.nodes, r.Ino)
	case "meta":
		if n != nil && r.Meta != nil {
			n.Mode, n.UID, n.GID = r.Meta.Mode, r.Meta.UID, r.Meta.GID
			n.Atime, n.Mtime, n.Ctime = r.Meta.Atime, r.Meta.Mtime, r.Meta.Ctime
		}
	case "access":
		if n != nil && n.Dir != nil {
			n.Dir.DefaultAccess = r.Access
		}
	case "numbered":
		m.lastIno = max(m.lastIno, r.Ino)
	case "backing":
		if r.ID != 0 {
			m.backing[r.Ino] = r.ID
		} else {
			delete(m.backing, r.Ino)
		}
	case "kept":
		if r.Kept == nil {
			return
		}
		ino, ok := m.files[r.Kept.File]
		if !ok {
			// A new file registers before it is linked: its made
			// record, later, has what this one says, or newer.
			return
		}
		f := m.nodes[ino].File
		f.Owner, f.Access = r.Kept.Owner, r.Kept.Access
		f.Generation = max(f.Generation, r.Kept.Generation)
		if s := r.Kept.Source; s != nil && f.Source != nil {
			f.Source.Stale = f.Source.Stale || s.Stale // for good
		}
	}
}

// state is the model as a tree.State: the root, then each directory
// before what it holds. A node no later process can take back (Lost: a
// pool, whose slots died with the process) is left out with what it
// holds; lost says which, and why.
func (m *model) state() (_ tree.State, lost []string, _ error) {
	root := m.nodes[1]
	if root == nil || root.Dir == nil || root.Lost != "" {
		return tree.State{}, nil, fmt.Errorf("the journal's namespace has no root: %w", syscall.EINVAL)
	}
	kids := map[uint64][]*tree.NodeState{}
	for _, n := range m.nodes {
		if n.Ino != 1 {
			kids[n.Parent] = append(kids[n.Parent], n)
		}
	}
	st := tree.State{LastIno: m.lastIno}
	left := 0 // nodes left out
	queue := []*tree.NodeState{root}
	for len(queue) > 0 {
		n := queue[0]
		queue = queue[1:]
		ks := kids[n.Ino]
		if n.Lost != "" {
			under := countUnder(kids, n.Ino)
			left += 1 + under
			lost = append(lost, fmt.Sprintf("%q (node %d, holding %d): %s", n.Name, n.Ino, under, n.Lost))
			continue
		}
		st.Nodes = append(st.Nodes, *n)
		slices.SortFunc(ks, func(a, b *tree.NodeState) int { return cmp.Compare(a.Ino, b.Ino) })
		for _, k := range ks {
			if n.Dir == nil {
				return tree.State{}, nil, fmt.Errorf("node %d is in node %d, not a directory: %w", k.Ino, n.Ino, syscall.EINVAL)
			}
			queue = append(queue, k)
		}
	}
	if len(st.Nodes)+left != len(m.nodes) {
		return tree.State{}, nil, fmt.Errorf("the journal's namespace has %d nodes outside the tree: %w", len(m.nodes)-len(st.Nodes)-left, syscall.EINVAL)
	}
	return st, lost, nil
}
