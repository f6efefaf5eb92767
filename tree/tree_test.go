package tree_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

const page = 4096

const allRemote = verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic

// newTree makes a tree on a fresh soft device whose new files get size
// bytes and every remote access, so the responder can tell which PD a
// buffer is registered in. maxMR 0 is rxe's.
func newTree(t *testing.T, size uint64, maxMR int) *tree.Tree {
	t.Helper()
	return newTreeWith(t, size, maxMR, nil)
}

// newTreeWith is newTree with changed as Options.Changed.
func newTreeWith(t *testing.T, size uint64, maxMR int, changed func(tree.Node)) *tree.Tree {
	t.Helper()
	dev, err := soft.New(soft.Options{MaxMR: maxMR}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: allRemote}, nil)
	tr, err := tree.New(mgr, tree.Options{DefaultSize: size, DefaultAccess: allRemote, Umask: 0o022, Changed: changed},
		allRemote, tree.Owner{UID: 7, GID: 8}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := mgr.Close(); err != nil {
			t.Errorf("manager Close: %v", err)
		}
		if st := mgr.Stats(); st.Buffers != 0 || st.PDs != 0 || st.PinnedBytes != 0 {
			t.Errorf("after Close: %+v", st)
		}
		dev.Close()
	})
	return tr
}

func wantErrno(t *testing.T, err error, want syscall.Errno, what string) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: %v, want %s", what, err, want)
	}
}

func create(t *testing.T, d *tree.Dir, name string) *tree.File {
	t.Helper()
	f, err := d.Create(0, name, tree.Owner{}, 0o644, nil)
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	return f
}

func mkdir(t *testing.T, d *tree.Dir, name string) *tree.Dir {
	t.Helper()
	sub, err := d.Mkdir(0, name, tree.Owner{}, 0o755, nil)
	if err != nil {
		t.Fatalf("mkdir %s: %v", name, err)
	}
	return sub
}

func names(d *tree.Dir) string {
	var s []string
	for _, e := range d.Entries() {
		s = append(s, e.Name)
	}
	return strings.Join(s, ",")
}

// reaches says whether a peer with a queue pair in d's PD can WRITE to
// f's buffer with its current keys: the NIC's PD check, not bookkeeping.
func reaches(t *testing.T, d *tree.Dir, f *tree.File) bool {
	t.Helper()
	r := d.Domain().VerbsPD().(verbs.ResponderPD).Responder()
	in := f.Buffer().Info()
	switch st := r.Write(uint64(in.Addr), in.RKey, []byte{1}); st {
	case verbs.WCSuccess:
		return true
	case verbs.WCRemAccessErr:
		return false
	default:
		t.Fatalf("WRITE: %v", st)
		return false
	}
}

func TestCreateLookupEntries(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	var prepared *tree.File
	f, err := root.Create(0, "b", tree.Owner{UID: 1, GID: 2}, 0o4777, func(f *tree.File) error {
		prepared = f
		return nil
	})

	if err != nil {
		t.Fatal(err)
	}
	if prepared != f {
		t.Errorf("prepare saw %p, not the file %p", prepared, f)
	}
	if dir, name := f.Name(); dir != root || name != "b" {
		t.Errorf("Name() = %p %q, want the root's b", dir, name)
	}
	if m := f.Meta(); m.Mode != 0o755 || m.UID != 1 || m.GID != 2 {
		t.Errorf("meta %+v: want mode 0755 (umask 022, no set-id), owner 1:2", m)
	}
	if in := f.Buffer().Info(); in.State != buffer.Registered || in.Size != page || in.PD != root.Domain().PD() || in.Access != allRemote {
		t.Errorf("new buffer %+v", in)
	}
	create(t, root, "a")
	mkdir(t, root, "c")
	if got := names(root); got != "a,b,c" {
		t.Errorf("entries %q", got)
	}
	if n, err := root.Lookup("b"); err != nil || n != tree.Node(f) {
		t.Errorf("Lookup b: %v, %v", n, err)
	}
	_, err = root.Lookup("x")
	wantErrno(t, err, syscall.ENOENT, "lookup of a missing name")

	before := tr.Manager().Stats()
	_, err = root.Create(0, "b", tree.Owner{}, 0o644, nil)
	wantErrno(t, err, syscall.EEXIST, "create over an existing name")
	_, err = root.Create(0, strings.Repeat("n", tree.MaxNameLen+1), tree.Owner{}, 0o644, nil)
	wantErrno(t, err, syscall.ENAMETOOLONG, "create with a 256-byte name")
	_, err = root.Create(0, "p", tree.Owner{}, 0o644, func(*tree.File) error { return syscall.EMFILE })
	wantErrno(t, err, syscall.EMFILE, "create whose prepare fails")
	_, err = root.Mkdir(0, "c", tree.Owner{}, 0o755, nil)
	wantErrno(t, err, syscall.EEXIST, "mkdir over an existing name")
	if after := tr.Manager().Stats(); !reflect.DeepEqual(after, before) {
		t.Errorf("failed creates left something: %+v, was %+v", after, before)
	}
	if got := names(root); got != "a,b,c" {
		t.Errorf("entries after failures %q", got)
	}
}

func TestMkdirIsAPD(t *testing.T) {
	tr := newTree(t, page, 0)
	sub := mkdir(t, tr.Root(), "tenant")
	if sub.Domain().PD() == tr.Root().Domain().PD() {
		t.Fatal("a new directory shares its parent's PD")
	}
	if a := sub.Domain().DefaultAccess(); a != allRemote {
		t.Errorf("default access %s", a)
	}
	f := create(t, sub, "b")
	if f.Buffer().Info().PD != sub.Domain().PD() {
		t.Errorf("file in pd %d, want %d", f.Buffer().Info().PD, sub.Domain().PD())
	}
	if !reaches(t, sub, f) || reaches(t, tr.Root(), f) {
		t.Error("a buffer must be reachable from its own PD only")
	}
	if st := tr.Manager().Stats(); st.PDs != 2 {
		t.Errorf("PDs %d, want 2", st.PDs)
	}
}

func TestRmdir(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	sub := mkdir(t, root, "d")
	create(t, root, "f")
	create(t, sub, "inner")
	wantErrno(t, root.Rmdir(0, "nope"), syscall.ENOENT, "rmdir of a missing name")
	wantErrno(t, root.Rmdir(0, "f"), syscall.ENOTDIR, "rmdir of a file")
	wantErrno(t, root.Rmdir(0, "d"), syscall.ENOTEMPTY, "rmdir of a directory with a file")
	if err := sub.Unlink(0, "inner"); err != nil {
		t.Fatal(err)
	}
	if err := root.Rmdir(0, "d"); err != nil {
		t.Fatalf("rmdir of an empty directory: %v", err)
	}
	if st := tr.Manager().Stats(); st.PDs != 1 {
		t.Errorf("PDs %d after rmdir, want 1: the PD was not deallocated", st.PDs)
	}
	_, err := tr.Resolve("/d")
	wantErrno(t, err, syscall.ENOENT, "resolve of a removed directory")
}

func TestUnlink(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	f := create(t, root, "f")
	mkdir(t, root, "d")
	wantErrno(t, root.Unlink(0, "nope"), syscall.ENOENT, "unlink of a missing name")
	wantErrno(t, root.Unlink(0, "d"), syscall.EISDIR, "unlink of a directory")
	if !reaches(t, root, f) {
		t.Fatal("a registered buffer is not reachable")
	}
	in := f.Buffer().Info()
	if err := root.Unlink(0, "f"); err != nil {
		t.Fatal(err)
	}
	if !f.Unlinked() {
		t.Error("Unlinked false after unlink")
	}
	r := root.Domain().VerbsPD().(verbs.ResponderPD).Responder()
	if st := r.Write(uint64(in.Addr), in.RKey, []byte{1}); st != verbs.WCRemAccessErr {
		t.Errorf("WRITE with the keys of an unlinked file: %v, want REM_ACCESS_ERR", st)
	}
	if st := tr.Manager().Stats(); st.Buffers != 0 || st.PinnedBytes != 0 {
		t.Errorf("after unlink %+v", st)
	}
	if got := names(root); got != "d" {
		t.Errorf("entries %q", got)
	}
}

// A rename within a directory only renames: same region, same keys.
func TestRenameWithinDirectory(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	f := create(t, root, "a")
	before := f.Buffer().Info()
	if err := root.Rename(0, "a", root, "b", 0); err != nil {
		t.Fatal(err)
	}
	if after := f.Buffer().Info(); after != before {
		t.Errorf("rename within a directory changed the buffer: %+v, was %+v", after, before)
	}
	if got := names(root); got != "b" {
		t.Errorf("entries %q", got)
	}
}

// Every node has an inode number of its own for its whole life: the
// root's is 1, and a rename, within a directory or to another, or an
// unlink and a new file of the same name, never gives one twice.
func TestInodeNumbers(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	if root.Ino() != 1 {
		t.Errorf("root inode %d, want 1", root.Ino())
	}
	sub := mkdir(t, root, "d")
	a := create(t, root, "a")
	seen := map[uint64]string{1: "/", sub.Ino(): "d"}
	if _, dup := seen[a.Ino()]; dup {
		t.Fatalf("a has inode %d, as %s has", a.Ino(), seen[a.Ino()])
	}
	seen[a.Ino()] = "a"
	ino := a.Ino()
	if err := root.Rename(0, "a", root, "b", 0); err != nil {
		t.Fatal(err)
	}
	if err := root.Rename(0, "b", sub, "c", 0); err != nil {
		t.Fatal(err)
	}
	if a.Ino() != ino {
		t.Errorf("renamed twice, the file's inode went from %d to %d", ino, a.Ino())
	}
	if err := sub.Unlink(0, "c"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b", "c"} {
		f := create(t, sub, name)
		if was, dup := seen[f.Ino()]; dup {
			t.Errorf("new file %s has inode %d, as %s had", name, f.Ino(), was)
		}
		seen[f.Ino()] = name
	}
}

// A move to another directory re-registers in that directory's PD: a
// peer of the new PD reaches the buffer, one of the old PD does not.
func TestRenameMovesAcrossPDs(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	dst := mkdir(t, root, "dst")
	f := create(t, root, "f")
	before := f.Buffer().Info()
	if err := root.Rename(0, "f", dst, "g", 0); err != nil {
		t.Fatal(err)
	}
	after := f.Buffer().Info()
	if after.PD != dst.Domain().PD() || after.RKey == before.RKey || after.State != buffer.Registered {
		t.Errorf("after the move %+v, was %+v", after, before)
	}
	if !reaches(t, dst, f) {
		t.Error("a peer in the new PD cannot reach the moved buffer")
	}
	if reaches(t, root, f) {
		t.Error("a peer in the old PD reaches the moved buffer")
	}
	if names(root) != "dst" || names(dst) != "g" {
		t.Errorf("entries %q and %q", names(root), names(dst))
	}
	wantErrno(t, root.Rmdir(0, "dst"), syscall.ENOTEMPTY, "rmdir of the move's target")
}

// A move that cannot register in the new PD changes nothing.
func TestRenameFailedMoveChangesNothing(t *testing.T) {
	tr := newTree(t, page, 1) // max_mr 1: the move's new region is refused
	root := tr.Root()
	dst := mkdir(t, root, "dst")
	f := create(t, root, "f")
	before := f.Buffer().Info()
	wantErrno(t, root.Rename(0, "f", dst, "f", 0), syscall.EINVAL, "move with the device's regions exhausted")
	if after := f.Buffer().Info(); after != before {
		t.Errorf("failed move changed the buffer: %+v, was %+v", after, before)
	}
	if names(root) != "dst,f" || names(dst) != "" {
		t.Errorf("entries %q and %q", names(root), names(dst))
	}
	if !reaches(t, root, f) {
		t.Error("the buffer left its PD")
	}
}

// Renaming over a file frees it; over a directory needs it empty and
// deallocates its PD.
func TestRenameOver(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	a := create(t, root, "a")
	b := create(t, root, "b")
	bIn := b.Buffer().Info()
	if err := root.Rename(0, "a", root, "b", 0); err != nil {
		t.Fatal(err)
	}
	if !b.Unlinked() || a.Unlinked() {
		t.Errorf("unlinked: replaced %v, moved %v", b.Unlinked(), a.Unlinked())
	}
	r := root.Domain().VerbsPD().(verbs.ResponderPD).Responder()
	if st := r.Write(uint64(bIn.Addr), bIn.RKey, []byte{1}); st != verbs.WCRemAccessErr {
		t.Errorf("WRITE to the replaced buffer: %v, want REM_ACCESS_ERR", st)
	}
	if st := tr.Manager().Stats(); st.Buffers != 1 {
		t.Errorf("buffers %d after rename over, want 1", st.Buffers)
	}
	if n, _ := root.Lookup("b"); n != tree.Node(a) {
		t.Error("b is not the renamed file")
	}

	d1 := mkdir(t, root, "d1")
	d2 := mkdir(t, root, "d2")
	create(t, d2, "x")
	wantErrno(t, root.Rename(0, "b", root, "d1", 0), syscall.EISDIR, "file over a directory")
	wantErrno(t, root.Rename(0, "d1", root, "b", 0), syscall.ENOTDIR, "directory over a file")
	wantErrno(t, root.Rename(0, "d1", root, "d2", 0), syscall.ENOTEMPTY, "directory over a non-empty one")
	if err := d2.Unlink(0, "x"); err != nil {
		t.Fatal(err)
	}
	pds := tr.Manager().Stats().PDs
	if err := root.Rename(0, "d1", root, "d2", 0); err != nil {
		t.Fatalf("directory over an empty one: %v", err)
	}
	if st := tr.Manager().Stats(); st.PDs != pds-1 {
		t.Errorf("PDs %d, want %d: the replaced directory's PD was not deallocated", st.PDs, pds-1)
	}
	if n, _ := root.Lookup("d2"); n != tree.Node(d1) {
		t.Error("d2 is not the renamed directory")
	}
	if p := d1.Path(); p != "/d2" {
		t.Errorf("Path %q, want /d2", p)
	}
}

func TestRenameFlags(t *testing.T) {
	tr := newTree(t, page, 0)
	root := tr.Root()
	a := create(t, root, "a")
	b := create(t, root, "b")
	other := mkdir(t, root, "o")
	wantErrno(t, root.Rename(0, "a", root, "b", tree.RenameNoReplace), syscall.EEXIST, "RENAME_NOREPLACE over b")
	wantErrno(t, root.Rename(0, "a", root, "b", 4), syscall.EINVAL, "RENAME_WHITEOUT")
	wantErrno(t, root.Rename(0, "a", root, "b", tree.RenameExchange|tree.RenameNoReplace), syscall.EINVAL, "EXCHANGE|NOREPLACE")
	wantErrno(t, root.Rename(0, "a", root, "c", tree.RenameExchange), syscall.ENOENT, "exchange with a missing name")
	wantErrno(t, root.Rename(0, "nope", root, "c", 0), syscall.ENOENT, "rename of a missing name")
	wantErrno(t, root.Rename(0, "a", root, strings.Repeat("n", 256), 0), syscall.ENAMETOOLONG, "rename to a 256-byte name")
	if err := root.Rename(0, "a", root, "c", tree.RenameNoReplace); err != nil {
		t.Fatalf("RENAME_NOREPLACE to a free name: %v", err)
	}
	if err := root.Rename(0, "c", root, "b", tree.RenameExchange); err != nil {
		t.Fatalf("exchange within a PD: %v", err)
	}
	if n, _ := root.Lookup("b"); n != tree.Node(a) {
		t.Error("after the exchange b is not a")
	}
	if n, _ := root.Lookup("c"); n != tree.Node(b) {
		t.Error("after the exchange c is not b")
	}
	create(t, other, "x")
	wantErrno(t, root.Rename(0, "b", other, "x", tree.RenameExchange), syscall.EINVAL, "exchanging files between PDs")
	if a.Buffer().Info().PD != root.Domain().PD() {
		t.Error("a refused exchange moved a buffer")
	}
}

func TestResolveAndPath(t *testing.T) {
	tr := newTree(t, 0, 0)
	root := tr.Root()
	a := mkdir(t, root, "a")
	b := mkdir(t, a, "b")
	create(t, a, "f")
	for p, want := range map[string]*tree.Dir{"/": root, "": root, "a": a, "/a/b": b, "a/b/": b, "/a/../a/b": b} {
		d, err := tr.Resolve(p)
		if err != nil || d != want {
			t.Errorf("Resolve(%q) = %v, %v", p, d, err)
		}
	}
	_, err := tr.Resolve("/a/x")
	wantErrno(t, err, syscall.ENOENT, "resolve a missing directory")
	_, err = tr.Resolve("/a/f")
	wantErrno(t, err, syscall.ENOTDIR, "resolve a file")
	if dom, err := tr.Domain("/a/b"); err != nil || dom != b.Domain() {
		t.Errorf("Domain(/a/b) = %v, %v", dom, err)
	}
	if root.Path() != "/" || b.Path() != "/a/b" {
		t.Errorf("paths %q %q", root.Path(), b.Path())
	}
	c := mkdir(t, root, "c")
	if err := a.Rename(0, "b", c, "bb", 0); err != nil {
		t.Fatal(err)
	}
	if b.Path() != "/c/bb" {
		t.Errorf("path after the move %q", b.Path())
	}
	if d, err := tr.Resolve("/c/bb"); err != nil || d != b {
		t.Errorf("Resolve after the move: %v, %v", d, err)
	}
}

// Metadata: the umask masks the creator's mode; set-id bits are never
// stored; SetMeta sets the change time; creating, renaming and removing
// entries changes the directories' times.
func TestMeta(t *testing.T) {
	tr := newTree(t, 0, 0)
	root := tr.Root()
	clock := time.Unix(1000, 0)
	defer tree.SetClock(func() time.Time { return clock })()
	f, err := root.Create(0, "f", tree.Owner{UID: 3, GID: 4}, 0o6777, nil)
	if err != nil {
		t.Fatal(err)
	}
	if m := f.Meta(); m.Mode != 0o755 || m.UID != 3 || m.GID != 4 || !m.Mtime.Equal(clock) {
		t.Errorf("new file %+v", m)
	}
	// The sticky bit is kept at creation, as chmod keeps it.
	sf, err := root.Create(0, "sticky", tree.Owner{}, 0o7777, nil)
	if err != nil {
		t.Fatal(err)
	}
	sd, err := root.Mkdir(0, "stickydir", tree.Owner{}, 0o1777, nil)
	if err != nil {
		t.Fatal(err)
	}
	if fm, dm := sf.Meta().Mode, sd.Meta().Mode; fm != 0o1755 || dm != 0o1755 {
		t.Errorf("created with 07777 and 01777: modes %o and %o, want 1755", fm, dm)
	}
	clock = time.Unix(2000, 0)
	mode, uid := uint32(0o7000), uint32(9)
	if err := f.SetMeta(tree.Change{Mode: &mode, UID: &uid}); err != nil {
		t.Fatal(err)
	}
	if m := f.Meta(); m.Mode != 0o1000 || m.UID != 9 || m.GID != 4 || !m.Ctime.Equal(clock) || !m.Mtime.Equal(time.Unix(1000, 0)) {
		t.Errorf("after SetMeta %+v", m)
	}
	d := mkdir(t, root, "d")
	for i, op := range []struct {
		run     func() error
		changed []*tree.Dir
	}{
		{func() error { _, err := root.Create(0, "g", tree.Owner{}, 0o644, nil); return err }, []*tree.Dir{root}},
		{func() error { return root.Rename(0, "g", d, "g", 0) }, []*tree.Dir{root, d}},
		{func() error { return d.Unlink(0, "g") }, []*tree.Dir{d}},
		{func() error { _, err := root.Mkdir(0, "e", tree.Owner{}, 0o755, nil); return err }, []*tree.Dir{root}},
		{func() error { return root.Rmdir(0, "e") }, []*tree.Dir{root}},
	} {
		clock = time.Unix(int64(3000+i), 0)
		if err := op.run(); err != nil {
			t.Fatal(err)
		}
		for _, dir := range op.changed {
			if m := dir.Meta(); !m.Mtime.Equal(clock) || !m.Ctime.Equal(clock) {
				t.Errorf("op %d: %s times %v %v, want %v", i, dir.Path(), m.Mtime, m.Ctime, clock)
			}
		}
	}
}

// A directory's link count is 2 plus its subdirectories, through mkdir,
// rmdir, renames and exchanges; a name past NAME_MAX is ENAMETOOLONG on
// lookup too.
func TestNlinkAndLongNames(t *testing.T) {
	tr := newTree(t, 0, 0)
	root := tr.Root()
	a := mkdir(t, root, "a")
	mkdir(t, a, "x")
	mkdir(t, a, "y")
	create(t, a, "f")
	b := mkdir(t, root, "b")
	if root.Nlink() != 4 || a.Nlink() != 4 || b.Nlink() != 2 {
		t.Fatalf("nlink root %d a %d b %d, want 4 4 2", root.Nlink(), a.Nlink(), b.Nlink())
	}
	if err := a.Rename(0, "x", b, "x", 0); err != nil {
		t.Fatal(err)
	}
	if a.Nlink() != 3 || b.Nlink() != 3 {
		t.Errorf("after moving a directory: a %d b %d, want 3 3", a.Nlink(), b.Nlink())
	}
	if err := a.Rename(0, "f", b, "x", tree.RenameExchange); err == nil {
		t.Error("exchanged a file with a directory across PDs")
	}
	if err := a.Rename(0, "y", b, "x", tree.RenameExchange); err != nil {
		t.Fatal(err)
	}
	if a.Nlink() != 3 || b.Nlink() != 3 {
		t.Errorf("after exchanging two directories: a %d b %d, want 3 3", a.Nlink(), b.Nlink())
	}
	mkdir(t, b, "z")
	if err := b.Rename(0, "x", b, "z", 0); err != nil { // over an empty directory
		t.Fatal(err)
	}
	if b.Nlink() != 3 {
		t.Errorf("after renaming over a directory: b %d, want 3", b.Nlink())
	}
	if err := b.Rmdir(0, "z"); err != nil {
		t.Fatal(err)
	}
	if b.Nlink() != 2 {
		t.Errorf("after rmdir: b %d, want 2", b.Nlink())
	}
	_, err := root.Lookup(strings.Repeat("n", tree.MaxNameLen+1))
	wantErrno(t, err, syscall.ENAMETOOLONG, "lookup of a 256-byte name")
	_, err = root.Lookup(strings.Repeat("n", tree.MaxNameLen))
	wantErrno(t, err, syscall.ENOENT, "lookup of a missing 255-byte name")
}

// failing is a device whose region at address fail refuses
// deregistration: a release that fails.
type failing struct {
	verbs.Device
	fail atomic.Uintptr
}

func (d *failing) AllocPD() (verbs.PD, error) {
	pd, err := d.Device.AllocPD()
	if err != nil {
		return nil, err
	}
	return &failingPD{PD: pd, d: d}, nil
}

type failingPD struct {
	verbs.PD
	d *failing
}

func (p *failingPD) RegMR(addr uintptr, length uint64, a verbs.Access) (verbs.MR, error) {
	mr, err := p.PD.RegMR(addr, length, a)
	if err != nil {
		return nil, err
	}
	return &failingMR{MR: mr, d: p.d}, nil
}

func (p *failingPD) Responder() verbs.Responder { return p.PD.(verbs.ResponderPD).Responder() }

type failingMR struct {
	verbs.MR
	d *failing
}

func (m *failingMR) Dereg() error {
	if m.d.fail.Load() == m.Addr() {
		return fmt.Errorf("dereg_mr: %w", syscall.EBUSY)
	}
	return m.MR.Dereg()
}

// A rename over a file whose release fails reports the failure and
// changes no name: the file moved for it goes back to its PD, the file
// renamed over stays, registered, and nothing is left unreachable.
func TestRenameOverFailedRelease(t *testing.T) {
	soft0, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	dev := &failing{Device: soft0}
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: allRemote}, nil)
	tr, err := tree.New(mgr, tree.Options{DefaultSize: page, DefaultAccess: allRemote}, allRemote, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dev.fail.Store(0)
		if _, err := mgr.Close(); err != nil {
			t.Errorf("manager Close: %v", err)
		}
		soft0.Close()
	})
	root := tr.Root()
	dst := mkdir(t, root, "dst")
	a := create(t, root, "a")
	old := create(t, dst, "b")
	dev.fail.Store(old.Buffer().Info().Addr)
	err = root.Rename(0, "a", dst, "b", 0)
	dev.fail.Store(0)
	wantErrno(t, err, syscall.EBUSY, "rename over a file whose release fails")
	if names(root) != "a,dst" || names(dst) != "b" {
		t.Errorf("entries %q and %q after the failed rename", names(root), names(dst))
	}
	if n, _ := dst.Lookup("b"); n != tree.Node(old) || old.Unlinked() {
		t.Error("the file renamed over left its name")
	}
	if !reaches(t, root, a) || reaches(t, dst, a) {
		t.Error("the moved file is not back in its own PD")
	}
	if old.Buffer().Info().State != buffer.Registered {
		t.Errorf("the file renamed over: %+v", old.Buffer().Info())
	}
	// Once releases work again, the same rename does.
	if err := root.Rename(0, "a", dst, "b", 0); err != nil {
		t.Fatal(err)
	}
	if !old.Unlinked() || names(dst) != "b" || names(root) != "dst" {
		t.Errorf("after the rename: %q %q", names(root), names(dst))
	}
}

// Unlink and rename do not hold the namespace while they wait for a
// buffer: while a long registration holds a buffer, an unlink of it
// waits, and lookups, listings, creates, renames and unlinks of other
// names go on meanwhile.
func TestNoNamespaceLockWhileWaiting(t *testing.T) {
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: allRemote, PopulateThreshold: 16 << 20, PopulateWorkers: 1, ChunkDelay: 100 * time.Millisecond}, nil)
	tr, err := tree.New(mgr, tree.Options{DefaultAccess: allRemote}, allRemote, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		mgr.Close()
		dev.Close()
	})
	root := tr.Root()
	other := mkdir(t, root, "other")
	create(t, other, "x")
	big := create(t, root, "big")
	resized := make(chan error)
	go func() { resized <- big.Buffer().Resize(context.Background(), 256<<20) }()
	for big.Buffer().Info().Progress.Total == 0 {
		time.Sleep(time.Millisecond)
	}
	unlinked := make(chan error)
	go func() { unlinked <- root.Unlink(0, "big") }()
	time.Sleep(50 * time.Millisecond) // the unlink waits for the buffer now
	for range 3 {
		if _, err := other.Lookup("x"); err != nil {
			t.Fatal(err)
		}
		if names(other) != "x" || other.Nlink() != 2 {
			t.Fatal("listing")
		}
		if err := other.Rename(0, "x", other, "y", 0); err != nil {
			t.Fatal(err)
		}
		if err := other.Rename(0, "y", other, "x", 0); err != nil {
			t.Fatal(err)
		}
		create(t, other, "z")
		if err := other.Unlink(0, "z"); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case err := <-unlinked:
		t.Fatalf("the unlink did not wait for the registration: %v", err)
	case err := <-resized:
		t.Fatalf("the registration ended before the calls on other names did: %v", err)
	default:
	}
	// A second unlink of the same name waits for the first, then finds
	// nothing.
	again := make(chan error)
	go func() { again <- root.Unlink(0, "big") }()
	if err := <-resized; err != nil {
		t.Fatal(err)
	}
	if err := <-unlinked; err != nil {
		t.Fatal(err)
	}
	wantErrno(t, <-again, syscall.ENOENT, "a second unlink of the same file")
	if _, err := root.Lookup("big"); err == nil {
		t.Error("big is still there")
	}
}

// slowCloser is a remote connection attached to a PD whose close takes
// until the test lets it end.
type slowCloser struct {
	closing chan struct{} // closed when Close begins
	release chan struct{} // closed by let
	began   sync.Once
	let     func() // lets Close end (once; at the test's end too)
}

func newSlowCloser(t *testing.T) *slowCloser {
	c := &slowCloser{closing: make(chan struct{}), release: make(chan struct{})}
	c.let = sync.OnceFunc(func() { close(c.release) })
	t.Cleanup(c.let)
	return c
}

func (c *slowCloser) Close() error {
	c.began.Do(func() { close(c.closing) })
	<-c.release
	return nil
}

// within fails the test unless f returns nil within ten seconds: a call
// that waits for the namespace lock held by a PD's slow close would not.
func within(t *testing.T, what string, f func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s waited for a directory's PD to close: the namespace stalls", what)
	}
}

// Rmdir, and a rename over an empty directory, do not hold the namespace
// while the directory's PD closes (its remote connections first, which
// can take seconds): other names answer meanwhile, and a create or mkdir
// in the directory going away waits for it, then finds it gone.
func TestNoNamespaceLockWhileRemovingADirectory(t *testing.T) {
	for _, way := range []string{"rmdir", "rename over"} {
		t.Run(way, func(t *testing.T) {
			root := newTree(t, 0, 0).Root()
			other := mkdir(t, root, "other")
			create(t, other, "x")
			gone := mkdir(t, root, "gone")
			mkdir(t, root, "src")
			c := newSlowCloser(t)
			if _, err := gone.Domain().Attach(c); err != nil {
				t.Fatal(err)
			}
			removed := make(chan error, 1)
			go func() {
				if way == "rmdir" {
					removed <- root.Rmdir(0, "gone")
				} else {
					removed <- root.Rename(0, "src", root, "gone", 0)
				}
			}()
			<-c.closing
			within(t, "lookup, listing, create, rename and unlink of other names", func() error {
				if _, err := other.Lookup("x"); err != nil {
					return err
				}
				if names(root) != "gone,other,src" {
					return fmt.Errorf("root lists %q while the directory goes", names(root))
				}
				if _, err := other.Create(0, "y", tree.Owner{}, 0o644, nil); err != nil {
					return err
				}
				if err := other.Rename(0, "y", other, "z", 0); err != nil {
					return err
				}
				if err := other.Unlink(0, "z"); err != nil {
					return err
				}
				_, err := other.Mkdir(0, "sub", tree.Owner{}, 0o755, nil)
				return err
			})
			// A file cannot come in: its buffer cannot go into the PD
			// going away. A directory (a PD of its own) waits for the
			// name, and finds the directory gone.
			within(t, "a create in the directory going away", func() error {
				if _, err := gone.Create(0, "f", tree.Owner{}, 0o644, nil); !errors.Is(err, syscall.ENOENT) {
					return fmt.Errorf("create in a directory going away: %v, want ENOENT", err)
				}
				return nil
			})
			added := make(chan error, 2)
			go func() {
				_, err := gone.Mkdir(0, "d", tree.Owner{}, 0o755, nil)
				added <- err
			}()
			go func() { added <- other.Rename(0, "sub", gone, "sub", 0) }()
			time.Sleep(50 * time.Millisecond)
			select {
			case err := <-added:
				t.Fatalf("a name was added to a directory going away (%v)", err)
			default:
			}
			c.let()
			if err := <-removed; err != nil {
				t.Fatalf("%s: %v", way, err)
			}
			for range 2 {
				if err := <-added; !errors.Is(err, syscall.ENOENT) {
					t.Errorf("mkdir or rename into a directory removed meanwhile: %v, want ENOENT", err)
				}
			}
			if names(other) != "sub,x" {
				t.Errorf("other lists %q after a rename into a directory removed meanwhile", names(other))
			}
			want := "other,src"
			if way == "rename over" {
				want = "gone,other"
			}
			if names(root) != want || names(gone) != "" {
				t.Errorf("after the %s: root %q, the removed directory %q", way, names(root), names(gone))
			}
		})
	}
}

// TestChanged: every change of a name, an existence or a file's keys
// reaches Options.Changed once per node it touched, after the change (the
// node's path is already the new one, an unlinked file has none); a call
// that fails or changes none of that reports nothing.
func TestChanged(t *testing.T) {
	var mu sync.Mutex
	var got []string
	tr := newTreeWith(t, page, 0, func(n tree.Node) {
		s := "gone"
		switch n := n.(type) {
		case *tree.File:
			if p, ok := n.Path(); ok {
				s = p
			}
		case *tree.Dir:
			s = n.Path() + "/"
		}
		mu.Lock()
		got = append(got, s)
		mu.Unlock()
	})
	expect := func(step string, want ...string) {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s: Changed heard %q, want %q", step, got, want)
		}
		got = nil
	}
	root := tr.Root()
	create(t, root, "a")
	expect("create", "/a")
	create(t, root, "b")
	d := mkdir(t, root, "d")
	expect("create b, mkdir", "/b")
	if _, err := root.Create(0, "b", tree.Owner{}, 0o644, nil); err == nil {
		t.Fatal("create over an existing name succeeded")
	}
	expect("a create refused")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(root.Rename(0, "a", root, "a2", 0))
	expect("rename", "/a2")
	must(root.Rename(0, "a2", root, "b", 0))
	expect("rename over", "/b", "gone")
	must(root.Rename(0, "b", d, "b", 0))
	expect("move to another PD", "/d/b")
	create(t, d, "c")
	expect("create c", "/d/c")
	must(d.Rename(0, "b", d, "c", tree.RenameExchange))
	expect("exchange", "/d/b", "/d/c")
	wantErrno(t, d.Rename(0, "nope", d, "x", 0), syscall.ENOENT, "rename of a missing name")
	expect("a rename refused")
	must(root.Rename(0, "d", root, "e", 0))
	expect("rename of a directory", "/e/")
	e, err := tr.Resolve("/e")
	must(err)
	n, err := e.Lookup("b")
	must(err)
	must(n.(*tree.File).SetAccess(verbs.LocalWrite))
	expect("access", "/e/b")
	if n.(*tree.File).SetAccess(verbs.RemoteWrite) == nil { // remote_write needs local_write
		t.Fatal("an invalid access was set")
	}
	expect("an access refused")
	must(e.SetDefaultAccess(verbs.LocalWrite))
	expect("default access of a directory that is not a pool")
	must(e.Unlink(0, "b"))
	expect("unlink", "gone")
	wantErrno(t, e.Unlink(0, "b"), syscall.ENOENT, "unlink of a missing name")
	expect("an unlink refused")

	p := mkdir(t, root, "p")
	if _, err := p.MakePool(page, 4, 0); err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("pools need /proc/self/map_files, which needs root: %v", err)
		}
		t.Fatal(err)
	}
	create(t, p, "s")
	expect("a pool file", "/p/s")
	must(p.SetDefaultAccess(verbs.LocalWrite | verbs.RemoteRead))
	expect("a pool's default access: new keys for every file", "/p/")
}
