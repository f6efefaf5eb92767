//go:build rdma

package guest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"mrfs/remote"
	"mrfs/remote/rdmacm"
	"mrfs/verbs"
	"mrfs/verbs/verbstest"
)

// rdmaOp connects to the daemon over rdma_cm as a peer in the PD of dir,
// on a fresh queue pair (one that saw an error is in the error state),
// runs op of the access matrix (verbstest.Ops) and returns its
// completion status. The peer is this process: rxe0 checks the keys, the
// range and the access, as it does for any other. A READ's data and an
// atomic's old value are checked against before, the buffer's bytes.
func rdmaOp(t *testing.T, d *remoteDaemon, dir string, op verbstest.Op, addr uint64, rkey uint32, before []byte) verbs.WCStatus {
	t.Helper()
	c, err := rdmacm.Dial(d.peer, dir, rdmacm.DialOptions{Timeout: 20 * time.Second, Token: d.token(t, dir)})
	if err != nil {
		t.Fatalf("rdma_cm connect to %s pd %s: %v", d.peer, dir, err)
	}
	defer c.Close()
	const off = verbstest.MatrixOff
	iova, word := addr+off, verbstest.Word(before)
	old := word
	switch op.Name {
	case "READ":
		got := make([]byte, 8)
		if err = c.Read(got, iova, rkey); err == nil && !bytes.Equal(got, before[off:off+8]) {
			t.Errorf("READ returned %x, the buffer holds %x", got, before[off:off+8])
		}
	case "WRITE":
		err = c.Write(iova, rkey, verbstest.MatrixData)
	case "CAS":
		old, err = c.CompareSwap(iova, rkey, word, verbstest.MatrixSwap)
	case "FADD":
		old, err = c.FetchAdd(iova, rkey, verbstest.MatrixAdd)
	}
	if err == nil && old != word {
		t.Errorf("%s returned old %d, the word was %d", op.Name, old, word)
	}
	var wc *remote.StatusError
	switch {
	case err == nil:
		return verbs.WCSuccess
	case errors.As(err, &wc):
		return wc.Status
	}
	t.Fatalf("%s failed without a completion: %v", op.Name, err)
	return 0
}

// keys parses the addr and rkey xattrs that buffer returns.
func keys(t *testing.T, iova, rkey string) (uint64, uint32) {
	t.Helper()
	a, err := strconv.ParseUint(iova, 0, 64)
	if err != nil {
		t.Fatalf("user.mrfs.addr %q: %v", iova, err)
	}
	k, err := strconv.ParseUint(rkey, 0, 32)
	if err != nil {
		t.Fatalf("user.mrfs.rkey %q: %v", rkey, err)
	}
	return a, uint32(k)
}

// checkOp fills file (verbstest.MatrixBuffer, in place: no O_TRUNC, the
// keys stay), runs op as a peer of dir, and wants it to succeed (worked)
// or end in IBV_WC_REM_ACCESS_ERR, and the file to hold what follows.
func checkOp(t *testing.T, d *remoteDaemon, dir, file string, op verbstest.Op, addr uint64, rkey uint32, worked bool, what string) {
	t.Helper()
	before := verbstest.MatrixBuffer(4096)
	writeAt(t, file, before)
	want, wantSt := before, verbs.WCRemAccessErr
	if worked {
		want, wantSt = op.Apply(before), verbs.WCSuccess
	}
	if st := rdmaOp(t, d, dir, op, addr, rkey, before); st != wantSt {
		t.Errorf("%s %s: %v, want %v", op.Name, what, st, wantSt)
	}
	got, err := os.ReadFile(file)
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("%s %s: the file does not hold what it should (%v)", op.Name, what, err)
	}
}

// TestRemoteAccessMatrixRDMA: on rxe0 over rdma_cm, for every combination
// of access flags the kernel accepts, each operation succeeds exactly
// when the buffer has the one flag it needs (a local_write buffer
// refuses a WRITE; a remote_read buffer without local_write serves a
// READ) and does what it says; a refused one changes no byte. The NIC
// checks the region mrfs registered, so this proves the flags mrfs hands
// the kernel are the ones user.mrfs.access shows.
func TestRemoteAccessMatrixRDMA(t *testing.T) {
	requireGuest(t)
	d := remoteMount(t)
	for i, a := range verbstest.ValidAccess {
		f := filepath.Join(d.dir, fmt.Sprintf("acc%d", i))
		iova, rk := buffer(t, f, 4096, verbstest.AccessName(a))
		addr, rkey := keys(t, iova, rk)
		if got := getxattr(t, f, "user.mrfs.access"); got != a.String() {
			t.Fatalf("user.mrfs.access %q after setting %q", got, verbstest.AccessName(a))
		}
		for _, op := range verbstest.Ops {
			checkOp(t, d, "/", f, op, addr, rkey, a&op.Need != 0, fmt.Sprintf("on a buffer with access %q", verbstest.AccessName(a)))
		}
	}
	if err := d.stop(t); err != nil {
		t.Errorf("mrfs exited with %v after SIGINT, want 0", err)
	}
}

// TestRemoteAfterMoveRDMA: after `mv` to another directory, a peer
// naming the new directory reaches the buffer with its new keys; one
// naming the old directory gets IBV_WC_REM_ACCESS_ERR with them; the
// keys from before the move work nowhere.
func TestRemoteAfterMoveRDMA(t *testing.T) {
	requireGuest(t)
	d := remoteMount(t)
	for _, dir := range []string{"old", "new"} {
		if err := os.Mkdir(filepath.Join(d.dir, dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	src, dst := filepath.Join(d.dir, "old", "buf"), filepath.Join(d.dir, "new", "buf")
	iova, rk := buffer(t, src, 4096, "local_write,remote_write,remote_read,remote_atomic")
	oldAddr, oldKey := keys(t, iova, rk)
	if err := os.Rename(src, dst); err != nil {
		t.Fatal(err)
	}
	addr, rkey := keys(t, getxattr(t, dst, "user.mrfs.addr"), getxattr(t, dst, "user.mrfs.rkey"))
	if rkey == oldKey {
		t.Errorf("rkey %#x unchanged by a move to another PD", rkey)
	}
	for _, c := range []struct {
		dir    string
		addr   uint64
		rkey   uint32
		worked bool
	}{
		{"new", addr, rkey, true},
		{"old", addr, rkey, false},
		{"old", oldAddr, oldKey, false},
		{"new", oldAddr, oldKey, false},
	} {
		for _, op := range verbstest.Ops {
			checkOp(t, d, c.dir, dst, op, c.addr, c.rkey, c.worked, fmt.Sprintf("from %s with rkey %#x after the move", c.dir, c.rkey))
		}
	}
	if err := d.stop(t); err != nil {
		t.Errorf("mrfs exited with %v after SIGINT, want 0", err)
	}
}
