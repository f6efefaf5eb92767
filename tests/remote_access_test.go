package tests

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/remote/client"
	"mrfs/verbs"
	"mrfs/verbs/verbstest"
)

// matrixOff is where the access-matrix operations act: an aligned word
// inside the buffer, not at its start.
const matrixOff = 64

// doOp runs one operation of verbstest.Ops at addr+matrixOff on a fresh
// connection to dir (an operation that fails leaves a queue pair in
// error) and returns its status. A READ's data and an atomic's old value
// are checked against want, the buffer's bytes before the operation.
func doOp(t *testing.T, peer, dir string, op verbstest.Op, addr uint64, key uint32, want []byte) verbs.WCStatus {
	t.Helper()
	c := dialPD(t, peer, dir)
	defer c.Close()
	word := binary.NativeEndian.Uint64(want[matrixOff:])
	var err error
	var old uint64
	switch op.Name {
	case "READ":
		got := make([]byte, 8)
		if err = c.Read(got, addr+matrixOff, key); err == nil && !bytes.Equal(got, want[matrixOff:matrixOff+8]) {
			t.Errorf("READ returned %x, the buffer holds %x", got, want[matrixOff:matrixOff+8])
		}
		return client.Status(err)
	case "WRITE":
		err = c.Write(addr+matrixOff, key, []byte("ABCDEFGH"))
		return client.Status(err)
	case "CAS":
		old, err = c.CompareSwap(addr+matrixOff, key, word, 9)
	case "FADD":
		old, err = c.FetchAdd(addr+matrixOff, key, 3)
	}
	if err == nil && old != word {
		t.Errorf("%s returned old %d, the word was %d", op.Name, old, word)
	}
	return client.Status(err)
}

// applyOp is what a successful operation of doOp does to the buffer b.
func applyOp(op verbstest.Op, b []byte) {
	w := b[matrixOff : matrixOff+8]
	switch op.Name {
	case "WRITE":
		copy(w, "ABCDEFGH")
	case "CAS":
		binary.NativeEndian.PutUint64(w, 9)
	case "FADD":
		binary.NativeEndian.PutUint64(w, binary.NativeEndian.Uint64(w)+3)
	}
}

// fillForOp writes a pattern and the word 5 at matrixOff into the first
// n bytes of path, in place (O_TRUNC would re-register: new keys), and
// returns what the file holds.
func fillForOp(t *testing.T, path string, n int) []byte {
	t.Helper()
	b := patternBytes(n)
	binary.NativeEndian.PutUint64(b[matrixOff:], 5)
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
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
	const size = 4096
	for i, a := range verbstest.ValidAccess {
		f := d.path(fmt.Sprintf("acc%d", i))
		addr, key := remoteBuf(t, f, size, verbstest.AccessName(a))
		if got := mustXattr(t, f, xAccess); got != a.String() {
			t.Fatalf("access %q after setting %q", got, verbstest.AccessName(a))
		}
		for _, op := range verbstest.Ops {
			before := fillForOp(t, f, size)
			want := bytes.Clone(before)
			wantSt := verbs.WCRemAccessErr
			if a&op.Need != 0 {
				wantSt = verbs.WCSuccess
				applyOp(op, want)
			}
			if st := doOp(t, peer, "/", op, addr, key, before); st != wantSt {
				t.Errorf("%s on a buffer with access %q: %v, want %v", op.Name, verbstest.AccessName(a), st, wantSt)
			}
			if got, err := os.ReadFile(f); err != nil || !bytes.Equal(got, want) {
				t.Errorf("%s on a buffer with access %q: the file does not hold what it should (%v)", op.Name, verbstest.AccessName(a), err)
			}
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
	const size = 4096
	src, dst := d.path("old", "buf"), d.path("new", "buf")
	oldAddr, oldKey := remoteBuf(t, src, size, allRemote)
	if err := os.Rename(src, dst); err != nil {
		t.Fatal(err)
	}
	addr, key := keysOf(t, dst)
	if key == oldKey {
		t.Errorf("rkey 0x%x unchanged by a move to another PD", key)
	}
	for _, c := range []struct {
		dir        string
		addr       uint64
		key        uint32
		wantWorked bool
	}{
		{"/new", addr, key, true},
		{"/old", addr, key, false},
		{"/old", oldAddr, oldKey, false},
		{"/new", oldAddr, oldKey, false},
		{"/", addr, key, false},
	} {
		for _, op := range verbstest.Ops {
			before := fillForOp(t, dst, size)
			want := bytes.Clone(before)
			wantSt := verbs.WCRemAccessErr
			if c.wantWorked {
				wantSt = verbs.WCSuccess
				applyOp(op, want)
			}
			if st := doOp(t, peer, c.dir, op, c.addr, c.key, before); st != wantSt {
				t.Errorf("%s from %s with rkey 0x%x after the move: %v, want %v", op.Name, c.dir, c.key, st, wantSt)
			}
			if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, want) {
				t.Errorf("%s from %s with rkey 0x%x after the move: the file does not hold what it should (%v)", op.Name, c.dir, c.key, err)
			}
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
	d, peer := startRemoteConf(t, "listen = \"127.0.0.1:0\"\ntimeout = \"10s\"\nmax_message_size = \"1MiB\"")
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
					if st := client.Status(err); st != verbs.WCSuccess {
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
