// Package tree is mrfs's namespace, independent of FUSE: directories,
// each a protection domain (buffer.Domain), holding named buffer files
// (buffer.Buffer) and subdirectories, with the rules of DESIGN.md for
// creating, removing and renaming them and the POSIX metadata they carry.
//
// The rules that live here:
//   - a directory is one PD: Mkdir allocates it, Rmdir deallocates it and
//     refuses (ENOTEMPTY) while it holds anything;
//   - Unlink deregisters the buffer at once (remote access ends) and frees
//     it; a client that still has it open keeps its pages;
//   - Rename within a directory only renames; a buffer moved to another
//     directory is re-registered in that directory's PD first; an entry
//     renamed over is freed last, so a failure changes nothing;
//   - the creator's mode is masked by Options.Umask (key secrecy), and
//     set-id bits are never stored.
//
// fs/ translates kernel requests into these calls and keeps its FUSE
// inode of each directory in the directory's Aux slot (a file's lives
// only while the kernel holds it); remote/ resolves the directory a peer
// names with Tree.Domain.
//
// # Locking
//
// Tree.mu guards the namespace: every Dir's entries, and every node's
// parent, name and busy mark. node.mu guards one node's metadata. Lock
// order: Tree.mu, then node.mu, then the buffer package's locks
// (Buffer.mu, Manager.mu); never the reverse, so no code holding a node
// or buffer lock looks up names.
//
// No call holds Tree.mu while it waits for a buffer: a registration can
// hold a Buffer.mu for seconds (gigabytes), and lookups, listings and
// stat of every other name must go on meanwhile. Create registers before
// it takes Tree.mu. Unlink and Rename mark the files they work on busy
// under Tree.mu, let go of it for the buffer calls (Free, Move), and take
// it again to change the names; a second unlink or rename of a busy file
// waits for the first, without Tree.mu. Rmdir, and a rename over an empty
// directory, mark that directory busy the same way while its PD closes
// (which closes the remote connections attached to it: an rdma_cm one
// still being set up can take seconds); a call that would add a name to
// a busy directory waits for it, and finds it gone or still there.
package tree

import (
	"errors"
	"fmt"
	"log/slog"
	"path"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"mrfs/buffer"
	"mrfs/verbs"
)

// MaxNameLen is NAME_MAX: the longest name of an entry, in bytes.
const MaxNameLen = 255

// Options are the namespace's policy.
type Options struct {
	// DefaultSize is the size a new file gets, registered at once when
	// non-zero.
	DefaultSize uint64
	// DefaultAccess is the default_access of a new directory.
	DefaultAccess verbs.Access
	// Umask is applied to the mode a creator asks for.
	Umask uint32
	// Log takes what a user must hear of (nil: discarded).
	Log *slog.Logger
	// Changed, when set, hears of every node whose name, existence or
	// keys changed through the tree: a file created, unlinked (also by a
	// rename over it), renamed or given an access; a directory renamed
	// or its pool's default_access set (every file under it changed).
	// It is called after the change, with no lock held, and may block:
	// the publisher waits there until a removed file's key is gone.
	Changed func(Node)
	// Journal, when set, hears every change a later process needs to
	// rebuild the namespace after a crash (state.go).
	Journal Journal
}

// Tree is the namespace of one mount.
type Tree struct {
	mgr  *buffer.Manager
	opt  Options
	log  *slog.Logger
	root *Dir

	// guards: every Dir's entries, every node's parent and name, busy.
	mu sync.RWMutex
	// busy holds the nodes an unlink or rename works on without mu,
	// each with a channel closed when it is done. A map here rather than
	// a field in every node: few nodes are ever busy at once.
	busy map[*node]chan struct{}

	lastIno atomic.Uint64 // the inode number given last (the root's is 1)

	j Journal // Options.Journal, or one that keeps nothing
}

// Owner is who creates a node.
type Owner struct{ UID, GID uint32 }

// Req names the request a call that changes names is made for (a FUSE
// request's unique), 0 for none: the journal records it with the change
// that completes the call (Journal), so that a later process asked the
// same request again knows it was made, and is not made twice.
type Req uint64

// New makes a tree whose root is a new PD with rootAccess as its
// default access, owned by owner with mode rootMode.
func New(mgr *buffer.Manager, opt Options, rootAccess verbs.Access, owner Owner, rootMode uint32) (*Tree, error) {
	dom, err := mgr.NewDomain(rootAccess)
	if err != nil {
		return nil, fmt.Errorf("allocate the root PD: %w", err)
	}
	t := newTree(mgr, opt)
	t.root = t.newDir(dom, newMeta(owner, rootMode&0o7777)) // inode 1
	return t, nil
}

func newTree(mgr *buffer.Manager, opt Options) *Tree {
	t := &Tree{mgr: mgr, opt: opt, log: opt.Log, busy: map[*node]chan struct{}{}, j: opt.Journal}
	if t.log == nil {
		t.log = slog.New(slog.DiscardHandler)
	}
	if t.j == nil {
		t.j = noJournal{}
	}
	return t
}

// Root is the mount's root directory, the default PD.
func (t *Tree) Root() *Dir { return t.root }

// NewIno hands out an inode number that no node has had or will have,
// for a node of the front end's own.
func (t *Tree) NewIno() uint64 {
	ino := t.lastIno.Add(1)
	t.j.Numbered(ino)
	return ino
}

// Manager is the buffer manager the tree's buffers belong to.
func (t *Tree) Manager() *buffer.Manager { return t.mgr }

// Node is a *Dir or a *File.
type Node interface {
	// Ino is the node's inode number: fixed for its life, never reused
	// in the tree's (the root's is 1).
	Ino() uint64
	// Meta is a snapshot of the node's metadata.
	Meta() Meta
	// SetMeta applies a SETATTR's metadata part; a file's new owner is
	// charged for its pinned bytes first (EDQUOT when its quota cannot
	// hold them, and nothing changes).
	SetMeta(c Change) error
	// Touch marks a change (see node.Touch).
	Touch(modified bool)
	base() *node
}

// node is what directories and files share.
type node struct {
	parent *Dir   // guarded by Tree.mu; nil for the root and once removed
	name   string // guarded by Tree.mu
	ino    uint64 // immutable

	mu   sync.Mutex // guards: meta
	meta meta
}

func (n *node) base() *node { return n }

// Ino is the node's inode number.
func (n *node) Ino() uint64 { return n.ino }

// Aux is the front end's slot.
func (d *Dir) Aux() any { return d.aux }

// SetAux stores the front end's object for the directory. Call it once,
// before anyone can look the directory up: in the prepare function of
// Mkdir, or on the root before serving.
func (d *Dir) SetAux(v any) { d.aux = v }

// Dir is a directory, and so a protection domain.
type Dir struct {
	node
	aux     any // set once, before the directory is published
	t       *Tree
	dom     *buffer.Domain
	entries map[string]Node // guarded by t.mu
	subdirs int             // guarded by t.mu: the entries that are directories
}

// File is a regular file: a registered buffer.
type File struct {
	node
	buf      *buffer.Buffer // set at creation, never changed
	t        *Tree          // immutable
	unlinked atomic.Bool
}

var (
	_ Node = (*Dir)(nil)
	_ Node = (*File)(nil)
)

func (t *Tree) newDir(dom *buffer.Domain, m meta) *Dir {
	d := &Dir{t: t, dom: dom, entries: map[string]Node{}}
	d.ino = t.lastIno.Add(1)
	d.meta = m
	return d
}

// Domain is the directory's protection domain.
func (d *Dir) Domain() *buffer.Domain { return d.dom }

// IsRoot reports whether d is the mount's root.
func (d *Dir) IsRoot() bool { return d == d.t.root }

// Buffer is the file's buffer.
func (f *File) Buffer() *buffer.Buffer { return f.buf }

// DirPath is the path of f's directory ("" once unlinked).
func (f *File) DirPath() string {
	f.t.mu.RLock()
	p := f.parent
	f.t.mu.RUnlock()
	if p == nil {
		return ""
	}
	return p.Path()
}

// Path is the file's path from the mount's root; ok is false once it
// was unlinked.
func (f *File) Path() (p string, ok bool) {
	f.t.mu.RLock()
	dir, name := f.parent, f.name
	f.t.mu.RUnlock()
	if dir == nil {
		return "", false
	}
	return path.Join(dir.Path(), name), true
}

// Name is f's directory and its name there; dir is nil once f was
// unlinked.
func (f *File) Name() (dir *Dir, name string) {
	f.t.mu.RLock()
	defer f.t.mu.RUnlock()
	return f.parent, f.name
}

// SetAccess re-registers the file's buffer with a (buffer.SetAccess).
func (f *File) SetAccess(a verbs.Access) error {
	err := f.buf.SetAccess(a)
	if err == nil {
		f.t.changed(f)
	}
	return err
}

// SetDefaultAccess sets the access d's new files get; in a pool, whose
// files share its chunks' registration, every file's keys change too
// (buffer.Domain.SetDefaultAccess).
func (d *Dir) SetDefaultAccess(a verbs.Access) error {
	if d.dom.Pool() != nil {
		// A pool re-registers its chunks: no lock is held meanwhile,
		// and it is not journaled (a pool cannot be kept).
		err := d.dom.SetDefaultAccess(a)
		if err == nil {
			d.t.changed(d)
		}
		return err
	}
	// Under d.mu, so that the last record is the last change.
	d.mu.Lock()
	defer d.mu.Unlock()
	err := d.dom.SetDefaultAccess(a)
	if err == nil {
		d.t.j.DefaultAccess(d.ino, a)
	}
	return err
}

// Unlinked reports whether the file was removed from the namespace (by
// unlink or by a rename over it); something may still hold it open.
func (f *File) Unlinked() bool { return f.unlinked.Load() }

// Path is the directory's path from the mount's root, "/" for the root.
// A removed directory answers its last path.
func (d *Dir) Path() string {
	d.t.mu.RLock()
	defer d.t.mu.RUnlock()
	return d.pathLocked()
}

// pathLocked is Path. Callers hold Tree.mu.
func (d *Dir) pathLocked() string {
	var parts []string
	for n := d; n.parent != nil; n = n.parent {
		parts = append(parts, n.name)
	}
	var b strings.Builder
	for i := len(parts) - 1; i >= 0; i-- {
		b.WriteString("/" + parts[i])
	}
	if b.Len() == 0 {
		return "/"
	}
	return b.String()
}

// checkName refuses names the namespace cannot hold.
func checkName(name string) error {
	switch {
	case len(name) > MaxNameLen:
		return fmt.Errorf("name of %d bytes (NAME_MAX is %d): %w", len(name), MaxNameLen, syscall.ENAMETOOLONG)
	case name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("invalid name %q: %w", name, syscall.EINVAL)
	}
	return nil
}

// Lookup finds name in d: ENOENT when there is none, ENAMETOOLONG for a
// name no entry can have (every call on a path looks it up first). The
// ENOENT is bare: the kernel asks it before every create of a new name,
// and a wrapped one would be garbage for each.
func (d *Dir) Lookup(name string) (Node, error) {
	if len(name) > MaxNameLen {
		return nil, fmt.Errorf("name of %d bytes (NAME_MAX is %d): %w", len(name), MaxNameLen, syscall.ENAMETOOLONG)
	}
	d.t.mu.RLock()
	defer d.t.mu.RUnlock()
	if n := d.entries[name]; n != nil {
		return n, nil
	}
	return nil, syscall.ENOENT
}

// Entry is one name of a directory listing.
type Entry struct {
	Name string
	Node Node
}

// Entries lists d sorted by name.
func (d *Dir) Entries() []Entry {
	d.t.mu.RLock()
	list := make([]Entry, 0, len(d.entries))
	for name, n := range d.entries {
		list = append(list, Entry{name, n})
	}
	d.t.mu.RUnlock()
	sort.Slice(list, func(i, j int) bool { return list[i].Name < list[j].Name })
	return list
}

// Create makes a file name in d: a buffer of Options.DefaultSize in d's
// PD with d's default access, owned by owner, with mode masked by the
// umask. prepare runs before the file is published (it may open the
// file); if it fails, or name exists by then (EEXIST), the
// buffer is freed and nothing is left behind.
func (d *Dir) Create(req Req, name string, owner Owner, mode uint32, prepare func(*File) error) (*File, error) {
	return d.add(req, name, owner, mode, prepare, func() (*buffer.Buffer, error) {
		return d.t.mgr.Create(d.dom, d.t.opt.DefaultSize, owner.UID)
	})
}

// Register makes a file of memory a client brought (src, which it takes),
// registered in place with access a, or d's default access when a is nil
// (buffer.Manager.RegisterInPlace). Otherwise as Create.
func (d *Dir) Register(req Req, name string, owner Owner, mode uint32, src buffer.Source, a *verbs.Access, prepare func(*File) error) (*File, error) {
	if err := checkName(name); err != nil {
		src.Remove()
		return nil, fmt.Errorf("register: %w", err)
	}
	return d.add(req, name, owner, mode, prepare, func() (*buffer.Buffer, error) {
		access := d.dom.DefaultAccess()
		if a != nil {
			access = *a
		}
		return d.t.mgr.RegisterInPlace(d.dom, src, owner.UID, access)
	})
}

// add makes a file of the buffer make returns under name.
func (d *Dir) add(req Req, name string, owner Owner, mode uint32, prepare func(*File) error, make func() (*buffer.Buffer, error)) (*File, error) {
	if err := checkName(name); err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	// Registration can take long: it happens outside the tree lock.
	buf, err := make()
	if err != nil {
		return nil, fmt.Errorf("create %q: %w", name, err)
	}
	f := &File{buf: buf, t: d.t}
	f.ino = d.t.lastIno.Add(1)
	buf.SetAux(f)
	f.meta = newMeta(owner, d.t.perm(mode))
	if prepare != nil {
		err = prepare(f)
	}
	if err == nil {
		err = d.link(req, name, f)
	}
	if err != nil {
		if ferr := buf.Free(); ferr != nil {
			err = fmt.Errorf("%w (and freeing the new buffer: %w)", err, ferr)
		}
		return nil, fmt.Errorf("create %q: %w", name, err)
	}
	d.Touch(true)
	d.t.changed(f)
	return f, nil
}

// changed tells Options.Changed of ns.
func (t *Tree) changed(ns ...Node) {
	if t.opt.Changed == nil {
		return
	}
	for _, n := range ns {
		t.opt.Changed(n)
	}
}

// CheckName is what a name in the namespace must be (EINVAL, ENAMETOOLONG
// otherwise), for callers that must know before they make anything.
func CheckName(name string) error { return checkName(name) }

// link publishes n under name, made for req, unless the name was taken
// meanwhile.
func (d *Dir) link(req Req, name string, n Node) error {
	d.t.mu.Lock()
	defer d.t.mu.Unlock()
	if err := d.waitAddLocked(); err != nil {
		return err
	}
	if d.entries[name] != nil {
		return fmt.Errorf("%q exists: %w", name, syscall.EEXIST)
	}
	if _, ok := n.(*Dir); ok && d.dom.Pool() != nil {
		return fmt.Errorf("a pool holds only files: %w", syscall.EPERM)
	}
	d.addLocked(name, n)
	d.t.madeLocked(n, req)
	return nil
}

// MakePool turns d, an empty directory other than the root, into a pool
// of slots slots of slot bytes charged to owner (buffer.Domain.MakePool):
// ENOTEMPTY when it holds anything. Names wait meanwhile.
func (d *Dir) MakePool(slot uint64, slots int, owner uint32) (*buffer.Pool, error) {
	t := d.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if d == t.root {
		return nil, fmt.Errorf("make a pool: the mount's root cannot be one; make a directory for it: %w", syscall.EPERM)
	}
	if err := d.waitAddLocked(); err != nil {
		return nil, fmt.Errorf("make a pool: %w", err)
	}
	if len(d.entries) > 0 {
		return nil, fmt.Errorf("make a pool: the directory holds %d entries: %w", len(d.entries), syscall.ENOTEMPTY)
	}
	done := t.markLocked(d)
	defer done()
	t.mu.Unlock()
	p, err := d.dom.MakePool(slot, slots, owner)
	t.mu.Lock()
	if err == nil {
		t.madeLocked(d, 0) // a pool cannot be kept: its record says so
	}
	return p, err
}

// waitAddLocked waits, before a name is added to d, for an rmdir or a
// rename over d under way: ENOENT if d went. Callers hold t.mu.
func (d *Dir) waitAddLocked() error {
	for d.t.waitLocked(d) {
	}
	if d != d.t.root && d.parent == nil {
		return fmt.Errorf("directory removed: %w", syscall.ENOENT)
	}
	return nil
}

// addLocked puts n in d under name. Callers hold t.mu for writing.
func (d *Dir) addLocked(name string, n Node) {
	d.entries[name] = n
	if _, ok := n.(*Dir); ok {
		d.subdirs++
	}
	b := n.base()
	b.parent, b.name = d, name
}

// Nlink is the directory's link count: 2 (its name and ".") plus one
// ".." per subdirectory, as on tmpfs.
func (d *Dir) Nlink() uint32 {
	d.t.mu.RLock()
	defer d.t.mu.RUnlock()
	return 2 + uint32(d.subdirs)
}

// Mkdir makes a directory name in d: a new PD whose files get
// Options.DefaultAccess. prepare runs before the directory is published,
// as in Create.
func (d *Dir) Mkdir(req Req, name string, owner Owner, mode uint32, prepare func(*Dir)) (*Dir, error) {
	if err := checkName(name); err != nil {
		return nil, fmt.Errorf("mkdir: %w", err)
	}
	dom, err := d.t.mgr.NewDomain(d.t.opt.DefaultAccess)
	if err != nil {
		return nil, fmt.Errorf("mkdir %q: %w", name, err)
	}
	sub := d.t.newDir(dom, newMeta(owner, d.t.perm(mode)))
	if prepare != nil {
		prepare(sub)
	}
	if err := d.link(req, name, sub); err != nil {
		if cerr := dom.Close(); cerr != nil {
			err = fmt.Errorf("%w (and deallocating the new PD: %w)", err, cerr)
		}
		return nil, fmt.Errorf("mkdir %q: %w", name, err)
	}
	d.Touch(true)
	return sub, nil
}

// Rmdir removes the empty directory name and deallocates its PD (remote
// peers attached to it are disconnected first): ENOENT, ENOTDIR, or
// ENOTEMPTY while it holds anything.
func (d *Dir) Rmdir(req Req, name string) error {
	t := d.t
	t.mu.Lock()
	defer t.mu.Unlock()
	sub, err := idleEntryLocked[*Dir](d, name, "rmdir", syscall.ENOTDIR)
	if err != nil {
		return err
	}
	if len(sub.entries) > 0 {
		return fmt.Errorf("rmdir %q: %w", name, syscall.ENOTEMPTY)
	}
	// Empty, and busy until the PD is gone: nothing is added meanwhile.
	done := t.markLocked(sub)
	defer done()
	t.mu.Unlock()
	err = sub.dom.Close()
	t.mu.Lock()
	if err != nil {
		return fmt.Errorf("rmdir %q: %w", name, err)
	}
	d.dropLocked(name, req)
	d.Touch(true)
	return nil
}

// Unlink removes the file name: its region is deregistered at once, then
// the buffer freed; a client that has it open or mapped keeps its pages
// until it lets go. ENOENT, or EISDIR for a directory. A failure to free
// leaves the name. The name goes once the buffer is freed: until then
// (a registration of the file under way) other calls see it still.
func (d *Dir) Unlink(req Req, name string) error {
	f, err := d.unlink(req, name)
	if err == nil {
		d.t.changed(f)
	}
	return err
}

func (d *Dir) unlink(req Req, name string) (*File, error) {
	t := d.t
	t.mu.Lock()
	f, err := idleEntryLocked[*File](d, name, "unlink", syscall.EISDIR)
	if err != nil {
		t.mu.Unlock()
		return nil, err
	}
	done := t.markLocked(f)
	t.mu.Unlock()

	err = f.buf.Free()

	t.mu.Lock()
	defer t.mu.Unlock()
	defer done()
	if err != nil {
		return nil, fmt.Errorf("unlink %q: %w", name, err)
	}
	f.unlinked.Store(true)
	// Busy, the file kept its name: every other call that changes names
	// waited.
	if p := f.parent; p != nil {
		p.dropLocked(f.name, req)
		p.Touch(true)
	}
	return f, nil
}

// idleEntryLocked is d's entry name as a T, once no unlink or rename
// works on it: ENOENT, or wrongKind when it is not a T. Callers hold t.mu.
func idleEntryLocked[T Node](d *Dir, name, op string, wrongKind syscall.Errno) (T, error) {
	for {
		n := d.entries[name]
		e, ok := n.(T)
		switch {
		case n == nil:
			return e, fmt.Errorf("%s %q: %w", op, name, syscall.ENOENT)
		case !ok:
			return e, fmt.Errorf("%s %q: %w", op, name, wrongKind)
		}
		if !d.t.waitLocked(e) {
			return e, nil
		}
	}
}

// waitLocked waits, without t.mu, for an unlink or rename working on n to
// end, and says whether it waited: the caller looks up its names again.
// Callers hold t.mu.
func (t *Tree) waitLocked(n Node) bool {
	ch := t.busy[n.base()]
	if ch == nil {
		return false
	}
	t.mu.Unlock()
	<-ch
	t.mu.Lock()
	return true
}

// markLocked marks n busy; done (called with t.mu held) clears it and
// wakes whoever waits. Callers hold t.mu.
func (t *Tree) markLocked(n Node) (done func()) {
	b := n.base()
	ch := make(chan struct{})
	t.busy[b] = ch
	return func() {
		delete(t.busy, b)
		close(ch)
	}
}

// dropLocked removes name from the namespace for good, for req. Callers
// hold t.mu for writing.
func (d *Dir) dropLocked(name string, req Req) {
	if n := d.removeLocked(name); n != nil {
		d.t.j.Removed(n.Ino(), req)
	}
}

// removeLocked takes name out of d (a rename puts it back elsewhere), and
// returns what it was. Callers hold t.mu for writing.
func (d *Dir) removeLocked(name string) Node {
	n := d.entries[name]
	if n == nil {
		return nil
	}
	if _, ok := n.(*Dir); ok {
		d.subdirs--
	}
	n.base().parent = nil
	delete(d.entries, name)
	return n
}

// The flags of renameat2 that Rename takes.
const (
	RenameNoReplace = 1 << 0 // RENAME_NOREPLACE
	RenameExchange  = 1 << 1 // RENAME_EXCHANGE
)

// Rename moves name in d to newName in dst. A file moved to another
// directory is re-registered in that directory's PD (register there,
// then deregister the old region: keys change) before any name changes;
// an entry renamed over is released next (a file freed as Unlink does,
// an empty directory's PD deallocated), and when that fails the move is
// undone: a failure changes no name. RENAME_EXCHANGE swaps two entries of
// the same PD; exchanging a file between PDs is EINVAL (two moves that
// could each fail halfway). The kernel itself refuses moving a directory
// into its own subtree.
func (d *Dir) Rename(req Req, name string, dst *Dir, newName string, flags uint32) error {
	moved, err := d.rename(req, name, dst, newName, flags)
	d.t.changed(moved...)
	return err
}

// maxRenameTries bounds the times a rename starts again because another
// call took its new name while it worked on the buffers.
const maxRenameTries = 8

// rename is Rename; moved are the nodes whose names changed or went.
func (d *Dir) rename(req Req, name string, dst *Dir, newName string, flags uint32) (moved []Node, err error) {
	if err := checkName(newName); err != nil {
		return nil, fmt.Errorf("rename: %w", err)
	}
	if dst.t != d.t {
		return nil, fmt.Errorf("rename to another mount: %w", syscall.EXDEV)
	}
	t := d.t
	t.mu.Lock()
	defer t.mu.Unlock()
	for try := 0; ; try++ {
		p, moved, err := d.planLocked(req, name, dst, newName, flags)
		if err != nil || p == nil {
			return moved, err // done under the lock, or refused
		}
		if try == maxRenameTries {
			return nil, fmt.Errorf("rename %q: its new name keeps being taken: %w", name, syscall.EBUSY)
		}
		if again, err := p.run(); err != nil {
			return nil, err
		} else if !again {
			moved = []Node{p.src}
			if p.old != nil {
				moved = append(moved, p.old)
			}
			return moved, nil
		}
	}
}

// renamePlan is a rename that waits for buffers: a move of a file to
// another PD, or a file renamed over.
type renamePlan struct {
	req           Req
	d, dst        *Dir
	name, newName string
	src           Node
	old           *File // the file renamed over, or nil
	oldDir        *Dir  // the empty directory renamed over, or nil
	move          *File // src when it moves to another PD, or nil
}

// planLocked checks a rename and does it at once when no buffer is to be
// waited for (it returns a nil plan then, and the nodes it moved);
// otherwise it returns the plan for the buffer work. A busy entry is
// waited for first. Callers hold t.mu.
func (d *Dir) planLocked(req Req, name string, dst *Dir, newName string, flags uint32) (*renamePlan, []Node, error) {
	t := d.t
	for {
		src := d.entries[name]
		if src == nil {
			return nil, nil, fmt.Errorf("rename %q: %w", name, syscall.ENOENT)
		}
		old := dst.entries[newName]
		if old == src {
			return nil, nil, nil
		}
		if t.waitLocked(src) || old != nil && t.waitLocked(old) || t.waitLocked(dst) {
			continue
		}
		if dst != t.root && dst.parent == nil {
			return nil, nil, fmt.Errorf("rename %q: the directory of %q was removed: %w", name, newName, syscall.ENOENT)
		}
		if d != dst && (d.dom.Pool() != nil || dst.dom.Pool() != nil) {
			// A pool's files are slots of its registration (mv copies).
			return nil, nil, fmt.Errorf("rename %q into or out of a pool: %w", name, syscall.EXDEV)
		}
		_, srcIsDir := src.(*Dir)
		switch {
		case flags&RenameExchange != 0:
			if flags&^RenameExchange != 0 {
				return nil, nil, fmt.Errorf("rename: flags 0x%x: %w", flags, syscall.EINVAL)
			}
			if old == nil {
				return nil, nil, fmt.Errorf("exchange %q with %q: %w", name, newName, syscall.ENOENT)
			}
			_, srcFile := src.(*File)
			_, oldFile := old.(*File)
			if d.dom != dst.dom && (srcFile || oldFile) {
				return nil, nil, fmt.Errorf("exchange %q and %q between PDs %d and %d: %w", name, newName, d.dom.PD(), dst.dom.PD(), syscall.EINVAL)
			}
			d.removeLocked(name)
			dst.removeLocked(newName)
			d.addLocked(name, old)
			dst.addLocked(newName, src)
			t.namedLocked(req, old, src)
			d.Touch(true)
			dst.Touch(true)
			return nil, []Node{src, old}, nil
		case flags&^RenameNoReplace != 0:
			return nil, nil, fmt.Errorf("rename: flags 0x%x: %w", flags, syscall.EINVAL)
		case flags&RenameNoReplace != 0 && old != nil:
			return nil, nil, fmt.Errorf("rename %q: %q exists: %w", name, newName, syscall.EEXIST)
		}
		p := &renamePlan{req: req, d: d, dst: dst, name: name, newName: newName, src: src}
		switch o := old.(type) {
		case *File:
			if srcIsDir {
				return nil, nil, fmt.Errorf("rename directory %q over file %q: %w", name, newName, syscall.ENOTDIR)
			}
			p.old = o
		case *Dir:
			if !srcIsDir {
				return nil, nil, fmt.Errorf("rename file %q over directory %q: %w", name, newName, syscall.EISDIR)
			}
			if len(o.entries) > 0 {
				return nil, nil, fmt.Errorf("rename %q over %q: %w", name, newName, syscall.ENOTEMPTY)
			}
			p.oldDir = o
		}
		if f, ok := src.(*File); ok && d.dom != dst.dom {
			p.move = f
		}
		if p.old == nil && p.oldDir == nil && p.move == nil {
			p.commitLocked()
			return nil, []Node{src}, nil
		}
		return p, nil, nil
	}
}

// run does the plan's buffer work without t.mu (callers hold it; run
// returns with it held), then changes the names. again says the new name
// was taken meanwhile: the move was undone, and the rename starts over.
func (p *renamePlan) run() (again bool, err error) {
	t := p.d.t
	// src is busy too, moving or not: no other call may take its name
	// away while this one is without the lock.
	dones := []func(){t.markLocked(p.src)}
	if p.old != nil {
		dones = append(dones, t.markLocked(p.old))
	}
	if p.oldDir != nil {
		dones = append(dones, t.markLocked(p.oldDir))
	}
	defer func() {
		for _, done := range dones {
			done()
		}
	}()
	t.mu.Unlock()
	err = p.buffers()
	t.mu.Lock()
	if err != nil {
		return false, err
	}
	if p.old == nil && p.oldDir == nil && p.dst.entries[p.newName] != nil {
		// Another call took the name while the buffer moved.
		t.mu.Unlock()
		err := p.undoMove()
		t.mu.Lock()
		return err == nil, err
	}
	p.commitLocked()
	return false, nil
}

// buffers moves src's buffer to dst's PD, then frees the file renamed
// over, or deallocates the PD of the empty directory renamed over; when
// that fails, the move is undone.
func (p *renamePlan) buffers() error {
	if p.move != nil {
		if err := p.move.buf.Move(p.dst.dom); err != nil {
			return fmt.Errorf("move %q to pd %d: %w", p.name, p.dst.dom.PD(), err)
		}
	}
	if p.oldDir != nil {
		if err := p.oldDir.dom.Close(); err != nil {
			return fmt.Errorf("rename %q over %q: %w", p.name, p.newName, err)
		}
	}
	if p.old != nil {
		if err := p.old.buf.Free(); err != nil {
			err = fmt.Errorf("rename %q over %q: releasing the file replaced: %w", p.name, p.newName, err)
			if uerr := p.undoMove(); uerr != nil {
				return errors.Join(err, uerr)
			}
			return err
		}
		p.old.unlinked.Store(true)
	}
	return nil
}

// undoMove registers src's buffer back in its own PD after a move.
func (p *renamePlan) undoMove() error {
	if p.move == nil {
		return nil
	}
	if err := p.move.buf.Move(p.d.dom); err != nil {
		p.d.t.log.Error("rename: cannot move a buffer back to its PD after a failure; it stays registered in the new one",
			"name", p.name, "pd", p.dst.dom.PD(), "err", err)
		return fmt.Errorf("move %q back to pd %d: %w", p.name, p.d.dom.PD(), err)
	}
	return nil
}

// commitLocked changes the names. Callers hold t.mu.
func (p *renamePlan) commitLocked() {
	if p.old != nil {
		if pp := p.old.parent; pp != nil {
			pp.dropLocked(p.old.name, 0)
		}
	}
	p.dst.dropLocked(p.newName, 0) // a directory renamed over
	p.d.removeLocked(p.name)
	p.dst.addLocked(p.newName, p.src)
	p.d.t.namedLocked(p.req, p.src)
	p.d.Touch(true)
	p.dst.Touch(true)
}

// Resolve finds the directory at p, relative to the mount's root ("/" or
// "" is the root): ENOENT or ENOTDIR when there is none.
func (t *Tree) Resolve(p string) (*Dir, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	d := t.root
	for _, name := range strings.Split(strings.Trim(path.Clean("/"+p), "/"), "/") {
		if name == "" {
			continue
		}
		n := d.entries[name]
		if n == nil {
			return nil, fmt.Errorf("no directory %q in the mount: %w", p, syscall.ENOENT)
		}
		var ok bool
		if d, ok = n.(*Dir); !ok {
			return nil, fmt.Errorf("%q is not a directory: %w", p, syscall.ENOTDIR)
		}
	}
	return d, nil
}

// Domain is the protection domain of the directory at p (Resolve): what
// a remote peer names to get a queue pair in that PD.
func (t *Tree) Domain(p string) (*buffer.Domain, error) {
	d, err := t.Resolve(p)
	if err != nil {
		return nil, err
	}
	return d.dom, nil
}

// perm is the mode a creator gets: permission bits and the sticky bit
// (as chmod keeps it), masked by the umask; never set-id bits.
func (t *Tree) perm(mode uint32) uint32 { return mode & 0o1777 &^ t.opt.Umask }

// now is the clock of every time stamp, for tests.
var now = time.Now
