package tree

import (
	"errors"
	"fmt"
	"syscall"

	"mrfs/buffer"
	"mrfs/verbs"
)

// State is what a later process needs to take the namespace back after
// a restart (DESIGN, Restart): every node with its inode number, name,
// metadata, and a directory's PD (default access, token) or a file's
// buffer (buffer.Kept). The store's files hold the bytes.
type State struct {
	// LastIno is the inode number given last: a later process goes on
	// from it, so no number is given twice.
	LastIno uint64 `json:"last_ino"`
	// Nodes are the root first, then each directory before what it
	// holds.
	Nodes []NodeState `json:"nodes"`
}

// NodeState is one node of State.
type NodeState struct {
	Ino    uint64 `json:"ino"`
	Parent uint64 `json:"parent,omitempty"` // 0 for the root
	Name   string `json:"name,omitempty"`
	Mode   uint32 `json:"mode"`
	UID    uint32 `json:"uid"`
	GID    uint32 `json:"gid"`
	// Times in nanoseconds since the epoch.
	Atime int64 `json:"atime"`
	Mtime int64 `json:"mtime"`
	Ctime int64 `json:"ctime"`
	// One of Dir and File is set, or (in a journal's record only) Lost.
	Dir  *DirState    `json:"dir,omitempty"`
	File *buffer.Kept `json:"file,omitempty"`
	// Lost says why a later process could not take the node back (a
	// pool, a file registered in place): a journal that holds it cannot
	// be restored while the node lives.
	Lost string `json:"lost,omitempty"`
}

// DirState is a directory's PD.
type DirState struct {
	DefaultAccess verbs.Access `json:"default_access"`
	Token         string       `json:"token"`
}

// State is the namespace now, for a later process (Restore). It is
// meant for a daemon that stopped taking requests: EBUSY while an
// unlink, rename or rmdir is under way. EOPNOTSUPP for what a later
// process cannot take back yet (pools, files registered in place, a
// store that dies with the process): better to refuse a restart than to
// lose a buffer in it.
func (t *Tree) State() (State, error) { return t.state(false) }

// Checkpoint is the namespace now, for a journal's compaction (Journal):
// unlike State it is taken while changes go on, so what is under way may
// be in it or not (a file being unlinked and already freed is not), and
// what cannot be kept is in it as Lost; the records of those changes,
// written after it began, say the rest.
func (t *Tree) Checkpoint() (State, error) { return t.state(true) }

func (t *Tree) state(checkpoint bool) (State, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if len(t.busy) > 0 && !checkpoint {
		return State{}, fmt.Errorf("save the namespace: %d names are being changed: %w", len(t.busy), syscall.EBUSY)
	}
	st := State{LastIno: t.lastIno.Load()}
	// add adds n's state, or says why it cannot.
	add := func(n Node, ns NodeState, err error) error {
		switch {
		case err == nil:
		case !checkpoint:
			return err
		case errors.Is(err, syscall.ENOENT):
			return nil // freed by an unlink whose record follows
		default:
			ns = n.base().nodeState()
			ns.Lost = err.Error()
		}
		st.Nodes = append(st.Nodes, ns)
		return nil
	}
	dirs := []*Dir{t.root}
	for len(dirs) > 0 {
		d := dirs[0]
		dirs = dirs[1:]
		ns, err := d.state()
		if err := add(d, ns, err); err != nil {
			return State{}, fmt.Errorf("save the namespace: %s: %w", d.pathLocked(), err)
		}
		for name, n := range d.entries {
			switch n := n.(type) {
			case *Dir:
				dirs = append(dirs, n)
			case *File:
				ns, err := n.state()
				if err := add(n, ns, err); err != nil {
					return State{}, fmt.Errorf("save the namespace: %s/%s: %w", d.pathLocked(), name, err)
				}
			}
		}
	}
	return st, nil
}

// nodeState is n's part of its NodeState. Callers hold Tree.mu.
func (n *node) nodeState() NodeState {
	n.mu.Lock()
	m := n.meta
	n.mu.Unlock()
	ns := NodeState{Ino: n.ino, Name: n.name, Mode: m.mode, UID: m.uid, GID: m.gid,
		Atime: m.atime, Mtime: m.mtime, Ctime: m.ctime}
	if n.parent != nil {
		ns.Parent = n.parent.ino
	}
	return ns
}

func (d *Dir) state() (NodeState, error) {
	if d.dom.Pool() != nil {
		return NodeState{}, fmt.Errorf("a pool cannot be kept across a restart yet: %w", syscall.EOPNOTSUPP)
	}
	ns := d.nodeState()
	ns.Dir = &DirState{DefaultAccess: d.dom.DefaultAccess(), Token: d.dom.Token()}
	return ns, nil
}

func (f *File) state() (NodeState, error) {
	k, err := f.buf.Keep()
	if err != nil {
		return NodeState{}, err
	}
	ns := f.nodeState()
	ns.File = &k
	return ns, nil
}

// Journal hears, as they happen, the changes a later process needs to
// rebuild State after a crash, when nobody could save it (package
// journal): each record is the node's new value, not a difference, so
// that records applied again on a State that has them change nothing.
// Records of one node come in the order of its changes: a node's names
// under Tree.mu, its metadata under its own mu. Times that only Touch
// changes (a write, an entry added) are not journaled. Calls must not
// block or call back into the tree.
//
// The record that completes a call made for a request (Made of a create
// or mkdir, Removed of an unlink or rmdir, the last Named of a rename)
// carries its Req, and no other record does: a later process that finds
// req knows the call was made, whole.
type Journal interface {
	// Made: a node was linked, or can no longer be kept (Lost).
	Made(ns NodeState, req Req)
	// Named: a node was renamed (moved) to name in directory parent.
	Named(ino, parent uint64, name string, req Req)
	// Removed: a node was unlinked or removed for good.
	Removed(ino uint64, req Req)
	// Meta: a node's metadata changed (SetMeta).
	Meta(ino uint64, m Meta)
	// DefaultAccess: a directory's default access changed.
	DefaultAccess(ino uint64, a verbs.Access)
	// Numbered: an inode number was given to a node of the front end's
	// own (NewIno), which no later node may take.
	Numbered(ino uint64)
}

// noJournal is the Journal of a tree that has none.
type noJournal struct{}

func (noJournal) Made(NodeState, Req)                {}
func (noJournal) Named(uint64, uint64, string, Req)  {}
func (noJournal) Removed(uint64, Req)                {}
func (noJournal) Meta(uint64, Meta)                  {}
func (noJournal) DefaultAccess(uint64, verbs.Access) {}
func (noJournal) Numbered(uint64)                    {}

// madeLocked journals n as it is now, made for req. Callers hold Tree.mu.
func (t *Tree) madeLocked(n Node, req Req) {
	var ns NodeState
	var err error
	switch n := n.(type) {
	case *Dir:
		ns, err = n.state()
	case *File:
		ns, err = n.state()
	}
	if err != nil {
		ns = n.base().nodeState()
		ns.Lost = err.Error()
	}
	t.j.Made(ns, req)
}

// namedLocked journals the new names of ns, the last one's with req.
// Callers hold Tree.mu.
func (t *Tree) namedLocked(req Req, ns ...Node) {
	for i, n := range ns {
		b := n.base()
		r := req
		if i < len(ns)-1 {
			r = 0
		}
		t.j.Named(b.ino, b.parent.ino, b.name, r)
	}
}

// Restore makes the namespace of st, which an earlier process's State
// gave, on mgr, whose store is that process's (store.AdoptTmpfs): each
// directory gets its PD again with its token, each file its buffer again
// (buffer.Manager.Adopt: registered anew, new keys), with the inode
// numbers, names and metadata they had. A file whose size a limit now
// refuses is restored Unregistered, its bytes kept, and logged. On any
// other failure nothing is served: mgr is left (buffer.Manager.Leave),
// which keeps every file of the store for another try.
func Restore(mgr *buffer.Manager, opt Options, st State) (*Tree, error) {
	t, err := restore(newTree(mgr, opt), st)
	if err != nil {
		if _, lerr := mgr.Leave(); lerr != nil {
			err = fmt.Errorf("%w (and letting go of what was restored: %w)", err, lerr)
		}
		return nil, fmt.Errorf("restore the namespace: %w", err)
	}
	return t, nil
}

func restore(t *Tree, st State) (*Tree, error) {
	if len(st.Nodes) == 0 || st.Nodes[0].Ino != 1 || st.Nodes[0].Parent != 0 || st.Nodes[0].Dir == nil {
		return nil, fmt.Errorf("the state does not start with the root: %w", syscall.EINVAL)
	}
	dirs := map[uint64]*Dir{}
	seen := map[uint64]bool{}
	for _, ns := range st.Nodes {
		if ns.Ino == 0 || ns.Ino > st.LastIno || seen[ns.Ino] || (ns.Dir == nil) == (ns.File == nil) {
			return nil, fmt.Errorf("node %d of the state is not one a tree makes: %w", ns.Ino, syscall.EINVAL)
		}
		seen[ns.Ino] = true
		m := meta{mode: ns.Mode & 0o1777, uid: ns.UID, gid: ns.GID, atime: ns.Atime, mtime: ns.Mtime, ctime: ns.Ctime}
		var parent *Dir
		if ns.Ino != 1 {
			parent = dirs[ns.Parent]
			if parent == nil {
				return nil, fmt.Errorf("node %d: its directory %d is not before it: %w", ns.Ino, ns.Parent, syscall.EINVAL)
			}
			if err := checkName(ns.Name); err != nil || parent.entries[ns.Name] != nil {
				return nil, fmt.Errorf("node %d: name %q in directory %d: %w", ns.Ino, ns.Name, ns.Parent, errors.Join(err, syscall.EEXIST))
			}
		}
		var n Node
		if ns.Dir != nil {
			dom, err := t.mgr.AdoptDomain(ns.Dir.DefaultAccess, ns.Dir.Token)
			if err != nil {
				return nil, fmt.Errorf("directory %d: %w", ns.Ino, err)
			}
			d := &Dir{t: t, dom: dom, entries: map[string]Node{}}
			d.ino, d.meta = ns.Ino, m
			dirs[ns.Ino] = d
			n = d
		} else if ns.File.Source != nil {
			// Memory a client brought: its source may be gone, or another
			// file now; then the name goes, and the source keeps its bytes.
			buf, err := t.mgr.AdoptInPlace(parent.dom, *ns.File)
			if err != nil {
				t.log.Warn("a file registered in place is not restored: its name goes", "ino", ns.Ino, "name", ns.Name, "err", err)
				continue
			}
			f := &File{buf: buf, t: t}
			f.ino, f.meta = ns.Ino, m
			buf.SetAux(f)
			n = f
		} else {
			buf, err := t.mgr.Adopt(parent.dom, *ns.File)
			if buf == nil {
				return nil, fmt.Errorf("file %d: %w", ns.Ino, err)
			}
			if err != nil {
				t.log.Warn("a file is restored without its registration", "ino", ns.Ino, "name", ns.Name, "err", err)
			}
			f := &File{buf: buf, t: t}
			f.ino, f.meta = ns.Ino, m
			buf.SetAux(f)
			n = f
		}
		if parent == nil {
			t.root = n.(*Dir)
		} else {
			parent.addLocked(ns.Name, n)
		}
	}
	t.lastIno.Store(st.LastIno)
	return t, nil
}
