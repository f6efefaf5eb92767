package fs

import (
	"errors"
	"sync"
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
