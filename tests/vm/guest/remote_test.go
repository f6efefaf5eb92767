//go:build rdma

package guest

import (
	"bytes"
	"encoding/json"
	"flag"
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

	"mrfs/remote"
	"mrfs/remote/rdmacm"
)

// listenAddr is where the daemon's rdma_cm listener binds: eth0's
// address, the one rxe0 carries, and port 0: the test finds the port in
// user.mrfs.remote, as a script would.
const listenAddr = "10.0.2.15:0"

// The peers that hold a connection are this test binary run again as
// another process (TestMain): MRFS_PEER_OP=hold or serve, MRFS_PEER_ADDR
// and MRFS_PEER_DIR where (MRFS_PEER_BUFSIZE: the connection's buffer,
// if not the default). This process itself never connects through
// rxe1: see deleteRxe1. The one-shot peers are the rdma build's own
// `mrfs remote` (cliPeer).
func TestMain(m *testing.M) {
	if op := os.Getenv("MRFS_PEER_OP"); op != "" {
		os.Exit(peerMain(op))
	}
	flag.Parse()
	watchTimeout()
	os.Exit(m.Run())
}

// peerMain connects to the daemon over rdma_cm, printing "peer: ..."
// lines. hold waits for mrfs to disconnect it (exit 0 when it did);
// serve runs the operations its standard input names on that one queue
// pair (servePeer).
func peerMain(op string) int {
	env := func(k string) string { return os.Getenv("MRFS_PEER_" + k) }
	if op != "hold" && op != "serve" {
		fmt.Printf("peer: unknown operation %q\n", op)
		return 1
	}
	tok, err := remote.ParseToken(env("TOKEN"))
	if err != nil {
		fmt.Printf("peer: %v\n", err)
		return 1
	}
	bufSize, _ := strconv.Atoi(env("BUFSIZE"))
	c, err := rdmacm.Dial(env("ADDR"), env("DIR"), rdmacm.DialOptions{Timeout: 20 * time.Second, Token: tok, BufSize: bufSize})
	if err != nil {
		fmt.Printf("peer: dial: %v\n", err)
		return 1
	}
	defer c.Close()
	fmt.Println("peer: connected")
	if op == "serve" {
		return serve(c, os.Stdin, os.Stdout)
	}
	if err := c.WaitDisconnect(30 * time.Second); err != nil {
		fmt.Printf("peer: %s: %v\n", op, err)
		return 1
	}
	fmt.Println("peer: DISCONNECTED by mrfs")
	return 0
}

// cliPeer runs script with /bin/sh in its own process: the
// issue's form of a peer, `mrfs remote ... --peer $PEER --addr $(getfattr
// ...)`, with the rdma build's mrfs as $MRFS, the daemon's address as
// $PEER (taken from user.mrfs.remote of the mount root $MNT), `tok DIR`
// the token of a directory (zeros for none) and kv as more variables. It returns the exit code and the output.
func cliPeer(t *testing.T, d *remoteDaemon, script string, kv ...string) (int, string) {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", `set -- $(getfattr --absolute-names --only-values -n user.mrfs.remote "$MNT"); PEER=$2
tok() { getfattr --absolute-names --only-values -n user.mrfs.token "$MNT/${1#/}" 2>/dev/null || echo 00000000000000000000000000000000; }
`+script)
	cmd.Env = append(os.Environ(), "MRFS="+mrfsBin(), "MNT="+d.dir)
	for i := 0; i+1 < len(kv); i += 2 {
		cmd.Env = append(cmd.Env, kv[i]+"="+kv[i+1])
	}
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run %q: %v", script, err)
	}
	s := strings.TrimSpace(string(out))
	t.Logf("cli peer %s [%s] (exit %d): %s", strings.TrimSpace(script), strings.Join(kv, " "), code, s)
	return code, s
}

// remoteDaemon is a mount with the rdma_cm listener, and the address it
// is bound to.
type remoteDaemon struct {
	*daemon
	peer string // 10.0.2.15:PORT, from user.mrfs.remote
}

// remoteMount mounts mrfs with the rdma_cm listener on rxe0's address
// and port 0, and reads the port it got from user.mrfs.remote.
func remoteMount(t testing.TB) *remoteDaemon { t.Helper(); return remoteMountConf(t, "") }

// remoteMountConf is remoteMount with more config.toml tables.
func remoteMountConf(t testing.TB, extra string) *remoteDaemon {
	t.Helper()
	d := mountConf(t, "[remote]\nlisten = \""+listenAddr+"\"\nallow_from = [\"10.0.2.0/24\"]\n\n"+extra)
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(d.log.String(), "rdma_cm listening") {
		if time.Now().After(deadline) {
			t.Fatalf("no rdma_cm listener 20 s after the mount\n%s", d.log)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The xattr is set once the listener is bound: "rdma_cm HOST:PORT /".
	var where string
	for {
		where = getxattr(t, d.dir, "user.mrfs.remote")
		if where != "off" || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	f := strings.SplitN(where, " ", 3)
	if len(f) != 3 || f[0] != "rdma_cm" || f[2] != "/" || !strings.HasPrefix(f[1], "10.0.2.15:") || strings.HasSuffix(f[1], ":0") {
		t.Fatalf("user.mrfs.remote of the root is %q, want \"rdma_cm 10.0.2.15:PORT /\" with the bound port", where)
	}
	t.Logf("user.mrfs.remote: %q", where)
	return &remoteDaemon{daemon: d, peer: f[1]}
}

// tokenHex is the user.mrfs.token of dir in d's mount.
func (d *remoteDaemon) tokenHex(t testing.TB, dir string) string {
	t.Helper()
	return getxattr(t, filepath.Join(d.dir, dir), "user.mrfs.token")
}

// token is tokenHex parsed.
func (d *remoteDaemon) token(t testing.TB, dir string) remote.Token {
	t.Helper()
	tok, err := remote.ParseToken(d.tokenHex(t, dir))
	if err != nil {
		t.Fatal(err)
	}
	return tok
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

// The script form of a peer: the rdma build's `mrfs remote`,
// rdma_cm by default, with the keys read from the xattrs of $F.
const (
	cliKeys  = `addr=$(getfattr --absolute-names --only-values -n user.mrfs.addr "$F"); rkey=$(getfattr --absolute-names --only-values -n user.mrfs.rkey "$F")` + "\n"
	cliWrite = cliKeys + `MRFS_TOKEN="$(tok "$PD")" "$MRFS" remote write --peer "$PEER" --pd "$PD" --addr $((addr + ${OFF:-0})) --rkey "$rkey" < "$DATA"`
)

// TestRemoteRDMA is the scenario over rdma_cm on rxe0, with peers
// in their own processes (`mrfs remote` of the rdma build): an RDMA WRITE
// lands in an mrfs buffer and is read back through the file; READ and
// atomics; a WRITE without remote_write completes with
// IBV_WC_REM_ACCESS_ERR; after rm the old rkey fails; an unknown
// directory is refused; rmdir with a connected peer disconnects it;
// unmount with a connected peer is clean.
func TestRemoteRDMA(t *testing.T) {
	requireGuest(t)
	mrsBefore, pdsBefore, qpsBefore := ids(t, "mr"), ids(t, "pd"), qpIDs(t)
	d := remoteMount(t)
	pid := d.cmd.Process.Pid

	f := filepath.Join(d.dir, "rx")
	iova, rkey := buffer(t, f, 64<<10, "local_write,remote_write,remote_read,remote_atomic")
	t.Logf("rx: addr %s rkey %s", iova, rkey)

	msg := "written by mrfs remote over rdma_cm on rxe0"
	data := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(data, []byte(msg), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, out := cliPeer(t, d, cliWrite, "F", f, "PD", "/", "OFF", "4096", "DATA", data); code != 0 || out != "" {
		t.Fatalf("mrfs remote write: exit %d: %s", code, out)
	}
	got, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[4096:4096+len(msg)], []byte(msg)) || !bytes.Equal(got[:4096], make([]byte, 4096)) {
		t.Fatalf("the file does not hold what the peer wrote: %q", got[4096:4096+len(msg)])
	}
	t.Logf("mrfs remote write over rdma_cm landed: read back through the mrfs file at offset 4096: %q", got[4096:4096+len(msg)])

	// The other way: what is written through the file, the peer READs.
	writeAt(t, f, []byte("through the file"))
	if code, out := cliPeer(t, d, cliKeys+`MRFS_TOKEN="$(tok /)" "$MRFS" remote read --peer "$PEER" --pd / --addr "$addr" --rkey "$rkey" --length 16`, "F", f); code != 0 || out != "through the file" {
		t.Errorf("mrfs remote read: exit %d, %q", code, out)
	}
	// Atomics on the first 8 bytes (the host's order); old values in hex.
	writeAt(t, f, make([]byte, 8))
	atomics := cliKeys + `for a in 5 0x10; do MRFS_TOKEN="$(tok /)" "$MRFS" remote fadd --peer "$PEER" --pd / --addr "$addr" --rkey "$rkey" --add $a || exit; done
MRFS_TOKEN="$(tok /)" "$MRFS" remote cas --peer "$PEER" --pd / --addr "$addr" --rkey "$rkey" --compare 21 --swap 0x2a`
	if code, out := cliPeer(t, d, atomics, "F", f); code != 0 || out != "0x0\n0x5\n0x15" {
		t.Errorf("mrfs remote fadd, fadd, cas: exit %d, %q; want 0x0 0x5 0x15", code, out)
	}
	if got, _ := os.ReadFile(f); len(got) < 8 || got[0] != 42 {
		t.Errorf("after the atomics the file starts with %v, want 42", got[:8])
	}

	// The NIC checks the region's access: no remote_write, no WRITE.
	ro := filepath.Join(d.dir, "ro")
	buffer(t, ro, 4096, "local_write,remote_read")
	accessErr := func(what string, code int, out string) {
		t.Helper()
		if code != 1 || !strings.HasPrefix(out, "mrfs: IBV_WC_REM_ACCESS_ERR: ") {
			t.Errorf("%s: exit %d, %s; want exit 1 and IBV_WC_REM_ACCESS_ERR", what, code, out)
		}
	}
	code, out := cliPeer(t, d, cliWrite, "F", ro, "PD", "/", "DATA", data)
	accessErr("mrfs remote write without remote_write", code, out)
	// Out of range: past the end of the region.
	code, out = cliPeer(t, d, cliWrite, "F", ro, "PD", "/", "OFF", "4096", "DATA", data)
	accessErr("mrfs remote write past the end", code, out)

	// After rm, the old rkey is dead.
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	code, out = cliPeer(t, d, `MRFS_TOKEN="$(tok /)" "$MRFS" remote write --peer "$PEER" --pd / --addr $IOVA --rkey $RKEY < "$DATA"`, "IOVA", iova, "RKEY", rkey, "DATA", data)
	accessErr("mrfs remote write with the rkey of a removed file", code, out)

	// A directory that does not exist is refused with its errno.
	if code, out := cliPeer(t, d, cliWrite, "F", ro, "PD", "nosuchdir", "DATA", data); code != 1 || !strings.Contains(out, syscall.ENOENT.Error()) {
		t.Errorf("connect to an unknown directory: exit %d, %s; want ENOENT", code, out)
	}

	// A PD's rkey does not work from another PD's QP.
	tenant := filepath.Join(d.dir, "tenant")
	if err := os.Mkdir(tenant, 0o755); err != nil {
		t.Fatal(err)
	}
	code, out = cliPeer(t, d, cliKeys+`MRFS_TOKEN="$(tok tenant)" "$MRFS" remote read --peer "$PEER" --pd tenant --addr "$addr" --rkey "$rkey" --length 8`, "F", ro)
	accessErr("mrfs remote read of a root buffer from tenant's QP", code, out)
	// And the soft protocol's client is still in the rdma build, on
	// request: this daemon serves rdma_cm only, so nothing answers it.
	if code, out := cliPeer(t, d, cliKeys+`MRFS_TOKEN="$(tok /)" "$MRFS" remote read --transport tcp --timeout 3s --peer "$PEER" --pd / --addr "$addr" --rkey "$rkey" --length 8`, "F", ro); code != 1 || !strings.Contains(out, "over tcp") {
		t.Errorf("mrfs remote --transport tcp against an rdma_cm daemon: exit %d, %s; want a failure over tcp", code, out)
	}

	// rmdir with a connected peer: mrfs disconnects it and destroys the QP
	// before the PD.
	hold := holdPeer(t, d, "tenant")
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
	hold = holdPeer(t, d, "/")
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
func holdPeer(t *testing.T, d *remoteDaemon, dir string) *heldPeer {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MRFS_PEER_OP=hold", "MRFS_PEER_ADDR="+d.peer, "MRFS_PEER_DIR="+dir, "MRFS_PEER_TOKEN="+d.tokenHex(t, dir))
	p := &heldPeer{cmd: cmd, out: new(syncBuffer), done: make(chan error, 1)}
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
