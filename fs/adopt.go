package fs

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"mrfs/fuseconn"
	"mrfs/tree"
)

// Handover is what a daemon gives its successor of the mount (DESIGN,
// Restart): a descriptor of the FUSE connection, the kernel's INIT, and
// what the kernel holds of the mount.
type Handover struct {
	Conn   int
	Init   []byte
	Kernel KernelState
	// Restarts counts the daemons the mount had before this one: new
	// handles are numbered above every earlier daemon's.
	Restarts int
	// Crashed: the daemon before died and Kernel is empty; Backing is
	// the journal's backing ids (journal.Recover).
	Crashed bool
	Backing map[uint64]int32
	// Done are the requests the dead daemon applied (journal.Recover).
	Done map[uint64]bool
}

// Pause holds new requests (they wait, unanswered) and waits up to
// timeout for those under way: EBUSY, and nothing held, when they do not
// end by then. The kernel's view changes only by FORGETs meanwhile. The
// names the kernel is told to drop wait too, from before the requests do
// (forgetter.pause).
func (s *Server) Pause(timeout time.Duration) error {
	s.forget.pause()
	if err := s.kernel.gate.close(timeout); err != nil {
		s.forget.resume()
		return err
	}
	return nil
}

// Resume lets requests through again after a Pause.
func (s *Server) Resume() {
	s.kernel.gate.open()
	s.forget.resume()
}

// Handover calls then with what a successor needs, from a paused server
// whose tree is t; FORGETs wait until then returns (it executes the
// successor, and returns only when that failed). EBUSY when the kernel
// holds a node t no longer has (a removed file still open or mapped: its
// successor could not answer for it), EOPNOTSUPP when the connection is
// not the daemon's (mounted by fusermount).
func (s *Server) Handover(t *tree.Tree, then func(Handover) error) error {
	if s.conn < 0 {
		return fmt.Errorf("the connection was made by fusermount and dies with this process: %w", syscall.EOPNOTSUPP)
	}
	inos := treeInos(t)
	return s.kernel.frozen(func(k KernelState) error {
		for _, id := range k.Links {
			inos[id] = true
		}
		for id := range k.Nodes {
			if id != fuse.FUSE_ROOT_ID && !inos[id] {
				return fmt.Errorf("the kernel holds node %d, a removed file still open or mapped: %w", id, syscall.EBUSY)
			}
		}
		return then(Handover{Conn: s.conn, Init: s.init, Kernel: k})
	})
}

// Connection is the daemon's descriptor of the FUSE connection and the
// kernel's INIT, for a keeper that outlives the daemon (DESIGN,
// Restart); ok is false for a connection fusermount made.
func (s *Server) Connection() (fd int, init []byte, ok bool) {
	return s.conn, s.init, s.conn >= 0
}

// treeInos is the set of t's inode numbers.
func treeInos(t *tree.Tree) map[uint64]bool {
	inos := map[uint64]bool{}
	walk(t.Root(), func(n tree.Node, _ *tree.Dir, _ string) { inos[n.Ino()] = true })
	return inos
}

// walk calls f on every node under d (d's first, then what each
// directory holds), with its directory and name.
func walk(d *tree.Dir, f func(n tree.Node, parent *tree.Dir, name string)) {
	for _, e := range d.Entries() {
		f(e.Node, d, e.Name)
		if sub, ok := e.Node.(*tree.Dir); ok {
			walk(sub, f)
		}
	}
}

// Adopt serves opt.Tree on the connection an earlier daemon handed over
// (h), at dir: go-fuse is given the INIT the kernel sent that daemon, the
// nodes the kernel holds are looked up as many times as the kernel
// counts, its open handles opened again (a handle of a file opened zero
// copy takes its hold again, and keeps the backing id the kernel has),
// then the kernel is asked to send again what that daemon read and never
// answered. It takes h.Conn. On failure the connection is left to the
// caller's other descriptors, if any: nothing is served.
func Adopt(dir string, opt Options, mo MountOptions, h Handover) (*Server, error) {
	fsys, root, options := newFilesystem(opt, mo)
	fail := func(err error) (*Server, error) {
		fsys.forget.stop()
		return nil, fmt.Errorf("adopt the mount at %s: %w", dir, err)
	}
	raw := fusefs.NewNodeFS(root, options)
	// Every directory's node, as Mkdir makes it (Lookup finds it there).
	walk(opt.Tree.Root(), func(n tree.Node, parent *tree.Dir, _ string) {
		if d, ok := n.(*tree.Dir); ok {
			p := parent.Aux().(*dirNode)
			p.NewPersistentInode(context.Background(), newDirNode(fsys, d), fusefs.StableAttr{Mode: syscall.S_IFDIR, Ino: d.Ino()})
		}
	})
	k := newKernel(raw)
	s := &Server{dir: dir, kernel: k, conn: -1}
	var err error
	if s.conn, err = unix.FcntlInt(uintptr(h.Conn), unix.F_DUPFD_CLOEXEC, 0); err != nil {
		unix.Close(h.Conn)
		return fail(fmt.Errorf("keep the connection: %w", err))
	}
	if s.srv, s.init, err = fuseconn.Serve(h.Conn, h.Init, k, &options.MountOptions); err != nil {
		s.closeConn()
		return fail(err)
	}
	k.unregister, k.notifyEntry = s.srv.UnregisterBackingFd, s.srv.EntryNotify
	k.onBacking, k.onDone, k.done = opt.OnBacking, opt.OnDone, h.Done
	if len(h.Kernel.Done) > 0 { // an upgrade's
		k.done = make(map[uint64]bool, len(h.Kernel.Done))
		for _, u := range h.Kernel.Done {
			k.done[u] = true
		}
	}
	restore := func() error { return k.restore(raw, opt.Tree, h.Kernel) }
	if h.Crashed {
		restore = func() error { return k.restoreCrashed(raw, opt.Tree, s.conn, h.Backing) }
	}
	// New handles are numbered above every one an earlier daemon gave.
	k.base = max(h.Kernel.Base+1<<32, uint64(h.Restarts)<<40)
	if err := restore(); err != nil {
		s.closeConn()
		return fail(err)
	}
	if opt.OnServe != nil {
		opt.OnServe(s.conn, s.init)
	}
	go s.srv.Serve()
	if err := fuseconn.Resend(s.conn); err != nil {
		opt.Log.Warn("requests the earlier daemon read and never answered are lost", "err", err)
	}
	return s.started(fsys, opt)
}

// rootCaller is the caller of the requests a restore makes itself.
func rootCaller() fuse.Caller {
	return fuse.Caller{Owner: fuse.Owner{Uid: 0, Gid: 0}, Pid: uint32(os.Getpid())}
}

// restore makes go-fuse (raw, not yet serving) hold what the kernel holds
// (st) of t: each node looked up as many times as the kernel counts, its
// directory first (one not held is looked up for the while and forgotten
// after), a file's buffer held, and each handle opened again under the
// kernel's number.
func (k *kernel) restore(raw fuse.RawFileSystem, t *tree.Tree, st KernelState) error {
	caller := rootCaller()
	held := map[uint64]bool{fuse.FUSE_ROOT_ID: true}
	var temp []uint64 // looked up only to reach what they hold
	lookup := func(parent *tree.Dir, name string, ino uint64, n uint64) error {
		for range n {
			var out fuse.EntryOut
			if s := raw.Lookup(nil, &fuse.InHeader{NodeId: parent.Ino(), Caller: caller}, name, &out); !s.Ok() || out.NodeId != ino {
				return fmt.Errorf("look up node %d (%q in node %d): %v, got node %d", ino, name, parent.Ino(), s, out.NodeId)
			}
		}
		return nil
	}
	// Where each node is; directories come before what they hold.
	type place struct {
		parent *tree.Dir
		name   string
	}
	where := map[uint64]place{}
	var order []uint64
	walk(t.Root(), func(n tree.Node, parent *tree.Dir, name string) {
		where[n.Ino()] = place{parent, name}
		order = append(order, n.Ino())
	})
	// reach makes go-fuse hold directory ino, for a node in it.
	var reach func(ino uint64) error
	reach = func(ino uint64) error {
		if held[ino] {
			return nil
		}
		w := where[ino]
		if err := reach(w.parent.Ino()); err != nil {
			return err
		}
		held[ino] = true
		temp = append(temp, ino)
		return lookup(w.parent, w.name, ino, 1)
	}
	for _, ino := range order {
		n := st.Nodes[ino]
		if n == 0 || held[ino] {
			continue
		}
		w := where[ino]
		if err := reach(w.parent.Ino()); err != nil {
			return err
		}
		if err := lookup(w.parent, w.name, ino, n); err != nil {
			return err
		}
		held[ino] = true
	}
	k.mu.Lock()
	k.partial = st.Partial
	for id, n := range st.Nodes {
		if _, ok := where[id]; ok || id == fuse.FUSE_ROOT_ID {
			k.nodes[id] = n
		} else {
			k.partial = true // a link node: ESTALE until its FORGET
		}
	}
	k.mu.Unlock()
	for _, h := range st.Handles {
		// Opened again as it is, but never to truncate or create.
		in := &fuse.OpenIn{InHeader: fuse.InHeader{NodeId: h.Node, Caller: caller},
			Flags: h.Flags &^ (syscall.O_TRUNC | syscall.O_CREAT | syscall.O_EXCL)}
		var out fuse.OpenOut
		var s fuse.Status
		if h.Dir {
			s = raw.OpenDir(nil, in, &out)
		} else {
			s = raw.Open(nil, in, &out)
		}
		if !s.Ok() {
			return fmt.Errorf("open node %d again (handle %d): %v", h.Node, h.Fh, s)
		}
		k.mu.Lock()
		k.handles[h.Fh] = h
		k.restored[h.Fh] = out.Fh
		if h.Backing != 0 {
			b := k.backing[h.Node]
			if b == nil {
				b = &backingRef{id: h.Backing}
				k.backing[h.Node] = b
			}
			b.refs++
		}
		k.mu.Unlock()
	}
	for _, ino := range temp {
		raw.Forget(ino, 1)
	}
	// A file the kernel holds may be mapped, its descriptors closed: its
	// buffer is held as a zero-copy open holds it, until the FORGET.
	for ino, n := range st.Nodes {
		w, ok := where[ino]
		if n == 0 || !ok {
			continue
		}
		if c := w.parent.Aux().(*dirNode).GetChild(w.name); c != nil {
			if b, ok := c.Operations().(*bufferNode); ok {
				b.holdInode()
			}
		}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for node, b := range k.backing {
		k.noteBacking(node, b.id) // to this daemon's journal
	}
	return nil
}

// restoreCrashed makes go-fuse hold what the kernel holds of t after its
// daemon died: each node the kernel says it holds (fuseconn.Held) is
// looked up once (restore), and the journal's backing id of such a node
// (backing) is kept for new opens while the handles from before may use
// it; the others are given back.
func (k *kernel) restoreCrashed(raw fuse.RawFileSystem, t *tree.Tree, conn int, backing map[uint64]int32) error {
	held := map[uint64]uint64{}
	var err error
	walk(t.Root(), func(n tree.Node, _ *tree.Dir, _ string) {
		if err == nil {
			var h bool
			if h, err = fuseconn.Held(conn, n.Ino()); h {
				held[n.Ino()] = 1
			}
		}
	})
	if err != nil {
		return err
	}
	if err := k.restore(raw, t, KernelState{Nodes: held}); err != nil {
		return err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for node, id := range backing {
		if held[node] != 0 {
			k.backing[node] = &backingRef{id: id, refs: 1, pre: true}
			k.noteBacking(node, id)
		} else if k.unregister != nil {
			// A node no one can open again (removed, or forgotten):
			// its open files keep their backing file; the id would
			// keep it after them.
			k.unregister(id)
		}
	}
	k.crashed, k.partial = true, true
	return nil
}
