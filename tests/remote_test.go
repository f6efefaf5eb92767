package tests

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/remote"
	"mrfs/remote/client"
	"mrfs/remote/proto"
	"mrfs/verbs"
)

const (
	xRemote = "user.mrfs.remote"
	xToken  = "user.mrfs.token"
)

// remoteConfig listens on a free port of the backend's peer address
// (loopback for the soft transport); the test finds it in
// user.mrfs.remote.
func remoteConfig() string {
	return backend.listen() + `timeout = "500ms"
max_message_size = "2MiB"`
}

const allRemote = "local_write,remote_write,remote_read,remote_atomic"

// startRemote mounts with remote access on and returns the peer address.
func startRemote(t *testing.T) (*daemon, string) {
	t.Helper()
	return startRemoteConf(t, remoteConfig())
}

// startRemoteConf is startRemote with another [remote] table, which must
// start with backend.listen().
func startRemoteConf(t *testing.T, conf string) (*daemon, string) {
	t.Helper()
	d := startDaemon(t, daemonConfig{Remote: conf})
	return d, d.remotePeer(t)
}

// remotePeer is the address peers reach d at (user.mrfs.remote of the
// root), which dial then knows d's tokens by.
func (d *daemon) remotePeer(t *testing.T) string {
	t.Helper()
	v := mustXattr(t, d.mnt, xRemote)
	f := strings.SplitN(v, " ", 3)
	if len(f) != 3 || f[0] != backend.transport || f[2] != "/" || !strings.HasPrefix(f[1], backend.host+":") || strings.HasSuffix(f[1], ":0") {
		t.Fatalf("%s of the root = %q, want \"%s %s:PORT /\"", xRemote, v, backend.transport, backend.host)
	}
	remoteMounts.Store(f[1], d.mnt)
	t.Cleanup(func() { remoteMounts.Delete(f[1]) })
	return f[1]
}

// remoteBuf creates a file of size bytes with access and returns its
// (addr, rkey).
func remoteBuf(t *testing.T, path string, size int, access string) (uint64, uint32) {
	t.Helper()
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, int64(size)); err != nil {
		t.Fatal(err)
	}
	mustSetxattr(t, path, xAccess, access)
	return keysOf(t, path)
}

func keysOf(t *testing.T, path string) (uint64, uint32) {
	t.Helper()
	a, err := strconv.ParseUint(mustXattr(t, path, xAddr), 0, 64)
	if err != nil {
		t.Fatal(err)
	}
	k, err := strconv.ParseUint(mustXattr(t, path, xRkey), 0, 32)
	if err != nil {
		t.Fatal(err)
	}
	return a, uint32(k)
}

func dialPD(t *testing.T, peer, dir string) remote.Conn {
	t.Helper()
	c, err := dial(peer, dir)
	if err != nil {
		t.Fatalf("dial %s pd %s: %v", peer, dir, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// dial connects to dir of the daemon at peer over the backend's
// transport (the soft protocol's client, or an rdma_cm queue pair),
// presenting the directory's token.
func dial(peer, dir string) (remote.Conn, error) {
	tok, err := tokenOf(peer, dir)
	if err != nil {
		tok = remote.Token{} // a directory that is not there
	}
	return dialToken(peer, dir, tok)
}

// dialToken is dial presenting tok.
func dialToken(peer, dir string, tok remote.Token) (remote.Conn, error) {
	// Scaled: under emulation the whole test binary can stall for
	// seconds (dozens of tests share two emulated CPUs).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second*slowFactor())
	defer cancel()
	if !backend.soft() {
		return dialRDMA(ctx, peer, dir, tok)
	}
	c, err := client.Dial(ctx, peer, dir, tok)
	if err != nil {
		return nil, err
	}
	c.SetDeadline(time.Now().Add(cmdTimeout))
	return c, nil
}

// remoteCLI is `mrfs remote OP` naming the PD by d's root where it is
// mounted here: the peer, the transport and the token are those its
// user.mrfs.remote and user.mrfs.token say.
func remoteCLI(d *daemon, op string) string { return "mrfs remote " + op + " --pd " + d.mnt }

// remoteMounts are the mounts with remote access of this test binary, by
// the address peers reach them at: dial reads tokens there.
var remoteMounts sync.Map // string (host:port) -> string (mount point)

// tokenOf is the token of dir in the mount at peer.
func tokenOf(peer, dir string) (remote.Token, error) {
	mnt, ok := remoteMounts.Load(peer)
	if !ok {
		return remote.Token{}, fmt.Errorf("no mount of this test serves %s", peer)
	}
	v, err := getxattr(filepath.Join(mnt.(string), dir), xToken)
	if err != nil {
		return remote.Token{}, err
	}
	return remote.ParseToken(v)
}

// The script, through the CLI: a WRITE lands and is seen at once
// through a mapping made before it and through cat; a READ returns what a
// local process wrote; CAS and FADD on aligned words; misaligned is
// REM_INV_REQ_ERR with exit 1.
func TestRemoteShell(t *testing.T) {
	d, peer := startRemote(t)
	rx := d.path("rx")
	remoteBuf(t, rx, 4096, allRemote)
	fh, err := os.OpenFile(rx, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	m, err := unix.Mmap(int(fh.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer munmap(m)

	script := fmt.Sprintf(`
f=%s; m=%s; tf=%s
set -- $(getfattr --only-values -n user.mrfs.remote $m); tr=$1 peer=$2
tok=$(getfattr --only-values -n user.mrfs.token $m)
addr=$(getfattr --only-values -n user.mrfs.addr $f)
rkey=$(getfattr --only-values -n user.mrfs.rkey $f)
printf 'hello from afar' | MRFS_TOKEN=$tok mrfs remote write --transport $tr --peer $peer --pd / --addr $addr --rkey $rkey
head -c 15 $f; echo
printf 'written locally' | dd of=$f bs=1 seek=100 conv=notrunc status=none
echo $tok > $tf
mrfs remote read --transport $tr --peer $peer --pd / --token-file $tf --addr $((addr + 100)) --rkey $rkey --length 15; echo
# The directory where it is mounted here names the peer, transport and token.
mrfs remote fadd --pd $m --addr $((addr + 1024)) --rkey $rkey --add 5
mrfs remote fadd --pd $m --addr $((addr + 1024)) --rkey $rkey --add 0x10
mrfs remote cas --pd $m --addr $((addr + 1024)) --rkey $rkey --compare 21 --swap 0xabc
mrfs remote cas --pd $m --addr $((addr + 1024)) --rkey $rkey --compare 21 --swap 7
`, rx, d.mnt, filepath.Join(t.TempDir(), "token"))
	out := mustSh(t, script)
	want := "hello from afar\nwritten locally\n0x0\n0x5\n0x15\n0xabc\n"
	if out != want {
		t.Errorf("script output:\n%s\nwant:\n%s", out, want)
	}
	if string(m[:15]) != "hello from afar" {
		t.Errorf("the mapping sees %q", m[:15])
	}
	if v := binary.NativeEndian.Uint64(m[1024:]); v != 0xabc {
		t.Errorf("the word at 1024 through the mapping = %#x, want 0xabc", v)
	}
	// A remote WRITE while the mapping is held is visible at once.
	c := dialPD(t, peer, "/")
	addr, rkey := keysOf(t, rx)
	if err := c.Write(addr+2000, rkey, []byte("now")); err != nil {
		t.Fatal(err)
	}
	if string(m[2000:2003]) != "now" {
		t.Errorf("mapping after WRITE: %q", m[2000:2003])
	}

	_, errOut, err := sh(t, fmt.Sprintf(remoteCLI(d, "fadd")+" --addr %d --rkey %d --add 1", addr+1028, rkey))
	misaligned := "IBV_WC_REM_INV_REQ_ERR"
	if !backend.soft() {
		backend.differs(t, "librxe refuses a misaligned atomic when it is posted: EINVAL, nothing sent")
		misaligned = unix.EINVAL.Error()
	}
	if exitCode(err) != 1 || !strings.Contains(errOut, misaligned) {
		t.Errorf("misaligned fadd: exit %d, stderr %q; want 1 and %s", exitCode(err), errOut, misaligned)
	}
	_, errOut, err = sh(t, fmt.Sprintf(remoteCLI(d, "read")+" --addr %d --rkey %d --length 1", addr+4096, rkey))
	if exitCode(err) != 1 || !strings.Contains(errOut, "IBV_WC_REM_ACCESS_ERR") {
		t.Errorf("read past the end: exit %d, stderr %q; want 1 and IBV_WC_REM_ACCESS_ERR", exitCode(err), errOut)
	}
}

// Every violation is REM_ACCESS_ERR (misaligned atomics REM_INV_REQ_ERR)
// and changes no byte of any buffer.
func TestRemoteViolations(t *testing.T) {
	d, peer := startRemote(t)
	full := d.path("full")
	faddr, fkey := remoteBuf(t, full, 8192, allRemote)
	ro := d.path("ro")
	roAddr, roKey := remoteBuf(t, ro, 4096, "remote_read")
	wo := d.path("wo")
	woAddr, woKey := remoteBuf(t, wo, 4096, "local_write,remote_write")
	if err := os.Mkdir(d.path("other"), 0o755); err != nil {
		t.Fatal(err)
	}
	other := d.path("other", "buf")
	oAddr, oKey := remoteBuf(t, other, 4096, allRemote)
	gone := d.path("gone")
	gAddr, gKey := remoteBuf(t, gone, 4096, allRemote)
	if err := os.Remove(gone); err != nil {
		t.Fatal(err)
	}
	changed := d.path("changed")
	cAddr, cKey := remoteBuf(t, changed, 4096, allRemote)
	mustSetxattr(t, changed, xAccess, "local_write,remote_write,remote_read")
	resized := d.path("resized")
	rAddr, rKey := remoteBuf(t, resized, 4096, allRemote)
	if err := os.Truncate(resized, 8192); err != nil {
		t.Fatal(err)
	}
	if a, k := keysOf(t, changed); k == cKey && a == cAddr {
		t.Fatal("access change kept the keys")
	}
	files := []string{full, ro, wo, other, changed, resized}
	for _, f := range files {
		data := bytes.Repeat([]byte{0xa5}, 4096)
		if fh, err := os.OpenFile(f, os.O_WRONLY, 0); err == nil {
			fh.WriteAt(data, 0)
			fh.Close()
		}
	}
	x := []byte("XXXXXXXX")
	rd := func(c remote.Conn, a uint64, k uint32) error { return c.Read(make([]byte, 8), a, k) }
	fadd := func(c remote.Conn, a uint64, k uint32) error { _, err := c.FetchAdd(a, k, 1); return err }
	cas := func(c remote.Conn, a uint64, k uint32) error { _, err := c.CompareSwap(a, k, 0, 1); return err }
	wr := func(c remote.Conn, a uint64, k uint32) error { return c.Write(a, k, x) }
	for _, tc := range []struct {
		name string
		op   func(remote.Conn, uint64, uint32) error
		addr uint64
		key  uint32
		want verbs.WCStatus
	}{
		{"wrong rkey", wr, faddr, fkey ^ 0x5a, verbs.WCRemAccessErr},
		{"range past the end", wr, faddr + 8190, fkey, verbs.WCRemAccessErr},
		{"before the start", rd, faddr - 8, fkey, verbs.WCRemAccessErr},
		{"WRITE without remote_write", wr, roAddr, roKey, verbs.WCRemAccessErr},
		{"READ without remote_read", rd, woAddr, woKey, verbs.WCRemAccessErr},
		{"atomic without remote_atomic", fadd, woAddr, woKey, verbs.WCRemAccessErr},
		{"buffer of another PD", wr, oAddr, oKey, verbs.WCRemAccessErr},
		{"rkey after rm", wr, gAddr, gKey, verbs.WCRemAccessErr},
		{"old rkey after an access change", wr, cAddr, cKey, verbs.WCRemAccessErr},
		{"old rkey after a resize", wr, rAddr, rKey, verbs.WCRemAccessErr},
		{"misaligned CAS", cas, faddr + 4, fkey, verbs.WCRemInvReqErr},
		{"misaligned FADD", fadd, faddr + 9, fkey, verbs.WCRemInvReqErr},
	} {
		before := map[string][]byte{}
		for _, f := range files {
			before[f], _ = os.ReadFile(f)
		}
		c := dialPD(t, peer, "/") // a fresh QP: the last one is in error
		err := tc.op(c, tc.addr, tc.key)
		if tc.want == verbs.WCRemInvReqErr && !backend.soft() {
			backend.differs(t, tc.name+": the requester's provider (librxe) refuses a misaligned atomic when it is posted, with EINVAL: nothing is sent, and the QP stays usable")
			if !errors.Is(err, unix.EINVAL) {
				t.Errorf("%s: %v, want the post refused with EINVAL", tc.name, err)
			}
			for _, f := range files {
				if after, _ := os.ReadFile(f); !bytes.Equal(before[f], after) {
					t.Errorf("%s: %s changed", tc.name, f)
				}
			}
			if err := c.Write(faddr, fkey, x); err != nil {
				t.Errorf("%s: the next WRITE: %v, want success on the QP that sent nothing", tc.name, err)
			}
			continue
		}
		if got := remote.Status(err); got != tc.want {
			t.Errorf("%s: %v (%v), want %v", tc.name, got, err, tc.want)
		}
		// The QP is now in error: even a valid operation is flushed.
		if err := c.Write(faddr, fkey, x); remote.Status(err) != verbs.WCWRFlushErr {
			t.Errorf("%s: the next WRITE: %v, want IBV_WC_WR_FLUSH_ERR", tc.name, err)
		}
		for _, f := range files {
			if after, _ := os.ReadFile(f); !bytes.Equal(before[f], after) {
				t.Errorf("%s: %s changed", tc.name, f)
			}
		}
	}
	// The refused peers did not hurt the daemon.
	c := dialPD(t, peer, "/other")
	if err := c.Write(oAddr, oKey, x); err != nil {
		t.Errorf("WRITE in its own PD: %v", err)
	}
}

// Concurrent peers on several PDs: FADDs from many connections add up.
func TestRemoteConcurrentPDs(t *testing.T) {
	d, peer := startRemote(t)
	const pds, peersPer, adds = 3, 4, 200
	type target struct {
		dir  string
		addr uint64
		key  uint32
	}
	var targets []target
	for i := range pds {
		dir := fmt.Sprintf("/t%d", i)
		if err := os.Mkdir(d.path(dir), 0o755); err != nil {
			t.Fatal(err)
		}
		a, k := remoteBuf(t, d.path(dir, "ctr"), 4096, allRemote)
		targets = append(targets, target{dir, a, k})
	}
	var wg sync.WaitGroup
	for _, tg := range targets {
		for range peersPer {
			c := dialPD(t, peer, tg.dir)
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range adds {
					if _, err := c.FetchAdd(tg.addr, tg.key, 1); err != nil {
						t.Errorf("%s: %v", tg.dir, err)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	for _, tg := range targets {
		b, err := os.ReadFile(d.path(tg.dir, "ctr"))
		if err != nil {
			t.Fatal(err)
		}
		if v := binary.NativeEndian.Uint64(b); v != peersPer*adds {
			t.Errorf("%s: counter = %d, want %d", tg.dir, v, peersPer*adds)
		}
	}
}

// Hostile peers end only their own connection; a good peer keeps working
// and the daemon keeps serving. Each hostile peer also sends a WRITE, to
// bytes the good peer never writes: a daemon that accepted what it must
// refuse would execute it, and those bytes must never change.
func TestRemoteHostilePeers(t *testing.T) {
	d, peer := startRemote(t)
	if !backend.soft() {
		// Over rdma_cm the port is an RDMA CM service: no TCP byte stream
		// to garble, and the hostile rdma_cm peers (no hello, a bad
		// version) are TestAdmissionRDMACM's, in tests/vm/guest.
		backend.differs(t, "peers reach mrfs only through rdma_cm: nothing accepts TCP at "+peer)
		if nc, err := net.DialTimeout("tcp", peer, 5*time.Second); err == nil {
			nc.Close()
			t.Fatalf("a TCP connection to %s was accepted: the rdma_cm daemon serves the soft protocol too", peer)
		} else if !errors.Is(err, unix.ECONNREFUSED) {
			t.Fatalf("TCP to %s: %v, want ECONNREFUSED", peer, err)
		}
		return
	}
	f := d.path("buf")
	addr, key := remoteBuf(t, f, 4096, allRemote)
	const evilOff = 2048
	good := dialPD(t, peer, "/")
	tok, err := tokenOf(peer, "/")
	if err != nil {
		t.Fatal(err)
	}
	hello, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: proto.Version, Path: "/", Token: tok})
	badVersion, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: proto.Version + 1, Path: "/", Token: tok})
	write, _ := proto.Append(nil, proto.Frame{Type: proto.TypeWrite, IOVA: addr + evilOff, RKey: key, Data: []byte("evil")})
	huge := append([]byte{byte(proto.TypeWrite), 0, 0, 0, 0xff, 0xff, 0xff, 0xf0}, make([]byte, 8)...)
	unknown := append([]byte{0x66, 0, 0, 0, 0, 0, 0, 0}, make([]byte, 8)...)
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	for _, c := range []struct {
		name    string
		send    []byte
		trickle []byte // sent one byte per 200ms after send
	}{
		{"garbage instead of a hello", cat([]byte("\x00\x01\x02 not mrfs at all"), write), nil},
		{"bad version", cat(badVersion, write), nil},
		{"truncated frame", cat(hello, write[:len(write)-3]), nil},
		{"oversized length", cat(hello, huge, write), nil},
		{"unknown op", cat(hello, unknown, write), nil},
		{"slowloris hello", nil, cat(hello, write)},
		{"slowloris frame", hello, write},
	} {
		nc, err := net.Dial("tcp", peer)
		if err != nil {
			t.Fatal(err)
		}
		nc.Write(c.send)
		stop := make(chan struct{})
		go func() {
			for _, b := range c.trickle {
				select {
				case <-stop:
					return
				case <-time.After(200 * time.Millisecond):
				}
				if _, err := nc.Write([]byte{b}); err != nil {
					return
				}
			}
		}()
		nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		start := time.Now()
		_, err = io.Copy(io.Discard, nc)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Errorf("%s: the daemon kept the connection open for 10s", c.name)
		}
		close(stop)
		nc.Close()
		t.Logf("%s: closed by the daemon after %v", c.name, time.Since(start).Round(10*time.Millisecond))
		if err := good.Write(addr, key, []byte("good")); err != nil {
			t.Fatalf("after %s: the good peer failed: %v", c.name, err)
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(b, []byte("good")) {
			t.Errorf("after %s: buffer = %q, want the good peer's bytes", c.name, b[:8])
		}
		if !bytes.Equal(b[evilOff:evilOff+4], make([]byte, 4)) {
			t.Fatalf("after %s: the hostile peer's WRITE landed: %q at %d", c.name, b[evilOff:evilOff+4], evilOff)
		}
	}
	if d.exited() {
		t.Fatal("the daemon exited")
	}
}

// Off by default; rmdir ends the PD's connections; unmount ends all.
func TestRemoteOffAndRmdir(t *testing.T) {
	off := startDaemon(t, daemonConfig{})
	if v := mustXattr(t, off.mnt, xRemote); v != "off" {
		t.Errorf("%s without remote.listen = %q, want off", xRemote, v)
	}

	d, peer := startRemote(t)
	if err := os.Mkdir(d.path("tenant"), 0o755); err != nil {
		t.Fatal(err)
	}
	if v := mustXattr(t, d.path("tenant"), xRemote); v != backend.transport+" "+peer+" /tenant" {
		t.Errorf("%s of /tenant = %q", xRemote, v)
	}
	c := dialPD(t, peer, "/tenant")
	if err := os.Remove(d.path("tenant")); err != nil {
		t.Fatal(err)
	}
	if err := c.Write(0, 0, nil); err == nil {
		t.Error("a connection to a removed PD still answers")
	}
	if _, err := dial(peer, "/tenant"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("dial of a removed directory: %v, want ENOENT", err)
	}
	root := dialPD(t, peer, "/")
	if code := d.stop(unix.SIGINT); code != 0 {
		t.Fatalf("daemon exit %d", code)
	}
	if err := root.Write(0, 0, nil); err == nil {
		t.Error("a connection survived the unmount")
	}
}

// TestRemoteTokens: every directory has its own read-only token; a peer
// must present its directory's to get a queue pair (EACCES otherwise,
// also with another directory's), and a source that keeps presenting
// wrong ones is refused for a while, even with the right one, with one
// warn line.
func TestRemoteTokens(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{
		Mount:  "umask = \"022\"",
		Remote: fmt.Sprintf("listen = \"%s:0\"\nallow_from = %s\nmax_failures = 3\n", backend.host, backend.allowFrom),
	})
	peer := d.remotePeer(t)
	if err := os.Mkdir(d.path("open"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(d.path("closed"), 0o700); err != nil {
		t.Fatal(err)
	}
	toks := map[string]string{}
	for _, dir := range []string{"", "open", "closed"} {
		v := mustXattr(t, d.path(dir), xToken)
		if !regexp.MustCompile(`^[0-9a-f]{32}$`).MatchString(v) {
			t.Fatalf("token of %q = %q, want 32 hex digits", dir, v)
		}
		if again := mustXattr(t, d.path(dir), xToken); again != v {
			t.Errorf("token of %q changed between reads: %s, %s", dir, v, again)
		}
		for other, tok := range toks {
			if tok == v {
				t.Errorf("%q and %q share a token", dir, other)
			}
		}
		toks[dir] = v
	}
	wantErrno(t, setxattr(d.path("open"), xToken, "00112233445566778899aabbccddeeff"), unix.EPERM, "set user.mrfs.token")
	// Who else may read a token: TestTokenReaders.

	// The right token admits; a wrong one, or another directory's, is
	// refused before any queue pair exists.
	c := dialPD(t, peer, "/open")
	c.Close()
	wrong, _ := remote.ParseToken(toks["closed"])
	for _, tok := range []remote.Token{wrong, {}} {
		if c, err := dialToken(peer, "/open", tok); err == nil {
			c.Close()
			t.Fatalf("admitted to /open with token %x", tok)
		} else if !errors.Is(err, unix.EACCES) || !strings.Contains(err.Error(), "wrong token") {
			t.Errorf("a wrong token: %v, want EACCES, wrong token", err)
		}
	}
	// Two failures so far; the third, by the CLI, gets the source
	// refused, even with the right token, and the log says so once.
	if _, errOut, err := sh(t, "MRFS_TOKEN="+toks["closed"]+" "+remoteCLI(d, "read")+" --addr 0 --rkey 0 --length 1"); exitCode(err) != 1 || !strings.Contains(errOut, "wrong token") {
		t.Errorf("mrfs remote with a wrong MRFS_TOKEN: exit %d, %q; want 1 and wrong token", exitCode(err), errOut)
	}
	right, _ := remote.ParseToken(toks["open"])
	if c, err := dialToken(peer, "/open", right); err == nil {
		c.Close()
		t.Errorf("after 3 wrong tokens the source is still admitted")
	} else if !errors.Is(err, unix.EACCES) || !strings.Contains(err.Error(), "too many failed attempts") {
		t.Errorf("after 3 wrong tokens: %v, want EACCES, too many failed attempts", err)
	}
	re := regexp.MustCompile(`level=WARN msg="remote: refusing a source whose attempts keep failing" peer=` + regexp.QuoteMeta(backend.host))
	if line, ok := d.waitLog(re, readyTimeout); !ok {
		t.Errorf("no warn line naming the source:\n%s", tail(d.stderr.String(), 20))
	} else if n := len(re.FindAllString(d.stderr.String(), -1)); n != 1 {
		t.Errorf("%d warn lines, want 1 a minute: %s", n, line)
	}
}

// TestTokenReaders: a PD's token is for those who may write its
// directory, since a peer holding it may change the PD's buffers: with
// allow_other, uid 65534 reading the token of the root (0755, the
// mounting user's) or of another 0755 directory gets EACCES, and
// listxattr does not name it (getfattr -d works without an error);
// where 65534 may write, as the directory's owner, by its gid, or by a
// supplementary group, it reads the token; root reads every one.
func TestTokenReaders(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true"})
	for p := d.mnt; p != os.TempDir() && p != "/"; p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	const supplementary = 4242
	dirs := []struct {
		name     string
		uid, gid int
		mode     os.FileMode
		groups   string // setpriv's --groups for 65534, "" for none
		readable bool
	}{
		{"", 0, 0, 0o755, "", false},
		{"open", 0, 0, 0o755, "", false},
		{"others-write", 0, 0, 0o757, "", true},
		{"owned", 65534, 65534, 0o755, "", true},
		{"owned-read-only", 65534, 0, 0o575, "", false}, // the owner is judged by its own bits
		{"group", 0, 65534, 0o775, "", true},
		{"group-read-only", 0, 65534, 0o755, "", false},
		{"supplementary", 0, supplementary, 0o775, fmt.Sprint(supplementary), true},
		{"not-a-member", 0, supplementary, 0o775, "", false},
	}
	for _, dir := range dirs {
		p := d.path(dir.name)
		if dir.name != "" {
			if err := os.Mkdir(p, 0o700); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chown(p, dir.uid, dir.gid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, dir.mode); err != nil {
			t.Fatal(err)
		}
	}
	as := func(groups string, args ...string) (string, error) {
		g := "--clear-groups"
		if groups != "" {
			g = "--groups=" + groups
		}
		out, err := exec.Command("setpriv", append([]string{"--reuid=" + nobody, "--regid=" + nobody, g, "--"}, args...)...).CombinedOutput()
		return string(out), err
	}
	for _, dir := range dirs {
		p := d.path(dir.name)
		tok := mustXattr(t, p, xToken) // root reads every token
		if names, err := listxattr(p); err != nil || !slices.Contains(names, xToken) {
			t.Errorf("root's listxattr of %q: %q, %v; want %s in it", dir.name, names, err, xToken)
		}
		out, err := as(dir.groups, "getfattr", "--absolute-names", "--only-values", "-n", xToken, p)
		switch {
		case dir.readable && (err != nil || out != tok):
			t.Errorf("65534 reading the token of %q (%v, %d:%d, groups %q): %v, %q; want the token", dir.name, dir.mode, dir.uid, dir.gid, dir.groups, err, out)
		case !dir.readable && (err == nil || !strings.Contains(out, "Permission denied") || strings.Contains(out, tok)):
			t.Errorf("65534 reading the token of %q (%v, %d:%d, groups %q): %v, %q; want Permission denied", dir.name, dir.mode, dir.uid, dir.gid, dir.groups, err, out)
		}
		out, err = as(dir.groups, "getfattr", "--absolute-names", "-d", p)
		if err != nil || !strings.Contains(out, xPD+"=") || strings.Contains(out, xToken) != dir.readable {
			t.Errorf("65534's getfattr -d of %q (%v, %d:%d, groups %q): %v, %q; want %s listed %v, and no error", dir.name, dir.mode, dir.uid, dir.gid, dir.groups, err, out, xToken, dir.readable)
		}
	}
}

// fakePeer is a TCP listener that plays an mrfs daemon only as far as
// reading the hello: it records each hello (where `mrfs remote` sent a
// token, and which) and closes the connection.
type fakePeer struct {
	addr   string
	hellos chan proto.Frame
}

func startFakePeer(t *testing.T) *fakePeer {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p := &fakePeer{addr: l.Addr().String(), hellos: make(chan proto.Frame, 16)}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(cmdTimeout))
				f, _ := proto.NewReader(c, 1<<20).Next()
				p.hellos <- f // a connection without a hello counts too
			}()
		}
	}()
	return p
}

// hello is the next hello the fake peer got, or false when none came
// within d.
func (p *fakePeer) hello(d time.Duration) (proto.Frame, bool) {
	select {
	case f := <-p.hellos:
		return f, true
	case <-time.After(d):
		return proto.Frame{}, false
	}
}

// TestRemoteTokenSource: a directory mounted here gives `mrfs remote
// --pd DIR` its own token only for the peer it names itself: with a
// --peer or --transport naming another, the command is refused (exit
// 2) and nothing is sent; with the directory's own peer, named or not,
// it is served; a token the user gives (MRFS_TOKEN) goes where the user
// says, and the directory's own is then not sent.
func TestRemoteTokenSource(t *testing.T) {
	t.Parallel()
	d, peer := startRemote(t)
	fake := startFakePeer(t)
	addr, rkey := remoteBuf(t, d.path("b"), 4096, allRemote)
	own := mustXattr(t, d.mnt, xToken)
	keys := fmt.Sprintf(" --addr %d --rkey %d --length 4 --timeout 5s", addr, rkey)
	other := map[string]string{"tcp": "rdma_cm", "rdma_cm": "tcp"}[backend.transport]
	for _, extra := range []string{" --peer " + fake.addr, " --peer " + fake.addr + " --transport " + backend.transport, " --transport " + other} {
		_, errOut, err := sh(t, remoteCLI(d, "read")+extra+keys)
		if exitCode(err) != 2 || !strings.Contains(errOut, "its token goes only to the peer it names") || !strings.Contains(errOut, "MRFS_TOKEN") {
			t.Errorf("mrfs remote --pd %s%s without a token: exit %d, %q; want exit 2, refused", d.mnt, extra, exitCode(err), errOut)
		}
	}
	if h, ok := fake.hello(200 * time.Millisecond); ok {
		t.Errorf("a directory's token went to a peer it does not name: hello for %q with token %x (the directory's is %s)", h.Path, h.Token, own)
	}
	for _, extra := range []string{"", " --peer " + peer, " --peer " + peer + " --transport " + backend.transport} {
		if out, errOut, err := sh(t, remoteCLI(d, "read")+extra+keys); err != nil || out != "\x00\x00\x00\x00" {
			t.Errorf("mrfs remote --pd %s%s: %v, %q, %q; want the buffer's 4 bytes", d.mnt, extra, err, out, errOut)
		}
	}
	user := "0123456789abcdef0123456789abcdef"
	if _, errOut, err := sh(t, "MRFS_TOKEN="+user+" "+remoteCLI(d, "read")+" --peer "+fake.addr+" --transport tcp"+keys); exitCode(err) != 1 {
		t.Errorf("the user's token to a fake peer: exit %d, %q; want 1 (the fake answers nothing)", exitCode(err), errOut)
	}
	if h, ok := fake.hello(5 * time.Second); !ok || fmt.Sprintf("%x", h.Token) != user || h.Path != "/" {
		t.Errorf("the user's token to a fake peer: hello %v for %q with token %x; want the user's token for /", ok, h.Path, h.Token)
	}
}
