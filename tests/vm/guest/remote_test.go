//go:build rdma

package guest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/remote/rdmacm"
)

// listenAddr is where the daemon's rdma_cm listener binds: eth0's
// address, the one rxe0 carries.
const listenAddr = "10.0.2.15:7471"

// The peer is this test binary run again as another process (TestMain):
// MRFS_PEER_OP says what to do, the rest of MRFS_PEER_* where.
func TestMain(m *testing.M) {
	if op := os.Getenv("MRFS_PEER_OP"); op != "" {
		os.Exit(peerMain(op))
	}
	os.Exit(m.Run())
}

// peerMain connects to the daemon over rdma_cm and performs one
// operation, printing "peer: ..." lines; exit 0 on success, 3 when the
// completion carried an error status, 1 on other errors.
func peerMain(op string) int {
	env := func(k string) string { return os.Getenv("MRFS_PEER_" + k) }
	num := func(k string) uint64 {
		n, _ := strconv.ParseUint(env(k), 0, 64)
		return n
	}
	c, err := rdmacm.Dial(env("ADDR"), env("DIR"), rdmacm.DialOptions{Timeout: 20 * time.Second})
	if err != nil {
		fmt.Printf("peer: dial: %v\n", err)
		return 1
	}
	defer c.Close()
	addr, rkey := num("IOVA"), uint32(num("RKEY"))
	switch op {
	case "write":
		err = c.Write(addr, rkey, []byte(env("DATA")))
		if err == nil {
			fmt.Printf("peer: RDMA WRITE of %d bytes to 0x%x rkey 0x%x: IBV_WC_SUCCESS\n", len(env("DATA")), addr, rkey)
		}
	case "read":
		var b []byte
		b, err = c.Read(addr, rkey, int(num("LEN")))
		if err == nil {
			fmt.Printf("peer: RDMA READ of %d bytes from 0x%x: IBV_WC_SUCCESS: %q\n", len(b), addr, b)
		}
	case "fadd":
		var old uint64
		old, err = c.FetchAdd(addr, rkey, num("ARG"))
		if err == nil {
			fmt.Printf("peer: FETCH_AND_ADD old %d\n", old)
		}
	case "cas":
		var old uint64
		old, err = c.CompareSwap(addr, rkey, num("ARG"), num("SWAP"))
		if err == nil {
			fmt.Printf("peer: CMP_AND_SWP old %d\n", old)
		}
	case "hold":
		fmt.Println("peer: connected")
		err = c.WaitDisconnect(30 * time.Second)
		if err == nil {
			fmt.Println("peer: DISCONNECTED by mrfs")
		}
	}
	var wce *rdmacm.WCError
	if errors.As(err, &wce) {
		fmt.Printf("peer: %v\n", err)
		return 3
	}
	if err != nil {
		fmt.Printf("peer: %s: %v\n", op, err)
		return 1
	}
	return 0
}

// peerCmd prepares a peer process.
func peerCmd(op, dir string, kv ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MRFS_PEER_OP="+op, "MRFS_PEER_ADDR="+listenAddr, "MRFS_PEER_DIR="+dir)
	for i := 0; i+1 < len(kv); i += 2 {
		cmd.Env = append(cmd.Env, "MRFS_PEER_"+kv[i]+"="+kv[i+1])
	}
	return cmd
}

// runPeer runs a peer to the end and returns its exit code and output.
func runPeer(t *testing.T, op, dir string, kv ...string) (int, string) {
	t.Helper()
	out, err := peerCmd(op, dir, kv...).CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run peer %s: %v", op, err)
	}
	s := strings.TrimSpace(string(out))
	t.Logf("peer %s %s (exit %d): %s", op, strings.Join(kv, " "), code, s)
	return code, s
}

// remoteMount mounts mrfs with the rdma_cm listener on rxe0's address.
func remoteMount(t testing.TB) *daemon {
	t.Helper()
	d := mountConf(t, "[remote]\nlisten = \""+listenAddr+"\"\nallow_from = [\"10.0.2.0/24\"]\n")
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(d.log.String(), "rdma_cm listening") {
		if time.Now().After(deadline) {
			t.Fatalf("no rdma_cm listener 20 s after the mount\n%s", d.log)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return d
}

// buffer makes a file of size with access and returns its iova and rkey.
func buffer(t testing.TB, path string, size int64, access string) (iova, rkey string) {
	t.Helper()
	createSized(t, path, size)
	if err := unix.Setxattr(path, "user.mrfs.access", []byte(access), 0); err != nil {
		t.Fatalf("setxattr user.mrfs.access %s on %s: %v", access, path, err)
	}
	return getxattr(t, path, "user.mrfs.addr"), getxattr(t, path, "user.mrfs.rkey")
}

func addOffset(t testing.TB, iova string, off uint64) string {
	n, err := strconv.ParseUint(iova, 0, 64)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("%#x", n+off)
}

// qpIDs are the QPs the kernel lists on rxe0 (`rdma resource show qp`),
// by local QP number.
func qpIDs(t testing.TB) map[uint64]resEntry {
	t.Helper()
	// QPs are per port: the filter is the link, not the device.
	out, err := exec.Command("rdma", "-j", "resource", "show", "qp", "link", device+"/1").Output()
	if err != nil {
		t.Fatalf("rdma -j resource show qp: %v", errText(err))
	}
	var all []resEntry
	if out = bytes.TrimSpace(out); len(out) > 0 {
		if err := json.Unmarshal(out, &all); err != nil {
			t.Fatalf("rdma -j resource show qp: bad JSON %q: %v", out, err)
		}
	}
	m := map[uint64]resEntry{}
	for _, e := range all {
		if n, ok := e.num("lqpn"); ok && n > 1 { // QP0/QP1 are the kernel's
			m[n] = e
		}
	}
	return m
}

// TestRemoteRDMA is the scenario over rdma_cm on rxe0, with peers
// in their own processes: an RDMA WRITE lands in an mrfs buffer and is
// read back through the file; READ and atomics; a WRITE without
// remote_write completes with IBV_WC_REM_ACCESS_ERR; after rm the old
// rkey fails; an unknown directory is refused; rmdir with a connected
// peer disconnects it; unmount with a connected peer is clean.
func TestRemoteRDMA(t *testing.T) {
	requireGuest(t)
	mrsBefore, pdsBefore, qpsBefore := ids(t, "mr"), ids(t, "pd"), qpIDs(t)
	d := remoteMount(t)
	pid := d.cmd.Process.Pid

	f := filepath.Join(d.dir, "rx")
	iova, rkey := buffer(t, f, 64<<10, "local_write,remote_write,remote_read,remote_atomic")
	t.Logf("rx: addr %s rkey %s", iova, rkey)

	msg := "written by an rdma_cm peer over rxe0"
	if code, out := runPeer(t, "write", "/", "IOVA", addOffset(t, iova, 4096), "RKEY", rkey, "DATA", msg); code != 0 {
		t.Fatalf("RDMA WRITE failed: %s", out)
	}
	got, err := os.ReadFile(f) // zero_copy off: read(2) through the daemon, from the memfd
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[4096:4096+len(msg)], []byte(msg)) || !bytes.Equal(got[:4096], make([]byte, 4096)) {
		t.Fatalf("the file does not hold what the peer wrote: %q", got[4096:4096+len(msg)])
	}
	t.Logf("read back through the mrfs file at offset 4096: %q", got[4096:4096+len(msg)])

	// The other way: what is written through the file, the peer READs.
	writeAt(t, f, []byte("through the file"))
	if code, out := runPeer(t, "read", "/", "IOVA", iova, "RKEY", rkey, "LEN", "16"); code != 0 || !strings.Contains(out, `"through the file"`) {
		t.Errorf("RDMA READ: exit %d, %s", code, out)
	}
	// Atomics on the first 8 bytes (the host's order).
	writeAt(t, f, make([]byte, 8))
	if code, out := runPeer(t, "fadd", "/", "IOVA", iova, "RKEY", rkey, "ARG", "5"); code != 0 || !strings.Contains(out, "old 0") {
		t.Errorf("FETCH_AND_ADD: exit %d, %s", code, out)
	}
	if code, out := runPeer(t, "cas", "/", "IOVA", iova, "RKEY", rkey, "ARG", "5", "SWAP", "42"); code != 0 || !strings.Contains(out, "old 5") {
		t.Errorf("CMP_AND_SWP: exit %d, %s", code, out)
	}
	if got, _ := os.ReadFile(f); len(got) < 8 || got[0] != 42 {
		t.Errorf("after the atomics the file starts with %v, want 42", got[:8])
	}

	// The NIC checks the region's access: no remote_write, no WRITE.
	ro := filepath.Join(d.dir, "ro")
	roIOVA, roKey := buffer(t, ro, 4096, "local_write,remote_read")
	if code, out := runPeer(t, "write", "/", "IOVA", roIOVA, "RKEY", roKey, "DATA", "x"); code != 3 || !strings.Contains(out, "IBV_WC_REM_ACCESS_ERR") {
		t.Errorf("WRITE without remote_write: exit %d, %s; want IBV_WC_REM_ACCESS_ERR", code, out)
	}
	// Out of range: past the end of the region.
	if code, out := runPeer(t, "write", "/", "IOVA", addOffset(t, roIOVA, 4096), "RKEY", roKey, "DATA", "x"); code != 3 || !strings.Contains(out, "IBV_WC_REM_ACCESS_ERR") {
		t.Errorf("WRITE past the end: exit %d, %s; want IBV_WC_REM_ACCESS_ERR", code, out)
	}

	// After rm, the old rkey is dead.
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	if code, out := runPeer(t, "write", "/", "IOVA", iova, "RKEY", rkey, "DATA", "late"); code != 3 || !strings.Contains(out, "IBV_WC_REM_ACCESS_ERR") {
		t.Errorf("WRITE with the rkey of a removed file: exit %d, %s; want IBV_WC_REM_ACCESS_ERR", code, out)
	}

	// A directory that does not exist is refused with its errno.
	if code, out := runPeer(t, "write", "nosuchdir", "IOVA", roIOVA, "RKEY", roKey, "DATA", "x"); code != 1 || !strings.Contains(out, syscall.ENOENT.Error()) {
		t.Errorf("connect to an unknown directory: exit %d, %s; want ENOENT", code, out)
	}

	// A PD's rkey does not work from another PD's QP.
	tenant := filepath.Join(d.dir, "tenant")
	if err := os.Mkdir(tenant, 0o755); err != nil {
		t.Fatal(err)
	}
	if code, out := runPeer(t, "read", "tenant", "IOVA", roIOVA, "RKEY", roKey, "LEN", "8"); code != 3 || !strings.Contains(out, "IBV_WC_REM_ACCESS_ERR") {
		t.Errorf("READ of a root buffer from tenant's QP: exit %d, %s; want IBV_WC_REM_ACCESS_ERR", code, out)
	}

	// rmdir with a connected peer: mrfs disconnects it and destroys the QP
	// before the PD.
	hold := holdPeer(t, "tenant")
	if err := os.Remove(tenant); err != nil {
		t.Fatalf("rmdir of a directory with a connected peer: %v", err)
	}
	hold.wait(t)
	for n, e := range qpIDs(t) {
		if _, ok := qpsBefore[n]; !ok {
			t.Errorf("a QP is left after rmdir with the only peer gone: %v", e)
		}
	}

	// Unmount with a connected peer.
	hold = holdPeer(t, "/")
	if err := d.stop(t); err != nil {
		t.Errorf("mrfs exited with %v after SIGINT, want 0", err)
	}
	hold.wait(t)
	log := d.log.String()
	if !strings.Contains(log, "closed_connections=1") || !strings.Contains(log, "teardown complete") {
		t.Errorf("mrfs did not report closing 1 connection and a complete teardown")
	}
	for _, kind := range []string{"mr", "pd"} {
		before := map[string]snapshot{"mr": mrsBefore, "pd": pdsBefore}[kind]
		if left := newSince(t, kind, before, pid); len(left) != 0 {
			t.Errorf("%s left after unmount: %v", kind, left)
		}
	}
	for n, e := range qpIDs(t) {
		if _, ok := qpsBefore[n]; !ok {
			t.Errorf("QP left after unmount: %v", e)
		}
	}
}

// writeAt writes b at offset 0 of path without truncating it: O_TRUNC
// would make the buffer re-register with new keys.
func writeAt(t *testing.T, path string, b []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, 0); err != nil {
		t.Fatal(err)
	}
}

type heldPeer struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan error
}

// holdPeer starts a peer that connects to dir and waits for mrfs to
// disconnect it; it returns once the peer is connected.
func holdPeer(t *testing.T, dir string) *heldPeer {
	t.Helper()
	p := &heldPeer{cmd: peerCmd("hold", dir), out: new(syncBuffer), done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(p.out.String(), "peer: connected") {
		select {
		case err := <-p.done:
			t.Fatalf("holding peer exited before connecting: %v: %s", err, p.out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("holding peer did not connect: %s", p.out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return p
}

func (p *heldPeer) wait(t *testing.T) {
	t.Helper()
	select {
	case err := <-p.done:
		t.Logf("holding peer: %s", strings.TrimSpace(p.out.String()))
		if err != nil || !strings.Contains(p.out.String(), "DISCONNECTED by mrfs") {
			t.Errorf("holding peer was not disconnected: %v: %s", err, p.out)
		}
	case <-time.After(30 * time.Second):
		p.cmd.Process.Kill()
		t.Errorf("holding peer still connected 30 s later: %s", p.out)
	}
}
