package fs

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// forgets is a bridge that only counts the FORGETs it is given.
type forgets struct {
	fuse.RawFileSystem
	mu  sync.Mutex // guards: got
	got map[uint64]uint64
}

func (f *forgets) Forget(nodeid, nlookup uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got[nodeid] += nlookup
}

// TestKernelForgetWaitsForHandover: a FORGET that comes while the
// kernel's state is handed over waits for the handover's end: when the
// exec works, the successor has the state without it and is asked again
// by no one, so applying it here would lose it. When the handover fails,
// it is applied then.
func TestKernelForgetWaitsForHandover(t *testing.T) {
	bridge := &forgets{RawFileSystem: fuse.NewDefaultRawFileSystem(), got: map[uint64]uint64{}}
	k := newKernel(bridge)
	k.nodes[7] = 2
	done := make(chan struct{})
	failed := errors.New("exec failed")
	err := k.frozen(func(st KernelState) error {
		if st.Nodes[7] != 2 {
			t.Errorf("handed over node 7 with count %d, want 2", st.Nodes[7])
		}
		go func() {
			k.Forget(7, 2)
			close(done)
		}()
		select {
		case <-done:
			t.Error("a FORGET was applied during the handover: the successor counts the node still, and never frees it")
		case <-time.After(200 * time.Millisecond):
		}
		return failed
	})
	if !errors.Is(err, failed) {
		t.Errorf("frozen returned %v, want the handover's error", err)
	}
	<-done
	k.mu.Lock()
	n, held := k.nodes[7]
	k.mu.Unlock()
	bridge.mu.Lock()
	defer bridge.mu.Unlock()
	if held || bridge.got[7] != 2 {
		t.Errorf("after a failed handover the FORGET left the kernel's count %d (held %v), the bridge's forget %d", n, held, bridge.got[7])
	}
}

// bridge is a go-fuse bridge that records what it is asked.
type bridge struct {
	fuse.RawFileSystem
	mu       sync.Mutex // guards: the fields below
	opens    []fuse.OpenIn
	released []uint64
	forgot   map[uint64]uint64
	reads    []uint64 // the handles reads came with
}

func newBridge() *bridge {
	return &bridge{RawFileSystem: fuse.NewDefaultRawFileSystem(), forgot: map[uint64]uint64{}}
}

func (b *bridge) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.opens = append(b.opens, *in)
	out.Fh = uint64(len(b.opens))
	return fuse.OK
}

func (b *bridge) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	return b.Open(cancel, in, out)
}

func (b *bridge) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reads = append(b.reads, in.Fh)
	return fuse.ReadResultData(nil), fuse.OK
}

func (b *bridge) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.released = append(b.released, in.Fh)
}

func (b *bridge) Forget(nodeid, nlookup uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.forgot[nodeid] += nlookup
}

// TestKernelAfterCrash: what the kernel held of a daemon that died and
// the next daemon could not be told. A handle of the dead daemon's is
// opened again at its first read, once (never to truncate), and its close
// ends that open; a close of one never read goes to no one. A node the
// kernel holds that nobody looked up again is ESTALE, and its FORGET goes
// to no one; the FORGET of one looked up again gives go-fuse back all it
// has, not the kernel's count, which includes lookups from before.
func TestKernelAfterCrash(t *testing.T) {
	b := newBridge()
	k := newKernel(b)
	k.crashed, k.partial, k.base = true, true, 1<<40
	k.nodes[5] = 1  // looked up again by the restore
	const stale = 7 // a handle the dead daemon gave

	read := func(fh uint64) fuse.Status {
		_, st := k.Read(nil, &fuse.ReadIn{InHeader: fuse.InHeader{NodeId: 5}, Fh: fh, Flags: syscall.O_RDWR | syscall.O_TRUNC}, nil)
		return st
	}
	if st := read(stale); !st.Ok() {
		t.Fatalf("a read with a handle from before the crash: %v", st)
	}
	if st := read(stale); !st.Ok() {
		t.Fatalf("a second read with it: %v", st)
	}
	b.mu.Lock()
	if len(b.opens) != 1 || b.opens[0].NodeId != 5 || b.opens[0].Flags != syscall.O_RDWR || len(b.reads) != 2 || b.reads[0] != 1 || b.reads[1] != 1 {
		t.Errorf("two reads with a stale handle: opens %+v, reads with go-fuse's handles %v; want one open (O_RDWR, no O_TRUNC) and both reads on it", b.opens, b.reads)
	}
	b.mu.Unlock()
	k.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: 5}, Fh: stale})
	k.Release(nil, &fuse.ReleaseIn{InHeader: fuse.InHeader{NodeId: 5}, Fh: 9}) // never read
	b.mu.Lock()
	if len(b.released) != 1 || b.released[0] != 1 {
		t.Errorf("closes of a handle opened again and of one never read: go-fuse released %v, want [1]", b.released)
	}
	b.mu.Unlock()

	if st := k.Access(nil, &fuse.AccessIn{InHeader: fuse.InHeader{NodeId: 6}}); st != fuse.Status(syscall.ESTALE) {
		t.Errorf("a request for a node nobody looked up again: %v, want ESTALE", st)
	}
	k.Forget(6, 3)
	k.Forget(5, 4)
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.forgot) != 1 || b.forgot[5] != 1 {
		t.Errorf("FORGETs of a node not looked up again and of one looked up once, counted 4 by the kernel: go-fuse forgot %v, want node 5 once", b.forgot)
	}
}

// TestKernelBackingFollowsGoFuse: go-fuse registers a node's backing
// file anew once its last open is released, which may come before that
// release reaches the kernel wrapper: the new open gets go-fuse's new id,
// not the old one (given back: the kernel would fail the open with EIO).
// Each change is journaled; go-fuse's own ids are never given back here.
func TestKernelBackingFollowsGoFuse(t *testing.T) {
	k := newKernel(newBridge())
	var notes []string
	k.onBacking = func(node uint64, id int32) { notes = append(notes, fmt.Sprintf("%d:%d", node, id)) }
	var dropped []int32
	k.unregister = func(id int32) syscall.Errno { dropped = append(dropped, id); return 0 }
	open := func(fh uint64, id int32) int32 {
		out := fuse.OpenOut{Fh: fh, BackingID: id}
		k.opened(fuse.OK, 5, syscall.O_RDWR, false, &out)
		return out.BackingID
	}
	if got := open(1, 10); got != 10 {
		t.Errorf("first open: backing id %d, want 10", got)
	}
	if got := open(2, 11); got != 11 {
		t.Errorf("an open go-fuse registered anew while the last one's release is under way: backing id %d, want go-fuse's 11", got)
	}
	k.released(1)
	if got := open(3, 11); got != 11 {
		t.Errorf("another open: backing id %d, want 11", got)
	}
	k.released(2)
	k.released(3)
	if want := []string{"5:10", "5:11", "5:0"}; !slices.Equal(notes, want) || len(dropped) != 0 {
		t.Errorf("journaled %v, want %v; given back %v, want none (go-fuse's own)", notes, want, dropped)
	}
}

// TestKernelLinksAfterUpgrade: the link a SYMLINK's reply gave (a
// registration in place's, in no tree) is handed over as such; the next
// daemon, which cannot look it up, answers it ESTALE and keeps its FORGET
// from go-fuse, and says so to the daemon after it (Partial), as after a
// crash.
func TestKernelLinksAfterUpgrade(t *testing.T) {
	tr := newTestTree(t)
	const link = 9
	old := newKernel(fuse.NewDefaultRawFileSystem())
	old.entered(fuse.OK, &fuse.EntryOut{NodeId: link, Attr: fuse.Attr{Mode: syscall.S_IFLNK | 0o777}})
	old.entered(fuse.OK, &fuse.EntryOut{NodeId: 3, Attr: fuse.Attr{Mode: syscall.S_IFREG | 0o600}})
	var st KernelState
	old.frozen(func(s KernelState) error { st = s; return nil })
	if !slices.Equal(st.Links, []uint64{link}) || st.Partial {
		t.Errorf("handed over links %v, partial %v; want [%d], false", st.Links, st.Partial, link)
	}

	bridge := &forgets{RawFileSystem: fuse.NewDefaultRawFileSystem(), got: map[uint64]uint64{}}
	k := newKernel(bridge)
	if err := k.restore(bridge, tr, KernelState{Nodes: map[uint64]uint64{fuse.FUSE_ROOT_ID: 1, link: 1}}); err != nil {
		t.Fatal(err)
	}
	if got := k.known(link); got != fuse.Status(syscall.ESTALE) {
		t.Errorf("a request for the link after the upgrade: %v, want ESTALE", got)
	}
	k.Forget(link, 1)
	if len(bridge.got) != 0 {
		t.Errorf("the link's FORGET reached go-fuse, which never knew it: %v", bridge.got)
	}
	k.frozen(func(s KernelState) error { st = s; return nil })
	next := newKernel(bridge)
	if err := next.restore(bridge, tr, st); err != nil {
		t.Fatal(err)
	}
	if got := next.known(link); !st.Partial || got != fuse.Status(syscall.ESTALE) {
		t.Errorf("the daemon after: partial %v, a request for a node nobody knows: %v, want ESTALE", st.Partial, got)
	}
}
