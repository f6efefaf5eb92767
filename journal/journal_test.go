package journal_test

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/journal"
	"mrfs/store"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

const (
	page      = 4096
	allRemote = verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic
)

var accesses = []verbs.Access{verbs.LocalWrite, verbs.LocalWrite | verbs.RemoteRead, allRemote}

var storeOpt = store.TmpfsOptions{Size: 256 << 20, Huge: "never"}

// memfd is a new memfd as an *os.File, closed at the test's end.
func memfd(t *testing.T) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("journal", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "journal")
	t.Cleanup(func() { f.Close() })
	return f
}

// journaled is a tree on the tmpfs store whose changes go to a journal.
type journaled struct {
	st  store.Lasting
	mgr *buffer.Manager
	tr  *tree.Tree
	j   *journal.Journal
	f   *os.File
	// numbered is the largest number NewIno gave.
	numbered atomic.Uint64
}

func newJournaled(t *testing.T) *journaled {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("not root: the tmpfs store (fsopen needs CAP_SYS_ADMIN) is what a journal's files are in")
	}
	s, err := store.NewTmpfs(storeOpt)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	x := &journaled{st: s.(store.Lasting), f: memfd(t)}
	x.j = journal.New(x.f)
	t.Cleanup(func() { x.j.Close() })
	x.mgr = buffer.NewManager(dev, buffer.Options{Store: s, Allowed: allRemote, OnKept: x.j.Kept}, nil)
	t.Cleanup(func() {
		x.mgr.Close()
		s.Close()
		dev.Close()
	})
	x.tr, err = tree.New(x.mgr, tree.Options{DefaultSize: page, DefaultAccess: verbs.LocalWrite, Journal: x.j},
		verbs.LocalWrite, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if err := x.j.Compact(x.tr.Checkpoint); err != nil {
		t.Fatal(err)
	}
	return x
}

// replay is what the journal's file says now.
func (x *journaled) replay(t *testing.T) tree.State {
	t.Helper()
	st, err := journal.Replay(x.f, x.j.Size())
	if err != nil {
		t.Fatalf("Replay: %v", err)
	}
	return st
}

// norm is a State as the journal must give it back: by inode, without
// the times only Touch changes (not journaled).
func norm(st tree.State) tree.State {
	out := tree.State{LastIno: st.LastIno}
	for _, n := range st.Nodes {
		n.Mtime, n.Ctime = 0, 0
		out.Nodes = append(out.Nodes, n)
	}
	slices.SortFunc(out.Nodes, func(a, b tree.NodeState) int { return cmp.Compare(a.Ino, b.Ino) })
	return out
}

func wantSame(t *testing.T, what string, got, want tree.State) {
	t.Helper()
	g, w := norm(got), norm(want)
	// A create that lost its name to another took a number nobody saw:
	// the journal need not know it. It must know every number a node has
	// or had (Numbered included: see numbered).
	top := uint64(0)
	for _, n := range w.Nodes {
		top = max(top, n.Ino)
	}
	if g.LastIno < top || g.LastIno > w.LastIno {
		t.Errorf("%s: last inode %d, want from %d to %d", what, g.LastIno, top, w.LastIno)
	}
	g.LastIno = w.LastIno
	if reflect.DeepEqual(g, w) {
		return
	}
	byIno := map[uint64]tree.NodeState{}
	for _, n := range g.Nodes {
		byIno[n.Ino] = n
	}
	for _, n := range w.Nodes {
		gn, ok := byIno[n.Ino]
		delete(byIno, n.Ino)
		switch {
		case !ok:
			t.Errorf("%s: node %d %q missing", what, n.Ino, n.Name)
		case !reflect.DeepEqual(gn, n):
			t.Errorf("%s: node %d is\n%s\nwant\n%s", what, n.Ino, show(gn), show(n))
		}
	}
	for ino, n := range byIno {
		t.Errorf("%s: node %d %q should not be there", what, ino, n.Name)
	}
}

func show(n tree.NodeState) string {
	s := fmt.Sprintf("%+v", n)
	if n.Dir != nil {
		s += fmt.Sprintf(" dir %+v", *n.Dir)
	}
	if n.File != nil {
		s += fmt.Sprintf(" file %+v", *n.File)
	}
	return s
}

// ops are the namespace's changes, picked at random by the race below.
func randomOp(x *journaled, r *rand.Rand) {
	root := x.tr.Root()
	dirs := []*tree.Dir{root}
	for _, e := range root.Entries() {
		if d, ok := e.Node.(*tree.Dir); ok {
			dirs = append(dirs, d)
		}
	}
	d := dirs[r.IntN(len(dirs))]
	dst := dirs[r.IntN(len(dirs))]
	name := "f" + strconv.Itoa(r.IntN(6))
	file := func() *tree.File {
		n, err := d.Lookup(name)
		if err != nil {
			return nil
		}
		f, _ := n.(*tree.File)
		return f
	}
	owner := tree.Owner{UID: uint32(r.IntN(2)) * 1000, GID: 5}
	switch r.IntN(11) {
	case 0, 1:
		d.Create(0, name, owner, 0o640, nil)
	case 2:
		d.Unlink(0, name)
	case 3:
		root.Mkdir(0, "d"+strconv.Itoa(r.IntN(3)), owner, 0o750, nil)
	case 4:
		root.Rmdir(0, "d"+strconv.Itoa(r.IntN(3)))
	case 5:
		d.Rename(0, name, dst, "f"+strconv.Itoa(r.IntN(6)), []uint32{0, tree.RenameNoReplace, tree.RenameExchange}[r.IntN(3)])
	case 6:
		// A directory moves and comes back, or replaces another (empty).
		n := "d" + strconv.Itoa(r.IntN(3))
		if r.IntN(2) == 0 {
			root.Rename(0, n, root, n+"x", 0)
			root.Rename(0, n+"x", root, n, 0)
		} else {
			root.Rename(0, n, root, "d"+strconv.Itoa(r.IntN(3)), 0)
		}
	case 7:
		if f := file(); f != nil {
			mode, uid := uint32(r.IntN(0o777)), uint32(r.IntN(2))*1000
			at := time.Unix(int64(r.IntN(1<<30)), 0)
			f.SetMeta(tree.Change{Mode: &mode, UID: &uid, Atime: &at})
		}
	case 8:
		if f := file(); f != nil {
			f.SetAccess(accesses[r.IntN(len(accesses))])
		}
	case 9:
		if f := file(); f != nil {
			f.Buffer().Resize(context.Background(), uint64(1+r.IntN(3))*page)
		}
	case 10:
		if r.IntN(2) == 0 {
			d.SetDefaultAccess(accesses[r.IntN(len(accesses))])
		} else {
			ino := x.tr.NewIno()
			for old := x.numbered.Load(); old < ino && !x.numbered.CompareAndSwap(old, ino); old = x.numbered.Load() {
			}
		}
	}
}

// TestJournalFollowsTree: several workers change the namespace at once
// (create, unlink, mkdir, rmdir, rename and exchange across PDs, chmod,
// chown, utimes, access, resize, default access) while the journal is
// compacted now and then; at every pause, and at the end, the journal
// replayed is the tree's own State. Then the tree's process goes (its
// registrations with it), and a new one restores from the journal alone.
func TestJournalFollowsTree(t *testing.T) {
	x := newJournaled(t)
	const workers, rounds, ops = 4, 5, 150
	for round := range rounds {
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(round), uint64(w)))
				for range ops {
					randomOp(x, r)
				}
			})
		}
		wg.Go(func() {
			for range 3 {
				if err := x.j.Compact(x.tr.Checkpoint); err != nil {
					t.Errorf("Compact: %v", err)
				}
				time.Sleep(time.Millisecond)
			}
		})
		wg.Wait()
		if err := x.j.Err(); err != nil {
			t.Fatal(err)
		}
		want, err := x.tr.State()
		if err != nil {
			t.Fatal(err)
		}
		got := x.replay(t)
		wantSame(t, fmt.Sprintf("round %d", round), got, want)
		if n := x.numbered.Load(); got.LastIno < n {
			t.Errorf("round %d: last inode %d, but NewIno gave %d", round, got.LastIno, n)
		}
		if t.Failed() {
			return
		}
	}
	want, _ := x.tr.State()
	if len(want.Nodes) < 5 {
		t.Fatalf("the race left %d nodes: too few to tell", len(want.Nodes))
	}

	// A crash: nobody saves the state; the journal has it.
	fd, err := x.st.Handover()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.mgr.Leave(); err != nil {
		t.Fatal(err)
	}
	st2, err := store.AdoptTmpfs(fd, storeOpt)
	if err != nil {
		t.Fatal(err)
	}
	defer st2.Close()
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	mgr2 := buffer.NewManager(dev, buffer.Options{Store: st2, Allowed: allRemote}, nil)
	defer mgr2.Close()
	tr2, err := tree.Restore(mgr2, tree.Options{}, x.replay(t))
	if err != nil {
		t.Fatalf("Restore from the journal: %v", err)
	}
	got, err := tr2.State()
	if err != nil {
		t.Fatal(err)
	}
	// Registered again: one more generation each.
	for i := range want.Nodes {
		if f := want.Nodes[i].File; f != nil {
			k := *f
			k.Generation++
			want.Nodes[i].File = &k
		}
	}
	wantSame(t, "restored from the journal", got, want)
}

// TestJournalCutShort: a journal cut at any byte (a crash in the middle
// of a record) replays as the namespace was after its last whole record.
func TestJournalCutShort(t *testing.T) {
	x := newJournaled(t)
	sizes := []int64{x.j.Size()}
	states := []tree.State{}
	save := func() {
		st, err := x.tr.State()
		if err != nil {
			t.Fatal(err)
		}
		states = append(states, st)
		sizes = append(sizes, x.j.Size())
	}
	save()
	root := x.tr.Root()
	d, err := root.Mkdir(0, "d", tree.Owner{UID: 1000}, 0o700, nil)
	if err != nil {
		t.Fatal(err)
	}
	save()
	f, err := d.Create(0, "f", tree.Owner{UID: 1000}, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	save()
	if err := f.SetAccess(allRemote); err != nil {
		t.Fatal(err)
	}
	save()
	if err := d.Rename(0, "f", root, "g", 0); err != nil {
		t.Fatal(err)
	}
	save()
	if err := root.Unlink(0, "g"); err != nil {
		t.Fatal(err)
	}
	save()
	if _, err := root.Mkdir(0, "e", tree.Owner{}, 0o755, nil); err != nil {
		t.Fatal(err)
	}
	save()
	if err := root.Rename(0, "d", root, "e", 0); err != nil { // over an empty directory
		t.Fatal(err)
	}
	save()
	for _, name := range []string{"x", "y"} {
		if _, err := root.Create(0, name, tree.Owner{}, 0o600, nil); err != nil {
			t.Fatal(err)
		}
		save()
	}
	if err := root.Rename(0, "x", root, "y", tree.RenameExchange); err != nil {
		t.Fatal(err)
	}
	save()
	data := make([]byte, x.j.Size())
	if _, err := x.f.ReadAt(data, 0); err != nil {
		t.Fatal(err)
	}
	for i, st := range states {
		// From the end of change i's records to before the end of the
		// next change's first (a change of several records may show
		// halfway: a registration made and its access not yet set).
		last := int64(len(data))
		if i+2 < len(sizes) {
			last = sizes[i+1] + int64(bytes.IndexByte(data[sizes[i+1]:], '\n'))
		}
		for cut := sizes[i+1]; cut <= last; cut++ {
			got, err := journal.Replay(bytes.NewReader(data[:cut]), cut)
			if err != nil {
				t.Fatalf("cut at %d: %v", cut, err)
			}
			wantSame(t, fmt.Sprintf("cut at %d (after change %d)", cut, i), got, st)
			if t.Failed() {
				return
			}
		}
	}
}

// TestJournalCompactWindow: a change made while Compact saves, after
// the save read the tree, is in the journal only as a record written
// before the new state: Replay applies it again on that state.
func TestJournalCompactWindow(t *testing.T) {
	x := newJournaled(t)
	root := x.tr.Root()
	f, err := root.Create(0, "f", tree.Owner{}, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = x.j.Compact(func() (tree.State, error) {
		st, err := x.tr.Checkpoint()
		if err == nil {
			mode := uint32(0o640)
			err = errors.Join(f.SetMeta(tree.Change{Mode: &mode}), root.Rename(0, "f", root, "g", 0))
		}
		return st, err
	})
	if err != nil {
		t.Fatal(err)
	}
	want, _ := x.tr.State()
	wantSame(t, "after a change during Compact", x.replay(t), want)
}

// TestJournalKeepsNewIno: a number NewIno gave, after the last node
// made, is in the replayed state: a process restored from the journal
// never gives it to a node of its own.
func TestJournalKeepsNewIno(t *testing.T) {
	x := newJournaled(t)
	if _, err := x.tr.Root().Create(0, "f", tree.Owner{}, 0o600, nil); err != nil {
		t.Fatal(err)
	}
	ino := x.tr.NewIno()
	if got := x.replay(t).LastIno; got < ino {
		t.Errorf("replayed last inode %d, but NewIno gave %d: a restored tree would give it again", got, ino)
	}
}

// TestJournalBacking: the backing ids the kernel holds come back from
// the journal as they were last set: across a compaction (in its state
// record), set while it saves, and cleared after it.
func TestJournalBacking(t *testing.T) {
	x := newJournaled(t)
	x.j.Backing(5, 7)
	x.j.Backing(6, 9)
	x.j.Backing(9, 4)
	err := x.j.Compact(func() (tree.State, error) {
		x.j.Backing(8, 3)
		x.j.Backing(9, 0)
		return x.tr.Checkpoint()
	})
	if err != nil {
		t.Fatal(err)
	}
	x.j.Backing(6, 0)
	x.j.Backing(10, 2)
	rec, err := journal.Recover(x.f, x.j.Size())
	if err != nil {
		t.Fatal(err)
	}
	if want := map[uint64]int32{5: 7, 8: 3, 10: 2}; !reflect.DeepEqual(rec.Backing, want) {
		t.Errorf("backing ids recovered %v, want %v", rec.Backing, want)
	}
}

// TestJournalDone: the requests the tree's changes were made for come
// back from the journal, with the change that completed each (those
// before a compaction too: its state record keeps the last ones); a
// request refused, or that a later change of its own completes, is not
// done.
func TestJournalDone(t *testing.T) {
	x := newJournaled(t)
	root := x.tr.Root()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err := root.Create(11, "f", tree.Owner{}, 0o600, nil)
	must(err)
	_, err = root.Mkdir(12, "d", tree.Owner{}, 0o700, nil)
	must(err)
	_, err = root.Create(0, "g", tree.Owner{}, 0o600, nil)
	must(err)
	if _, err := root.Create(13, "f", tree.Owner{}, 0o600, nil); err == nil {
		t.Fatal("a create of a name taken succeeded")
	}
	must(x.j.Compact(x.tr.Checkpoint))
	must(root.Rename(14, "g", root, "f", 0)) // over f: its removal is not 14's end
	must(root.Unlink(15, "f"))
	must(root.Rmdir(16, "d"))
	_, err = root.Create(0, "a", tree.Owner{}, 0o600, nil)
	must(err)
	_, err = root.Mkdir(0, "b", tree.Owner{}, 0o700, nil)
	must(err)
	must(root.Rename(17, "a", root, "b", tree.RenameExchange))
	rec, err := journal.Recover(x.f, x.j.Size())
	must(err)
	if want := map[uint64]bool{11: true, 12: true, 14: true, 15: true, 16: true, 17: true}; !reflect.DeepEqual(rec.Done, want) {
		t.Errorf("requests done recovered %v, want %v", rec.Done, want)
	}
	// A rename's one record with its request is its last: a crash after
	// the removal of the file renamed over, or between the two names of
	// an exchange, must not find it done.
	b := make([]byte, x.j.Size())
	if _, err := x.f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	for _, req := range []string{"14", "17"} {
		var ops []string
		for line := range bytes.Lines(b) {
			if bytes.Contains(line, []byte(`"unique":`+req+`}`)) {
				ops = append(ops, string(line[:bytes.IndexByte(line, ',')]))
			}
		}
		if want := []string{`{"op":"named"`}; !slices.Equal(ops, want) {
			t.Errorf("the records of rename %s: %q, want %q", req, ops, want)
		}
	}
}

// TestJournalCompactFrees: a journal of a long churn holds the memory
// of its last state and the records since, not of every change.
func TestJournalCompactFrees(t *testing.T) {
	x := newJournaled(t)
	root := x.tr.Root()
	for i := range 3000 {
		if _, err := root.Create(0, "f", tree.Owner{}, 0o600, nil); err != nil {
			t.Fatal(err)
		}
		if err := root.Unlink(0, "f"); err != nil {
			t.Fatal(err)
		}
		if i%1000 == 999 {
			if err := x.j.Compact(x.tr.Checkpoint); err != nil {
				t.Fatal(err)
			}
		}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(x.f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if held := st.Blocks * 512; held > 4*page || x.j.Size() < 100*page {
		t.Errorf("after 6,000 changes the journal holds %d bytes of %d written: compaction frees nothing", held, x.j.Size())
	}
	want, _ := x.tr.State()
	wantSame(t, "after compaction", x.replay(t), want)
	// A restart reads what is left, not the holes before it.
	cf := &countingFile{File: x.f}
	rec, err := journal.Recover(cf, x.j.Size())
	if err != nil {
		t.Fatal(err)
	}
	wantSame(t, "recovered after compaction", rec.Tree, want)
	if n := cf.read.Load(); n > 4*page {
		t.Errorf("Recover read %d bytes of a journal compaction left %d bytes of: it reads the holes", n, st.Blocks*512)
	}
}

// countingFile counts the bytes read through it.
type countingFile struct {
	*os.File
	read atomic.Int64
}

func (c *countingFile) ReadAt(p []byte, off int64) (int, error) {
	c.read.Add(int64(len(p)))
	return c.File.ReadAt(p, off)
}

// TestJournalLeavesOutLost: a pool in the journal (its slots die with
// the process) is left out of what it restores, with its files, and said
// to be lost; the rest is restored, before a compaction and after it;
// once the pool is removed, nothing is lost.
func TestJournalLeavesOutLost(t *testing.T) {
	x := newJournaled(t)
	root := x.tr.Root()
	p, err := root.Mkdir(0, "pool", tree.Owner{}, 0o755, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.MakePool(page, 2, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Create(0, "slot", tree.Owner{}, 0o600, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := root.Create(0, "kept", tree.Owner{}, 0o600, nil); err != nil {
		t.Fatal(err)
	}
	for _, when := range []string{"before a compaction", "after one"} {
		rec, err := journal.Recover(x.f, x.j.Size())
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		var names []string
		for _, n := range rec.Tree.Nodes {
			names = append(names, n.Name)
		}
		if !slices.Equal(names, []string{"", "kept"}) || len(rec.Lost) != 1 || !strings.Contains(rec.Lost[0], `"pool"`) || !strings.Contains(rec.Lost[0], "holding 1") {
			t.Errorf("%s: restores %q, lost %q; want the root and kept, the pool lost with its file", when, names, rec.Lost)
		}
		if err := x.j.Compact(x.tr.Checkpoint); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Unlink(0, "slot"); err != nil {
		t.Fatal(err)
	}
	if err := root.Rmdir(0, "pool"); err != nil {
		t.Fatal(err)
	}
	want, _ := x.tr.State()
	wantSame(t, "after the pool went", x.replay(t), want)
	if rec, err := journal.Recover(x.f, x.j.Size()); err != nil || len(rec.Lost) != 0 {
		t.Errorf("after the pool went: lost %q, %v", rec.Lost, err)
	}
}

// TestJournalCrossesWindows: records are copied into a mapping of the
// file a window at a time; those that cross from one window into the
// next, and a state bigger than a window, come back whole.
func TestJournalCrossesWindows(t *testing.T) {
	x := newJournaled(t)
	root := x.tr.Root()
	// Names of every length shift where the records end; 6,000 files
	// make a state of about 1.5 MiB.
	for i := range 6000 {
		if _, err := root.Create(0, fmt.Sprintf("%0*d", 1+i%200, i), tree.Owner{}, 0o600, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := x.j.Compact(x.tr.Checkpoint); err != nil {
		t.Fatal(err)
	}
	for i := range 20000 { // about 2.5 MiB of records
		at := time.Unix(int64(i), 0)
		if err := root.SetMeta(tree.Change{Atime: &at}); err != nil {
			t.Fatal(err)
		}
	}
	if x.j.Size() < 4<<20 {
		t.Fatalf("%d bytes written: the test no longer crosses windows", x.j.Size())
	}
	want, _ := x.tr.State()
	wantSame(t, "after 26,000 changes", x.replay(t), want)
	var st unix.Stat_t
	if err := unix.Fstat(int(x.f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if st.Size < x.j.Size() {
		t.Errorf("the file is %d bytes long and %d were written", st.Size, x.j.Size())
	}
}
