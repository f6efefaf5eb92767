package tree_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/store"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// process is what one daemon process of a restart test holds: its own
// device and manager on a store that outlives it.
type process struct {
	dev verbs.Device
	st  store.Lasting
	mgr *buffer.Manager
}

var restartStore = store.TmpfsOptions{Size: 64 << 20, Huge: "never"}

func startProcess(t *testing.T, st store.Lasting) *process {
	t.Helper()
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	p := &process{dev: dev, st: st, mgr: buffer.NewManager(dev, buffer.Options{Store: st, Allowed: allRemote}, nil)}
	t.Cleanup(func() {
		p.mgr.Close()
		p.st.Close()
		p.dev.Close()
	})
	return p
}

// handOver ends p as a process that hands its store on does (Leave),
// and returns the descriptor of the store's root the next one adopts.
func (p *process) handOver(t *testing.T) int {
	t.Helper()
	fd, err := p.st.Handover()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.mgr.Leave(); err != nil {
		t.Fatalf("Leave: %v", err)
	}
	return fd
}

func adoptStore(t *testing.T, fd int) store.Lasting {
	t.Helper()
	st, err := store.AdoptTmpfs(fd, restartStore)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// saved is a node as a test sees it, to compare across a restart.
type saved struct {
	ino   uint64
	meta  tree.Meta
	data  []byte       // a file's bytes
	info  buffer.Info  // a file's buffer
	token string       // a directory's token
	acc   verbs.Access // a directory's default access
}

// snapshot reads every node of tr by path.
func snapshot(t *testing.T, tr *tree.Tree) map[string]saved {
	t.Helper()
	out := map[string]saved{}
	var walk func(d *tree.Dir, p string)
	walk = func(d *tree.Dir, p string) {
		tok, err := d.Token(tree.Caller{})
		if err != nil {
			t.Fatal(err)
		}
		out[p+"/"] = saved{ino: d.Ino(), meta: d.Meta(), token: tok, acc: d.Domain().DefaultAccess()}
		for _, e := range d.Entries() {
			n, err := d.Lookup(e.Name)
			if err != nil {
				t.Fatal(err)
			}
			switch n := n.(type) {
			case *tree.Dir:
				walk(n, p+"/"+e.Name)
			case *tree.File:
				in := n.Buffer().Info()
				data := make([]byte, in.Size)
				if _, err := n.Buffer().ReadAt(data, 0); err != nil && in.Size > 0 {
					t.Fatalf("read %s/%s: %v", p, e.Name, err)
				}
				out[p+"/"+e.Name] = saved{ino: n.Ino(), meta: n.Meta(), data: data, info: in}
			}
		}
	}
	walk(tr.Root(), "")
	return out
}

// TestRestartKeepsNamespace hands a namespace from one process to the
// next: the first saves its State and leaves its store; the second adopts
// the store and restores. Every name, inode number, owner, mode, time,
// access and token is the same, every byte is there, each file is
// registered anew (generation grown, new keys), and what the second
// makes next takes numbers and files nobody had.
func TestRestartKeepsNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("not root: the tmpfs store (fsopen needs CAP_SYS_ADMIN) is what outlives a process")
	}
	s, err := store.NewTmpfs(restartStore)
	if err != nil {
		t.Fatal(err)
	}
	p1 := startProcess(t, s.(store.Lasting))
	opt := tree.Options{DefaultAccess: verbs.LocalWrite, Umask: 0o022}
	tr1, err := tree.New(p1.mgr, opt, allRemote, tree.Owner{UID: 7, GID: 8}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	defer tree.SetClock(func() time.Time { return time.Unix(1700000000, 123) })()
	fill := func(f *tree.File, n int, b byte) {
		t.Helper()
		if err := f.Buffer().Resize(t.Context(), uint64(n)); err != nil {
			t.Fatal(err)
		}
		if _, err := f.Buffer().WriteAt(bytes.Repeat([]byte{b}, n), 0); err != nil {
			t.Fatal(err)
		}
	}
	a := create(t, tr1.Root(), "a")
	fill(a, 3*page+5, 'a')
	create(t, tr1.Root(), "empty")
	d, err := tr1.Root().Mkdir(0, "d", tree.Owner{UID: 1000, GID: 1000}, 0o700, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.SetDefaultAccess(verbs.LocalWrite | verbs.RemoteRead); err != nil {
		t.Fatal(err)
	}
	b, err := d.Create(0, "b", tree.Owner{UID: 1000, GID: 1000}, 0o640, nil)
	if err != nil {
		t.Fatal(err)
	}
	fill(b, 2*page, 'b')
	if err := b.SetAccess(allRemote); err != nil {
		t.Fatal(err)
	}
	e := mkdir(t, d, "e")
	c := create(t, e, "c")
	fill(c, page, 'c')
	mode := uint32(0o600)
	if err := c.SetMeta(tree.Change{Mode: &mode}); err != nil {
		t.Fatal(err)
	}
	// A file removed before the restart takes no name or file with it.
	create(t, e, "gone")
	if err := e.Unlink(0, "gone"); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, tr1)
	stats1 := p1.mgr.Stats()

	state, err := tr1.State()
	if err != nil {
		t.Fatalf("State: %v", err)
	}
	// The state goes through bytes, as across an exec.
	js, err := json.Marshal(state)
	if err != nil {
		t.Fatal(err)
	}
	var state2 tree.State
	if err := json.Unmarshal(js, &state2); err != nil {
		t.Fatal(err)
	}
	fd := p1.handOver(t)
	if st := p1.mgr.Stats(); st.Regions != 0 || st.PDs != 0 || st.Buffers != 0 {
		t.Fatalf("the first process kept %+v after Leave", st)
	}

	p2 := startProcess(t, adoptStore(t, fd))
	tr2, err := tree.Restore(p2.mgr, opt, state2)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	after := snapshot(t, tr2)
	if len(after) != len(before) {
		t.Fatalf("restored %d nodes, want %d: %v", len(after), len(before), after)
	}
	for path, w := range before {
		g, ok := after[path]
		switch {
		case !ok:
			t.Errorf("%s: not restored", path)
			continue
		case g.ino != w.ino:
			t.Errorf("%s: inode %d, want %d", path, g.ino, w.ino)
		case g.meta != w.meta:
			t.Errorf("%s: meta %+v, want %+v", path, g.meta, w.meta)
		case g.token != w.token || g.acc != w.acc:
			t.Errorf("%s: token %q access %v, want %q %v", path, g.token, g.acc, w.token, w.acc)
		case !bytes.Equal(g.data, w.data):
			t.Errorf("%s: %d bytes differ after the restart", path, len(w.data))
		}
		if w.info.Size == 0 {
			continue
		}
		gi, wi := g.info, w.info
		if gi.State != buffer.Registered || gi.Length != wi.Size || gi.Access != wi.Access || gi.Owner != wi.Owner {
			t.Errorf("%s: restored %+v, want registered as %+v", path, gi, wi)
		}
		if gi.Generation != wi.Generation+1 {
			t.Errorf("%s: generation %d, want %d (one more registration)", path, gi.Generation, wi.Generation+1)
		}
		if gi.RKey == wi.RKey {
			t.Errorf("%s: the rkey %#x did not change: the region is a new one", path, gi.RKey)
		}
	}
	stats2 := p2.mgr.Stats()
	if stats2.ChargedBytes != stats1.ChargedBytes || stats2.Users[1000] != stats1.Users[1000] || stats2.PDs != stats1.PDs {
		t.Errorf("charges after the restart %+v, before %+v", stats2, stats1)
	}

	// What the new process makes takes a new number and a new file.
	n := create(t, tr2.Root(), "new")
	if n.Ino() <= state.LastIno {
		t.Errorf("a new file took inode %d, given before the restart (last %d)", n.Ino(), state.LastIno)
	}
	fill(n, page, 'n')
	got := make([]byte, 3*page+5)
	if _, err := n.Buffer().ReadAt(got[:page], 0); err != nil || got[0] != 'n' {
		t.Fatalf("new file: %q %v", got[:1], err)
	}
	fa, err := tr2.Root().Lookup("a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fa.(*tree.File).Buffer().ReadAt(got, 0); err != nil || !bytes.Equal(got, before["/a"].data) {
		t.Errorf("a new file's file is one a restored file had: /a reads %q... (%v)", got[:8], err)
	}
}

// TestRestoreFailsWhole: a state the store cannot answer (a file gone)
// fails the restore, names the file, and lets go of what it had made
// without touching the store's files: the next try finds every byte.
func TestRestoreFailsWhole(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("not root: the tmpfs store (fsopen needs CAP_SYS_ADMIN) is what outlives a process")
	}
	s, err := store.NewTmpfs(restartStore)
	if err != nil {
		t.Fatal(err)
	}
	p1 := startProcess(t, s.(store.Lasting))
	opt := tree.Options{DefaultSize: page, DefaultAccess: verbs.LocalWrite}
	tr1, err := tree.New(p1.mgr, opt, verbs.LocalWrite, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	f := create(t, tr1.Root(), "kept")
	if _, err := f.Buffer().WriteAt([]byte("kept bytes"), 0); err != nil {
		t.Fatal(err)
	}
	state, err := tr1.State()
	if err != nil {
		t.Fatal(err)
	}
	bad := tree.State{LastIno: state.LastIno + 1, Nodes: append(state.Nodes[:len(state.Nodes):len(state.Nodes)],
		tree.NodeState{Ino: state.LastIno + 1, Parent: 1, Name: "lost", Mode: 0o644,
			File: &buffer.Kept{File: 999, Access: verbs.LocalWrite}})}
	fd := p1.handOver(t)
	st := adoptStore(t, fd)
	keep, err := st.Handover()
	if err != nil {
		t.Fatal(err)
	}

	p2 := startProcess(t, st)
	if _, err := tree.Restore(p2.mgr, opt, bad); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("Restore of a state naming a missing file: %v, want ENOENT", err)
	}
	if st := p2.mgr.Stats(); st.Regions != 0 || st.PDs != 0 || st.Buffers != 0 {
		t.Errorf("a failed restore kept %+v", st)
	}

	p3 := startProcess(t, adoptStore(t, keep))
	tr3, err := tree.Restore(p3.mgr, opt, state)
	if err != nil {
		t.Fatalf("Restore after a failed one: %v", err)
	}
	n, err := tr3.Root().Lookup("kept")
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 10)
	if _, err := n.(*tree.File).Buffer().ReadAt(got, 0); err != nil || string(got) != "kept bytes" {
		t.Errorf("after a failed restore the file reads %q (%v), want %q", got, err, "kept bytes")
	}
}

// TestStateRefusesWhatCannotBeKept: a restart that would lose a buffer is
// refused before anything is handed over.
func TestStateRefusesWhatCannotBeKept(t *testing.T) {
	tr := newTree(t, page, 0) // memfd: dies with the process
	create(t, tr.Root(), "f")
	if _, err := tr.State(); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("State with memfd files: %v, want EOPNOTSUPP", err)
	}
	if os.Geteuid() != 0 {
		t.Log("not root: pools on the tmpfs store are not tested")
		return
	}
	s, err := store.NewTmpfs(restartStore)
	if err != nil {
		t.Fatal(err)
	}
	p := startProcess(t, s.(store.Lasting))
	tr2, err := tree.New(p.mgr, tree.Options{DefaultAccess: verbs.LocalWrite}, verbs.LocalWrite, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr2.State(); err != nil {
		t.Fatalf("State of an empty tree: %v", err)
	}
	pool := mkdir(t, tr2.Root(), "pool")
	if _, err := pool.MakePool(page, 4, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := tr2.State(); !errors.Is(err, syscall.EOPNOTSUPP) {
		t.Errorf("State with a pool: %v, want EOPNOTSUPP", err)
	}
}
