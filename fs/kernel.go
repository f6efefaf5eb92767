package fs

import (
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
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
type kernel struct {
	fuse.RawFileSystem

	gate gate
	// base is added to go-fuse's handle numbers (0 until a restore;
	// set before serving, then read without a lock).
	base uint64
	// unregister gives a backing id back to the kernel (the server's).
	unregister func(id int32) syscall.Errno

	mu sync.Mutex // guards: nodes, handles, restored, backing
	// nodes are the kernel's lookup counts, by node id.
	nodes map[uint64]uint64
	// handles are the kernel's open handles, by its number.
	handles map[uint64]KernelHandle
	// restored maps the number of an open made before the restart to
	// go-fuse's.
	restored map[uint64]uint64
	// backing is, by node id, the backing id that opens made before the
	// restart were given, while any open uses it.
	backing map[uint64]*backingRef
}

type backingRef struct {
	id   int32
	refs int
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
}

func newKernel(bridge fuse.RawFileSystem) *kernel {
	return &kernel{RawFileSystem: bridge, nodes: map[uint64]uint64{}, handles: map[uint64]KernelHandle{},
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
	st := KernelState{Nodes: make(map[uint64]uint64, len(k.nodes)), Base: k.base}
	for id, n := range k.nodes {
		st.Nodes[id] = n
	}
	for _, h := range k.handles {
		st.Handles = append(st.Handles, h)
	}
	return f(st)
}

// entered counts a reply that gave the kernel a node.
func (k *kernel) entered(st fuse.Status, out *fuse.EntryOut) {
	if !st.Ok() || out.NodeId == 0 {
		return
	}
	k.mu.Lock()
	k.nodes[out.NodeId]++
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
	if b := k.backing[node]; b != nil && out.BackingID != 0 {
		out.BackingID = b.id
		b.refs++
	}
	k.handles[out.Fh] = KernelHandle{Fh: out.Fh, Node: node, Flags: flags, Dir: dir, Backing: out.BackingID}
}

// fh is go-fuse's number of the kernel's handle fh.
func (k *kernel) fh(fh uint64) uint64 {
	if k.base == 0 || fh == 0 {
		return fh
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if b, ok := k.restored[fh]; ok {
		return b
	}
	return fh - k.base
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
		if b.refs--; b.refs == 0 {
			delete(k.backing, h.Node)
			drop = b.id
		}
	}
	k.mu.Unlock()
	if drop != 0 && k.unregister != nil {
		k.unregister(drop)
	}
}

func (k *kernel) Lookup(cancel <-chan struct{}, header *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Lookup(cancel, header, name, out)
	k.entered(st, out)
	return st
}

// Forget passes the gate: it has no reply, so it cannot wait (and a
// forget is never asked again).
func (k *kernel) Forget(nodeid, nlookup uint64) {
	k.mu.Lock()
	if n := k.nodes[nodeid]; nlookup >= n {
		delete(k.nodes, nodeid)
	} else {
		k.nodes[nodeid] = n - nlookup
	}
	k.mu.Unlock()
	k.RawFileSystem.Forget(nodeid, nlookup)
}

func (k *kernel) GetAttr(cancel <-chan struct{}, input *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	defer k.gate.enter()()
	if input.Flags_&fuse.FUSE_GETATTR_FH != 0 {
		input.Fh_ = k.fh(input.Fh_)
	}
	return k.RawFileSystem.GetAttr(cancel, input, out)
}

func (k *kernel) SetAttr(cancel <-chan struct{}, input *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	defer k.gate.enter()()
	if input.Valid&fuse.FATTR_FH != 0 {
		input.Fh = k.fh(input.Fh)
	}
	return k.RawFileSystem.SetAttr(cancel, input, out)
}

func (k *kernel) Mknod(cancel <-chan struct{}, input *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Mknod(cancel, input, name, out)
	k.entered(st, out)
	return st
}

func (k *kernel) Mkdir(cancel <-chan struct{}, input *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Mkdir(cancel, input, name, out)
	k.entered(st, out)
	return st
}

func (k *kernel) Unlink(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.Unlink(cancel, header, name)
}

func (k *kernel) Rmdir(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.Rmdir(cancel, header, name)
}

func (k *kernel) Rename(cancel <-chan struct{}, input *fuse.RenameIn, oldName string, newName string) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.Rename(cancel, input, oldName, newName)
}

func (k *kernel) Link(cancel <-chan struct{}, input *fuse.LinkIn, filename string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Link(cancel, input, filename, out)
	k.entered(st, out)
	return st
}

func (k *kernel) Symlink(cancel <-chan struct{}, header *fuse.InHeader, pointedTo string, linkName string, out *fuse.EntryOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Symlink(cancel, header, pointedTo, linkName, out)
	k.entered(st, out)
	return st
}

func (k *kernel) Readlink(cancel <-chan struct{}, header *fuse.InHeader) ([]byte, fuse.Status) {
	defer k.gate.enter()()
	return k.RawFileSystem.Readlink(cancel, header)
}

func (k *kernel) Access(cancel <-chan struct{}, input *fuse.AccessIn) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.Access(cancel, input)
}

func (k *kernel) GetXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	return k.RawFileSystem.GetXAttr(cancel, header, attr, dest)
}

func (k *kernel) ListXAttr(cancel <-chan struct{}, header *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	return k.RawFileSystem.ListXAttr(cancel, header, dest)
}

func (k *kernel) SetXAttr(cancel <-chan struct{}, input *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.SetXAttr(cancel, input, attr, data)
}

func (k *kernel) RemoveXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.RemoveXAttr(cancel, header, attr)
}

func (k *kernel) Create(cancel <-chan struct{}, input *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Create(cancel, input, name, out)
	k.entered(st, &out.EntryOut)
	k.opened(st, out.NodeId, input.Flags, false, &out.OpenOut)
	return st
}

func (k *kernel) Tmpfile(cancel <-chan struct{}, input *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Tmpfile(cancel, input, out)
	k.entered(st, &out.EntryOut)
	k.opened(st, out.NodeId, input.Flags, false, &out.OpenOut)
	return st
}

func (k *kernel) Open(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.Open(cancel, input, out)
	k.opened(st, input.NodeId, input.Flags, false, out)
	return st
}

func (k *kernel) Read(cancel <-chan struct{}, input *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Read(cancel, input, buf)
}

func (k *kernel) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	defer k.gate.enter()()
	in.Fh = k.fh(in.Fh)
	return k.RawFileSystem.Lseek(cancel, in, out)
}

func (k *kernel) GetLk(cancel <-chan struct{}, input *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.GetLk(cancel, input, out)
}

func (k *kernel) SetLk(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.SetLk(cancel, input)
}

func (k *kernel) SetLkw(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.SetLkw(cancel, input)
}

func (k *kernel) Release(cancel <-chan struct{}, input *fuse.ReleaseIn) {
	defer k.gate.enter()()
	fh := input.Fh
	input.Fh = k.fh(fh)
	k.RawFileSystem.Release(cancel, input)
	k.released(fh)
}

func (k *kernel) Write(cancel <-chan struct{}, input *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Write(cancel, input, data)
}

func (k *kernel) Writev(cancel <-chan struct{}, input *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Writev(cancel, input, data)
}

func (k *kernel) CopyFileRange(cancel <-chan struct{}, input *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	defer k.gate.enter()()
	input.FhIn, input.FhOut = k.fh(input.FhIn), k.fh(input.FhOut)
	return k.RawFileSystem.CopyFileRange(cancel, input)
}

func (k *kernel) Ioctl(cancel <-chan struct{}, input *fuse.IoctlIn, inbuf []byte, output *fuse.IoctlOut, outbuf []byte) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Ioctl(cancel, input, inbuf, output, outbuf)
}

func (k *kernel) Flush(cancel <-chan struct{}, input *fuse.FlushIn) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Flush(cancel, input)
}

func (k *kernel) Fsync(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Fsync(cancel, input)
}

func (k *kernel) Fallocate(cancel <-chan struct{}, input *fuse.FallocateIn) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.Fallocate(cancel, input)
}

func (k *kernel) OpenDir(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	defer k.gate.enter()()
	st := k.RawFileSystem.OpenDir(cancel, input, out)
	k.opened(st, input.NodeId, input.Flags, true, out)
	return st
}

func (k *kernel) ReadDir(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.ReadDir(cancel, input, out)
}

func (k *kernel) ReadDirPlus(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	st := k.RawFileSystem.ReadDirPlus(cancel, input, out)
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
	input.Fh = k.fh(fh)
	k.RawFileSystem.ReleaseDir(input)
	k.released(fh)
}

func (k *kernel) FsyncDir(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	defer k.gate.enter()()
	input.Fh = k.fh(input.Fh)
	return k.RawFileSystem.FsyncDir(cancel, input)
}

func (k *kernel) StatFs(cancel <-chan struct{}, input *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	defer k.gate.enter()()
	return k.RawFileSystem.StatFs(cancel, input, out)
}

func (k *kernel) Statx(cancel <-chan struct{}, input *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	defer k.gate.enter()()
	if input.GetattrFlags&fuse.FUSE_GETATTR_FH != 0 {
		input.Fh = k.fh(input.Fh)
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
