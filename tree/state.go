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
	// One of Dir and File is set.
	Dir  *DirState    `json:"dir,omitempty"`
	File *buffer.Kept `json:"file,omitempty"`
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
func (t *Tree) State() (State, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if len(t.busy) > 0 {
		return State{}, fmt.Errorf("save the namespace: %d names are being changed: %w", len(t.busy), syscall.EBUSY)
	}
	st := State{LastIno: t.lastIno.Load()}
	dirs := []*Dir{t.root}
	for len(dirs) > 0 {
		d := dirs[0]
		dirs = dirs[1:]
		ns, err := d.state()
		if err != nil {
			return State{}, fmt.Errorf("save the namespace: %s: %w", d.pathLocked(), err)
		}
		st.Nodes = append(st.Nodes, ns)
		for name, n := range d.entries {
			switch n := n.(type) {
			case *Dir:
				dirs = append(dirs, n)
			case *File:
				ns, err := n.state()
				if err != nil {
					return State{}, fmt.Errorf("save the namespace: %s/%s: %w", d.pathLocked(), name, err)
				}
				st.Nodes = append(st.Nodes, ns)
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
