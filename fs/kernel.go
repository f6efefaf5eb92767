package fs

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/tree"
	"mrfs/verbs"
)

// kernel stands between the kernel and go-fuse's bridge (a
// fuse.RawFileSystem around it) and keeps what the kernel holds of the
// mount, which go-fuse keeps to itself and a later daemon must give back
// to the same connection (DESIGN, Restart): every node id the kernel was
// given and its lookup count, every handle it opened, and the backing id
// of each passthrough open. It is also the gate an upgrade closes: new
// requests wait there, and those under way finish.
//
// A later daemon's go-fuse numbers handles from 1 again, while the kernel
// still holds the old numbers: a restored open keeps its number, mapped to
// the new go-fuse's (restored), and new opens are go-fuse's numbers plus
// base. The kernel refuses a passthrough open whose backing file is not
// the one of the inode's passthrough files already open (EBUSY), so new
// opens of an inode opened before the restart get its old backing id,
// until the last of them is released (backing).
//
// After a crash (crashed) nothing says what the kernel holds but the
// kernel: the nodes it holds are learned from it (fuseconn.Held) and
// looked up once, so their counts are unknown; a FORGET, which the
// kernel sends when it drops a node whole, forgets all go-fuse has. A
// request for a node no one could look up again (a file removed and
// still open) is ESTALE. A handle the dead daemon gave is opened again
// at its first read or write (a close of one is answered at once), and
// the backing ids come from the journal (onBacking), held for the
// handles from before until the node is forgotten.
type kernel struct {
	fuse.RawFileSystem

	gate gate
	// base is added to go-fuse's handle numbers (0 until a restore;
	// set before serving, then read without a lock).
	base uint64
	// unregister gives a backing id back to the kernel (the server's).
	unregister func(id int32) syscall.Errno
	// onBacking journals each change of a node's backing id (0: none);
	// nil: none. Set before serving.
	onBacking func(node uint64, id int32)
	// crashed: the kernel's view was not handed over (set before
	// serving).
	crashed bool
	// partial: the kernel may hold node ids go-fuse does not know (a
	// crash's, or link nodes an upgrade left): their requests are
	// ESTALE, their FORGETs go to no one (set before serving).
	partial bool
	// onDone is told of a request that changed the namespace, before its
	// reply (a test hook's; the tree journals the request with the
	// change); true holds the reply back for good. done are those the
	// daemon before applied (the journal's after a crash, its recent
	// ones after an upgrade; set before serving, read only): their
	// resends are answered, not applied.
	onDone func(unique uint64) (hold bool)
	done   map[uint64]bool
	// notifyEntry tells the kernel a name in a directory changed (the
	// server's; set before serving, after a crash).
	notifyEntry func(parent uint64, name string) fuse.Status

	mu sync.Mutex // guards: nodes, links, handles, restored, backing, recent, next
	// nodes are the kernel's lookup counts, by node id.
	nodes map[uint64]uint64
	// links are the node ids of those a SYMLINK's reply gave (a
	// registration in place's link, in no tree: fs/inplace.go).
	links map[uint64]bool
	// handles are the kernel's open handles, by its number.
	handles map[uint64]KernelHandle
	// restored maps the number of an open made before the restart to
	// go-fuse's.
	restored map[uint64]uint64
	// backing is, by node id, the backing id the kernel's passthrough
	// opens of it were given, while any uses it.
	backing map[uint64]*backingRef
	// recent are the last requests that changed names (a ring; next is
	// overwritten next once full).
	recent []uint64
	next   int
}

type backingRef struct {
	id   int32
	refs int // the kernel's handles that use it (pre counts one)
	// own: go-fuse's registration, which go-fuse gives back; else one
	// from before the restart, which the kernel wrapper gives back.
	own bool
	// pre: the handles from before a crash, unknown, count as one
	// until the node is forgotten.
	pre bool
}

// KernelHandle is a handle the kernel holds.
type KernelHandle struct {
	Fh    uint64 `json:"fh"`
	Node  uint64 `json:"node"`
	Flags uint32 `json:"flags"` // the open's flags (O_RDWR, ...)
	Dir   bool   `json:"dir,omitempty"`
	// Backing is the passthrough backing id it was opened with (0: none).
	Backing int32 `json:"backing,omitempty"`
}

// KernelState is what the kernel holds of a mount: what a daemon that
// adopts the connection restores.
type KernelState struct {
	Nodes   map[uint64]uint64 `json:"nodes"` // node id: lookup count
	Handles []KernelHandle    `json:"handles"`
	// Base is what the handles' numbers are above: a later daemon numbers
	// its new handles above every one of them.
	Base uint64 `json:"base"`
	// Links are the held nodes that are a SYMLINK's link: in no tree, a
	// later daemon does not take them (the kernel finds the name's file
	// at its next lookup).
	Links []uint64 `json:"links,omitempty"`
	// Partial: the kernel may hold node ids Nodes leaves out (a
	// crash's, a link an earlier upgrade left): the next daemon answers
	// them ESTALE too.
	Partial bool `json:"partial,omitempty"`
	// Done are the last requests that changed names: one whose reply
	// the exec cut off comes again, to be answered, not applied.
	Done []uint64 `json:"done,omitempty"`
}

func newKernel(bridge fuse.RawFileSystem) *kernel {
	return &kernel{RawFileSystem: bridge, nodes: map[uint64]uint64{}, links: map[uint64]bool{}, handles: map[uint64]KernelHandle{},
		restored: map[uint64]uint64{}, backing: map[uint64]*backingRef{}}
}

// frozen calls f with what the kernel holds now, and FORGETs wait until
// f returns: f hands the state to a successor, executed in this process,
// and never returns when that works, so no FORGET is applied here after
// the state was taken (lost to the successor, whose lookup count would
// stay above the kernel's: a node, and a removed file's buffer, never
// freed). Callers close the gate first, so that nothing else changes it.
func (k *kernel) frozen(f func(KernelState) error) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	st := KernelState{Nodes: make(map[uint64]uint64, len(k.nodes)), Base: k.base, Partial: k.partial}
	for id, n := range k.nodes {
		st.Nodes[id] = n
	}
	for _, h := range k.handles {
		st.Handles = append(st.Handles, h)
	}
	for id := range k.links {
		st.Links = append(st.Links, id)
	}
	st.Done = slices.Clone(k.recent)
	return f(st)
}

// entered counts a reply that gave the kernel a node.
func (k *kernel) entered(st fuse.Status, out *fuse.EntryOut) {
	if !st.Ok() || out.NodeId == 0 {
		return
	}
	k.mu.Lock()
	k.nodes[out.NodeId]++
	if out.Attr.Mode&syscall.S_IFMT == syscall.S_IFLNK {
		k.links[out.NodeId] = true
	}
	k.mu.Unlock()
}

// opened keeps a handle go-fuse made for node, and gives the kernel its
// number (and an inode opened before the restart its old backing id).
func (k *kernel) opened(st fuse.Status, node uint64, flags uint32, dir bool, out *fuse.OpenOut) {
	if !st.Ok() || out.Fh == 0 {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	out.Fh += k.base
	if out.BackingID != 0 {
		b := k.backing[node]
		// go-fuse registers anew once its last open of the node is
		// released, which may be before that release reaches released
		// here: its new id is the one (the old one's handles, being
		// released, no longer count on this entry).
		if b == nil || (b.own && b.id != out.BackingID) {
			b = &backingRef{id: out.BackingID, own: true}
			k.backing[node] = b
			k.noteBacking(node, b.id)
		}
		out.BackingID = b.id
		b.refs++
	}
	k.handles[out.Fh] = KernelHandle{Fh: out.Fh, Node: node, Flags: flags, Dir: dir, Backing: out.BackingID}
}

// noteBacking journals node's backing id. Callers hold mu, which orders
// the records as the changes.
func (k *kernel) noteBacking(node uint64, id int32) {
	if k.onBacking != nil {
		k.onBacking(node, id)
	}
}

// unback drops a use of node's backing id b; the last gives it back
// (one not go-fuse's, after the unlock: drop). Callers hold mu.
func (k *kernel) unback(node uint64, b *backingRef) (drop int32) {
	if b.refs--; b.refs > 0 {
		return 0
	}
	delete(k.backing, node)
	k.noteBacking(node, 0)
	if b.own {
		return 0
	}
	return b.id
}

// fh is go-fuse's number of the kernel's handle fh; after a crash, 0 for
// one the dead daemon gave that is not opened again (stale).
func (k *kernel) fh(fh uint64) uint64 {
	if k.base == 0 || fh == 0 {
		return fh
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if b, ok := k.restored[fh]; ok {
		return b
	}
	if fh < k.base {
		return 0 // a crashed daemon's
	}
	return fh - k.base
}

// fhOpen is fh, a handle the dead daemon gave opened again first (with
// the open's flags, never to truncate or create): EBADF when it cannot be.
func (k *kernel) fhOpen(fh, node uint64, flags uint32, dir bool) (uint64, fuse.Status) {
	if g := k.fh(fh); g != 0 || fh == 0 {
		return g, fuse.OK
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if g, ok := k.restored[fh]; ok {
		return g, fuse.OK // opened by a request racing this one
	}
	in := &fuse.OpenIn{InHeader: fuse.InHeader{NodeId: node, Caller: rootCaller()},
		Flags: flags &^ (syscall.O_TRUNC | syscall.O_CREAT | syscall.O_EXCL)}
	var out fuse.OpenOut
	var st fuse.Status
	if dir {
		st = k.RawFileSystem.OpenDir(nil, in, &out)
	} else {
		st = k.RawFileSystem.Open(nil, in, &out)
	}
	if !st.Ok() {
		return 0, fuse.EBADF
	}
	k.restored[fh] = out.Fh
	k.handles[fh] = KernelHandle{Fh: fh, Node: node, Flags: in.Flags, Dir: dir}
	return out.Fh, fuse.OK
}

// resendBit marks a request the kernel queues again (FUSE_NOTIFY_RESEND).
const resendBit = 1 << 63

// applied says whether h is a request the daemon before applied and the
// kernel sends again: it is answered from the namespace, never applied
// twice (a create again would be EEXIST, an unlink ENOENT). After a crash
// the journal says which; after an upgrade the program before (its
// recent requests): one whose reply it had not written when it executed
// this one comes again.
func (k *kernel) applied(h *fuse.InHeader) bool {
	return h.Unique&resendBit != 0 && k.done[h.Unique&^resendBit]
}

// keepRecent is how many of the last requests that changed names the
// kernel layer hands an upgrade's successor: far more than go-fuse
// handles at once (whose replies an upgrade may cut off).
const keepRecent = 1024

// making is a request that may change names, by go-fuse's cancel channel
// of it: the one thing of the kernel's request a node's method is given
// (fuse.Context.Cancel). Each request under way has a channel of its own,
// in every server of the process.
var making sync.Map // <-chan struct{} -> tree.Req

// makes lets the node's method of h (cancel its channel) find the
// request's unique (reqOf), which the tree journals with the change that
// completes it; done ends that.
func makes(cancel <-chan struct{}, h *fuse.InHeader) (done func()) {
	if cancel == nil {
		return func() {}
	}
	making.Store(cancel, tree.Req(h.Unique&^resendBit))
	return func() { making.Delete(cancel) }
}

// reqOf is the request ctx is of, if it may change names (makes), or 0.
func reqOf(ctx context.Context) tree.Req {
	if c, ok := ctx.(*fuse.Context); ok && c.Cancel != nil {
		if r, ok := making.Load(c.Cancel); ok {
			return r.(tree.Req)
		}
	}
	return 0
}

// finished notes that h changed the namespace (st OK), before its reply
// goes: among the recent requests an upgrade hands over, and to onDone
// (a test hook), which may hold the reply back for good (the request
// leaves the gate, so that an upgrade can go on without its reply).
func (k *kernel) finished(st fuse.Status, h *fuse.InHeader) fuse.Status {
	if !st.Ok() {
		return st
	}
	u := h.Unique &^ resendBit
	k.mu.Lock()
	if len(k.recent) < keepRecent {
		k.recent = append(k.recent, u)
	} else {
		k.recent[k.next] = u
		k.next = (k.next + 1) % keepRecent
	}
	k.mu.Unlock()
	if k.onDone != nil && k.onDone(u) {
		k.gate.exit()
		select {}
	}
	return st
}

// answer is the entry reply of a request applied before a crash: a
// lookup of what it made.
func (k *kernel) answer(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	st := k.RawFileSystem.Lookup(cancel, h, name, out)
	k.entered(st, out)
	return st
}

// known says whether go-fuse knows the node ids the kernel names: after
// a crash, not one the kernel held that no one could look up again; after
// an upgrade, not a link node.
func (k *kernel) known(ids ...uint64) fuse.Status {
	if !k.partial {
		return fuse.OK
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, id := range ids {
		if id != fuse.FUSE_ROOT_ID && k.nodes[id] == 0 {
			return fuse.Status(syscall.ESTALE)
		}
	}
	return fuse.OK
}

// released forgets the kernel's handle fh; the last open of an inode
// with its pre-restart backing id gives that id back.
func (k *kernel) released(fh uint64) {
	k.mu.Lock()
	h, ok := k.handles[fh]
	delete(k.handles, fh)
	delete(k.restored, fh)
	var drop int32
	if b := k.backing[h.Node]; ok && b != nil && h.Backing == b.id {
		drop = k.unback(h.Node, b)
	}
	k.mu.Unlock()
	if drop != 0 && k.unregister != nil {
		k.unregister(drop)
	}
}

func (k *kernel) Lookup(cancel <-chan struct{}, header *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(header.NodeId); !st.Ok() {
		return st
	}
	st := k.RawFileSystem.Lookup(cancel, header, name, out)
	k.entered(st, out)
	return st
}

// Forget passes the gate: it has no reply, so it cannot wait (and a
// forget is never asked again).
func (k *kernel) Forget(nodeid, nlookup uint64) {
	k.mu.Lock()
	n := k.nodes[nodeid]
	var drop int32
	if k.partial {
		// The kernel counts lookups from before the crash too, and
		// drops a node whole: go-fuse's count is all there is to forget
		// (none of a node it does not know).
		nlookup = min(nlookup, n)
	}
	if k.crashed {
		if b := k.backing[nodeid]; b != nil && b.pre && nlookup == n {
			b.pre = false
			drop = k.unback(nodeid, b)
		}
	}
	if nlookup >= n {
		delete(k.nodes, nodeid)
		delete(k.links, nodeid)
	} else {
		k.nodes[nodeid] = n - nlookup
	}
	k.mu.Unlock()
	if drop != 0 && k.unregister != nil {
		k.unregister(drop)
	}
	if nlookup > 0 {
		k.RawFileSystem.Forget(nodeid, nlookup)
	}
}

func (k *kernel) GetAttr(cancel <-chan struct{}, input *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Flags_&fuse.FUSE_GETATTR_FH != 0 {
		if input.Fh_ = k.fh(input.Fh_); input.Fh_ == 0 {
			input.Flags_ &^= fuse.FUSE_GETATTR_FH // a crashed daemon's
		}
	}
	return k.RawFileSystem.GetAttr(cancel, input, out)
}

func (k *kernel) SetAttr(cancel <-chan struct{}, input *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Valid&fuse.FATTR_FH != 0 {
		if input.Fh = k.fh(input.Fh); input.Fh == 0 {
			input.Valid &^= fuse.FATTR_FH // a crashed daemon's
		}
	}
	return k.RawFileSystem.SetAttr(cancel, input, out)
}

func (k *kernel) Mknod(cancel <-chan struct{}, input *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, &input.InHeader)()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if k.applied(&input.InHeader) {
		return k.answer(cancel, &input.InHeader, name, out)
	}
	st := k.RawFileSystem.Mknod(cancel, input, name, out)
	k.entered(st, out)
	return k.finished(st, &input.InHeader)
}

func (k *kernel) Mkdir(cancel <-chan struct{}, input *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, &input.InHeader)()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if k.applied(&input.InHeader) {
		return k.answer(cancel, &input.InHeader, name, out)
	}
	st := k.RawFileSystem.Mkdir(cancel, input, name, out)
	k.entered(st, out)
	return k.finished(st, &input.InHeader)
}

func (k *kernel) Unlink(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, header)()
	if st := k.known(header.NodeId); !st.Ok() {
		return st
	}
	if k.applied(header) {
		return fuse.OK
	}
	return k.finished(k.RawFileSystem.Unlink(cancel, header, name), header)
}

func (k *kernel) Rmdir(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, header)()
	if st := k.known(header.NodeId); !st.Ok() {
		return st
	}
	if k.applied(header) {
		return fuse.OK
	}
	return k.finished(k.RawFileSystem.Rmdir(cancel, header, name), header)
}

func (k *kernel) Rename(cancel <-chan struct{}, input *fuse.RenameIn, oldName string, newName string) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, &input.InHeader)()
	if st := k.known(input.NodeId, input.Newdir); !st.Ok() {
		return st
	}
	if k.applied(&input.InHeader) {
		return fuse.OK
	}
	return k.finished(k.RawFileSystem.Rename(cancel, input, oldName, newName), &input.InHeader)
}

func (k *kernel) Link(cancel <-chan struct{}, input *fuse.LinkIn, filename string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, &input.InHeader)()
	if st := k.known(input.NodeId, input.Oldnodeid); !st.Ok() {
		return st
	}
	if k.applied(&input.InHeader) {
		return k.answer(cancel, &input.InHeader, filename, out)
	}
	st := k.RawFileSystem.Link(cancel, input, filename, out)
	k.entered(st, out)
	return k.finished(st, &input.InHeader)
}

func (k *kernel) Symlink(cancel <-chan struct{}, header *fuse.InHeader, pointedTo string, linkName string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, header)()
	if st := k.known(header.NodeId); !st.Ok() {
		return st
	}
	if k.applied(header) {
		return k.answer(cancel, header, linkName, out)
	}
	st := k.RawFileSystem.Symlink(cancel, header, pointedTo, linkName, out)
	k.entered(st, out)
	return k.finished(st, header)
}

func (k *kernel) Readlink(cancel <-chan struct{}, header *fuse.InHeader) ([]byte, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(header.NodeId); !st.Ok() {
		return nil, st
	}
	return k.RawFileSystem.Readlink(cancel, header)
}

func (k *kernel) Access(cancel <-chan struct{}, input *fuse.AccessIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	return k.RawFileSystem.Access(cancel, input)
}

func (k *kernel) GetXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(header.NodeId); !st.Ok() {
		return 0, st
	}
	return k.RawFileSystem.GetXAttr(cancel, header, attr, dest)
}

func (k *kernel) ListXAttr(cancel <-chan struct{}, header *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(header.NodeId); !st.Ok() {
		return 0, st
	}
	return k.RawFileSystem.ListXAttr(cancel, header, dest)
}

// SetXAttr: a registration in place (user.mrfs.register) makes a name,
// journaled with its request as a symlink's is; a resent access list
// is not set again (resentAsIs).
func (k *kernel) SetXAttr(cancel <-chan struct{}, input *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, &input.InHeader)()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if k.applied(&input.InHeader) {
		// The kernel may hold the name as absent: tell it, as the
		// registration does, once this request is answered.
		var r registerRequest
		if attr == xattrRegister && json.Unmarshal(data, &r) == nil && k.notifyEntry != nil {
			go k.notifyEntry(input.NodeId, r.Name)
		}
		return fuse.OK
	}
	if k.resentAsIs(cancel, &input.InHeader, attr, data) {
		return fuse.OK
	}
	return k.finished(k.RawFileSystem.SetXAttr(cancel, input, attr, data), &input.InHeader)
}

// resentAsIs says whether h, sent again after a restart, sets an access
// list (a file's, a directory's default) to what it is already. Its
// journal record carries no request, unlike a change of names, so the
// dead daemon may have applied it; applied again it would register the
// file once more (new keys, generation one more) for nothing: the new
// keys a set of the access brings, the restore brought already.
func (k *kernel) resentAsIs(cancel <-chan struct{}, h *fuse.InHeader, attr string, data []byte) bool {
	if h.Unique&resendBit == 0 || (attr != xattrAccess && attr != xattrDefaultAccess) {
		return false
	}
	want, err := verbs.ParseAccess(string(data))
	if err != nil {
		return false
	}
	buf := make([]byte, 256)
	n, st := k.RawFileSystem.GetXAttr(cancel, h, attr, buf)
	if !st.Ok() {
		return false
	}
	have, err := verbs.ParseAccess(string(buf[:n]))
	return err == nil && have == want
}

func (k *kernel) RemoveXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(header.NodeId); !st.Ok() {
		return st
	}
	return k.RawFileSystem.RemoveXAttr(cancel, header, attr)
}

func (k *kernel) Create(cancel <-chan struct{}, input *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	defer k.gate.enter()()
	defer makes(cancel, &input.InHeader)()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if k.applied(&input.InHeader) {
		return k.answerCreate(cancel, input, name, out)
	}
	st := k.RawFileSystem.Create(cancel, input, name, out)
	k.entered(st, &out.EntryOut)
	k.opened(st, out.NodeId, input.Flags, false, &out.OpenOut)
	return k.finished(st, &input.InHeader)
}

// answerCreate answers a create applied before a crash: the file is
// looked up and opened (never to truncate).
func (k *kernel) answerCreate(cancel <-chan struct{}, input *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	if st := k.answer(cancel, &input.InHeader, name, &out.EntryOut); !st.Ok() {
		return st
	}
	in := &fuse.OpenIn{InHeader: input.InHeader, Flags: input.Flags &^ (syscall.O_TRUNC | syscall.O_CREAT | syscall.O_EXCL)}
	in.NodeId = out.NodeId
	st := k.RawFileSystem.Open(cancel, in, &out.OpenOut)
	if !st.Ok() {
		k.Forget(out.NodeId, 1) // the kernel does not count a failed create's entry
		return st
	}
	k.opened(st, out.NodeId, in.Flags, false, &out.OpenOut)
	return st
}

func (k *kernel) Tmpfile(cancel <-chan struct{}, input *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	st := k.RawFileSystem.Tmpfile(cancel, input, out)
	k.entered(st, &out.EntryOut)
	k.opened(st, out.NodeId, input.Flags, false, &out.OpenOut)
	return st
}

func (k *kernel) Open(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	st := k.RawFileSystem.Open(cancel, input, out)
	k.opened(st, input.NodeId, input.Flags, false, out)
	return st
}

func (k *kernel) Read(cancel <-chan struct{}, input *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return nil, st
	}
	var st fuse.Status
	if input.Fh, st = k.fhOpen(input.Fh, input.NodeId, input.Flags, false); !st.Ok() {
		return nil, st
	}
	return k.RawFileSystem.Read(cancel, input, buf)
}

func (k *kernel) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(in.NodeId); !st.Ok() {
		return st
	}
	if in.Fh = k.fh(in.Fh); in.Fh == 0 {
		return fuse.EBADF
	}
	return k.RawFileSystem.Lseek(cancel, in, out)
}

func (k *kernel) GetLk(cancel <-chan struct{}, input *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.EBADF
	}
	return k.RawFileSystem.GetLk(cancel, input, out)
}

func (k *kernel) SetLk(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.EBADF
	}
	return k.RawFileSystem.SetLk(cancel, input)
}

func (k *kernel) SetLkw(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.EBADF
	}
	return k.RawFileSystem.SetLkw(cancel, input)
}

func (k *kernel) Release(cancel <-chan struct{}, input *fuse.ReleaseIn) {
	defer k.gate.enter()()
	fh := input.Fh
	if input.Fh = k.fh(fh); input.Fh != 0 || fh == 0 {
		k.RawFileSystem.Release(cancel, input)
	}
	k.released(fh)
}

func (k *kernel) Write(cancel <-chan struct{}, input *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return 0, st
	}
	var st fuse.Status
	if input.Fh, st = k.fhOpen(input.Fh, input.NodeId, input.Flags, false); !st.Ok() {
		return 0, st
	}
	return k.RawFileSystem.Write(cancel, input, data)
}

func (k *kernel) Writev(cancel <-chan struct{}, input *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return 0, st
	}
	var st fuse.Status
	if input.Fh, st = k.fhOpen(input.Fh, input.NodeId, input.Flags, false); !st.Ok() {
		return 0, st
	}
	return k.RawFileSystem.Writev(cancel, input, data)
}

func (k *kernel) CopyFileRange(cancel <-chan struct{}, input *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	defer k.gate.enter()()
	if st := k.known(input.NodeId, input.NodeIdOut); !st.Ok() {
		return 0, st
	}
	if input.FhIn, input.FhOut = k.fh(input.FhIn), k.fh(input.FhOut); input.FhIn == 0 || input.FhOut == 0 {
		return 0, fuse.EBADF
	}
	return k.RawFileSystem.CopyFileRange(cancel, input)
}

func (k *kernel) Ioctl(cancel <-chan struct{}, input *fuse.IoctlIn, inbuf []byte, output *fuse.IoctlOut, outbuf []byte) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.EBADF
	}
	return k.RawFileSystem.Ioctl(cancel, input, inbuf, output, outbuf)
}

func (k *kernel) Flush(cancel <-chan struct{}, input *fuse.FlushIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.OK // a crashed daemon's: nothing to do
	}
	return k.RawFileSystem.Flush(cancel, input)
}

func (k *kernel) Fsync(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.OK // a crashed daemon's: nothing to do
	}
	return k.RawFileSystem.Fsync(cancel, input)
}

func (k *kernel) Fallocate(cancel <-chan struct{}, input *fuse.FallocateIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.EBADF
	}
	return k.RawFileSystem.Fallocate(cancel, input)
}

func (k *kernel) OpenDir(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	st := k.RawFileSystem.OpenDir(cancel, input, out)
	k.opened(st, input.NodeId, input.Flags, true, out)
	return st
}

func (k *kernel) ReadDir(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	var st fuse.Status
	if input.Fh, st = k.fhOpen(input.Fh, input.NodeId, input.Flags, true); !st.Ok() {
		return st
	}
	return k.RawFileSystem.ReadDir(cancel, input, out)
}

func (k *kernel) ReadDirPlus(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	var st fuse.Status
	if input.Fh, st = k.fhOpen(input.Fh, input.NodeId, input.Flags, true); !st.Ok() {
		return st
	}
	st = k.RawFileSystem.ReadDirPlus(cancel, input, out)
	if st.Ok() {
		// Each entry with a node id is a lookup the kernel counts.
		if _, outs, err := fuse.ParseDirLookupEntries(out.Bytes()); err == nil {
			for i := range outs {
				k.entered(st, &outs[i])
			}
		}
	}
	return st
}

func (k *kernel) ReleaseDir(input *fuse.ReleaseIn) {
	defer k.gate.enter()()
	fh := input.Fh
	if input.Fh = k.fh(fh); input.Fh != 0 || fh == 0 {
		k.RawFileSystem.ReleaseDir(input)
	}
	k.released(fh)
}

func (k *kernel) FsyncDir(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.Fh = k.fh(input.Fh); input.Fh == 0 {
		return fuse.OK // a crashed daemon's: nothing to do
	}
	return k.RawFileSystem.FsyncDir(cancel, input)
}

func (k *kernel) StatFs(cancel <-chan struct{}, input *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	return k.RawFileSystem.StatFs(cancel, input, out)
}

func (k *kernel) Statx(cancel <-chan struct{}, input *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	defer k.gate.enter()()
	if st := k.known(input.NodeId); !st.Ok() {
		return st
	}
	if input.GetattrFlags&fuse.FUSE_GETATTR_FH != 0 {
		if input.Fh = k.fh(input.Fh); input.Fh == 0 {
			input.GetattrFlags &^= fuse.FUSE_GETATTR_FH // a crashed daemon's
		}
	}
	return k.RawFileSystem.Statx(cancel, input, out)
}

// gate lets requests through while open; closed, it holds new ones until
// it opens again (or the process executes its successor, which asks the
// kernel for them again), and its closer waits for those under way.
type gate struct {
	mu       sync.Mutex // guards: the fields below
	closed   bool
	opened   chan struct{} // closed when the gate opens again
	inflight int
	idle     chan struct{} // closed when the last request under way ends, while closed
}

// enter waits for the gate to be open and lets the request through; the
// function it returns ends the request.
func (g *gate) enter() (exit func()) {
	g.mu.Lock()
	for g.closed {
		ch := g.opened
		g.mu.Unlock()
		<-ch
		g.mu.Lock()
	}
	g.inflight++
	g.mu.Unlock()
	return g.exit
}

func (g *gate) exit() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.inflight--; g.inflight == 0 && g.idle != nil {
		close(g.idle)
		g.idle = nil
	}
}

// close stops new requests and waits up to timeout for those under way;
// EBUSY (and the gate open again) when they are not done by then.
func (g *gate) close(timeout time.Duration) error {
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return fmt.Errorf("the requests are held already: %w", syscall.EBUSY)
	}
	g.closed, g.opened = true, make(chan struct{})
	if g.inflight == 0 {
		g.mu.Unlock()
		return nil
	}
	idle, n := make(chan struct{}), g.inflight
	g.idle = idle
	g.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-time.After(timeout):
		g.open()
		return fmt.Errorf("%d requests still under way after %s: %w", n, timeout, syscall.EBUSY)
	}
}

// open lets requests through again.
func (g *gate) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		g.closed = false
		close(g.opened)
	}
	g.idle = nil
}
