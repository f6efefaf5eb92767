package tests

import (
	"bytes"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/remote"
	"mrfs/verbs"
	"mrfs/verbs/verbstest"
)

// doOp runs op of the access matrix (verbstest.Ops) on a fresh
// connection to dir (an operation that fails leaves a queue pair in
// error) and returns its status. A READ's data and an atomic's old value
// are checked against before, the buffer's bytes.
func doOp(t *testing.T, peer, dir string, op verbstest.Op, addr uint64, key uint32, before []byte) verbs.WCStatus {
	t.Helper()
	c := dialPD(t, peer, dir)
	defer c.Close()
	const off = verbstest.MatrixOff
	iova, word := addr+off, verbstest.Word(before)
	var err error
	old := word
	switch op.Name {
	case "READ":
		got := make([]byte, 8)
		if err = c.Read(got, iova, key); err == nil && !bytes.Equal(got, before[off:off+8]) {
			t.Errorf("READ returned %x, the buffer holds %x", got, before[off:off+8])
		}
	case "WRITE":
		err = c.Write(iova, key, verbstest.MatrixData)
	case "CAS":
		old, err = c.CompareSwap(iova, key, word, verbstest.MatrixSwap)
	case "FADD":
		old, err = c.FetchAdd(iova, key, verbstest.MatrixAdd)
	}
	if err == nil && old != word {
		t.Errorf("%s returned old %d, the word was %d", op.Name, old, word)
	}
	return remote.Status(err)
}

// checkOp fills file (verbstest.MatrixBuffer, in place: O_TRUNC would
// re-register), runs op from a peer of dir, and wants it to succeed
// (worked) or end in IBV_WC_REM_ACCESS_ERR, and the file to hold what
// follows.
func checkOp(t *testing.T, peer, dir, file string, op verbstest.Op, addr uint64, key uint32, worked bool, what string) {
	t.Helper()
	before := verbstest.MatrixBuffer(4096)
	fh, err := os.OpenFile(file, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = fh.WriteAt(before, 0)
	fh.Close()
	if err != nil {
		t.Fatal(err)
	}
	want, wantSt := before, verbs.WCRemAccessErr
	if worked {
		want, wantSt = op.Apply(before), verbs.WCSuccess
	}
	if st := doOp(t, peer, dir, op, addr, key, before); st != wantSt {
		t.Errorf("%s %s: %v, want %v", op.Name, what, st, wantSt)
	}
	if got, err := os.ReadFile(file); err != nil || !bytes.Equal(got, want) {
		t.Errorf("%s %s: the file does not hold what it should (%v)", op.Name, what, err)
	}
}

// TestRemoteAccessMatrix: through the mount and the soft transport, for
// every combination of access flags the kernel accepts, each operation
// succeeds exactly when the buffer has the one flag it needs (a
// local_write buffer refuses a WRITE; a remote_read buffer without
// local_write serves a READ) and then does what it says; a refused one
// changes no byte. The combinations the kernel refuses are EINVAL.
func TestRemoteAccessMatrix(t *testing.T) {
	t.Parallel()
	d, peer := startRemote(t)
	for _, a := range verbstest.InvalidAccess {
		f := d.path("invalid")
		makeBuffer(t, f, 4096)
		wantErrno(t, setxattr(f, xAccess, a.String()), unix.EINVAL, "set access "+a.String())
		if got := mustXattr(t, f, xAccess); got != "local_write" {
			t.Errorf("access %q after a refused set of %s", got, a)
		}
	}
	for i, a := range verbstest.ValidAccess {
		f := d.path(fmt.Sprintf("acc%d", i))
		addr, key := remoteBuf(t, f, 4096, verbstest.AccessName(a))
		if got := mustXattr(t, f, xAccess); got != a.String() {
			t.Fatalf("access %q after setting %q", got, verbstest.AccessName(a))
		}
		for _, op := range verbstest.Ops {
			checkOp(t, peer, "/", f, op, addr, key, a&op.Need != 0, fmt.Sprintf("on a buffer with access %q", verbstest.AccessName(a)))
		}
	}
}

// TestRemoteAfterMove: `mv` to another directory moves the buffer's
// region into that directory's PD: a peer naming the new directory
// reaches it with the new keys, one naming the old directory gets
// IBV_WC_REM_ACCESS_ERR with them, and the keys from before the move
// are dead in both.
func TestRemoteAfterMove(t *testing.T) {
	t.Parallel()
	d, peer := startRemote(t)
	for _, dir := range []string{"old", "new"} {
		if err := os.Mkdir(d.path(dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	src, dst := d.path("old", "buf"), d.path("new", "buf")
	oldAddr, oldKey := remoteBuf(t, src, 4096, allRemote)
	if err := os.Rename(src, dst); err != nil {
		t.Fatal(err)
	}
	addr, key := keysOf(t, dst)
	if key == oldKey {
		t.Errorf("rkey 0x%x unchanged by a move to another PD", key)
	}
	for _, c := range []struct {
		dir    string
		addr   uint64
		key    uint32
		worked bool
	}{
		{"/new", addr, key, true},
		{"/old", addr, key, false},
		{"/old", oldAddr, oldKey, false},
		{"/new", oldAddr, oldKey, false},
		{"/", addr, key, false},
	} {
		for _, op := range verbstest.Ops {
			checkOp(t, peer, c.dir, dst, op, c.addr, c.key, c.worked, fmt.Sprintf("from %s with rkey 0x%x after the move", c.dir, c.key))
		}
	}
}

// TestRemoteUnlinkUnderLoad: peers READ a whole buffer again and again
// while it is unlinked. Every READ returns the buffer's bytes, or fails
// with IBV_WC_REM_ACCESS_ERR once the region is gone, and nothing else:
// mrfs deregisters before it unmaps, and a deregistration waits for the
// operations in flight. Unmapping first would let a READ in flight
// fault (IBV_WC_REM_OP_ERR) or copy whatever is mapped there next. The
// unlink meets a READ in flight in about one round in three, so over 30
// rounds that order is caught with near certainty (scripts/mutants.txt);
// the right order passes every round.
func TestRemoteUnlinkUnderLoad(t *testing.T) {
	t.Parallel()
	d, peer := startRemoteConf(t, backend.listen()+fmt.Sprintf("timeout = %q\nmax_message_size = \"1MiB\"", 10*time.Second*slowFactor()))
	const size, rounds, peers = 1 << 20, 30, 4
	data := patternBytes(size)
	for round := range rounds {
		f := d.path(fmt.Sprintf("buf%d", round))
		if err := os.WriteFile(f, data, 0o600); err != nil {
			t.Fatal(err)
		}
		mustSetxattr(t, f, xAccess, "local_write,remote_read")
		addr, key := keysOf(t, f)
		var started, done sync.WaitGroup
		for range peers {
			c := dialPD(t, peer, "/")
			started.Add(1)
			done.Go(func() {
				defer c.Close()
				got := make([]byte, size)
				first := true
				for {
					err := c.Read(got, addr, key)
					if st := remote.Status(err); st != verbs.WCSuccess {
						if st != verbs.WCRemAccessErr {
							t.Errorf("round %d: a READ racing the unlink ended with %v (%v), want success or %v", round, st, err, verbs.WCRemAccessErr)
						}
						if first {
							t.Errorf("round %d: the first READ failed: %v", round, err)
							started.Done()
						}
						return
					}
					if !bytes.Equal(got, data) {
						t.Errorf("round %d: a READ racing the unlink returned other bytes than the buffer's", round)
					}
					if first {
						first = false
						started.Done()
					}
				}
			})
		}
		started.Wait()
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
		done.Wait()
		if t.Failed() {
			return
		}
	}
}
