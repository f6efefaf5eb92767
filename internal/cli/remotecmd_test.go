package cli

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"mrfs/desc"
	"mrfs/remote"
	"mrfs/verbs"
)

// fakeRemote replaces every transport of `mrfs remote` with one that
// works on a local 4 KiB region (rkey 0x1234 at iova 0x1000), checked
// crudely, so the command runs on the host without a peer. dials counts
// the connections made.
type fakeRemote struct {
	mem   []byte
	dials []string // "transport peer dir"
	// tokenFile holds fakeToken, for --token-file.
	tokenFile string
	// device is the far side's device the connections say they came
	// through ("": they say nothing).
	device string
}

const fakeIOVA, fakeRKey = 0x1000, 0x1234

// fakeToken is the fake PD's token.
const fakeToken = "00112233445566778899aabbccddeeff"

// fakeDesc is a desc of the fake's region.
const fakeDesc = `{"addr":"0x1000","regions":[{"addr":"0x1000","length":"4096","lkey":"0x1234","rkey":"0x1234"}]}`

func installFakeRemote(t *testing.T) *fakeRemote {
	t.Helper()
	f := &fakeRemote{mem: make([]byte, 4096), tokenFile: writeToken(t, fakeToken)}
	t.Setenv(tokenEnv, "") // the tests give tokens themselves
	saved := transports
	transports = map[string]dialer{}
	for name, real := range saved {
		if name == transportRDMA && !rdmaBuilt {
			transports[name] = real // says how to get it
			continue
		}
		transports[name] = func(_ context.Context, peer, dir string, tok remote.Token) (remote.Conn, error) {
			if hex.EncodeToString(tok[:]) != fakeToken {
				return nil, &remote.RefusedError{Errno: syscall.EACCES, Msg: "wrong token"}
			}
			f.dials = append(f.dials, name+" "+peer+" "+dir)
			return &fakeConn{f: f}, nil
		}
	}
	t.Cleanup(func() { transports = saved })
	return f
}

// writeToken is a token file holding s as people write them: with a
// newline, and here some blanks around it.
func writeToken(t *testing.T, s string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(p, []byte("  "+s+"\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

type fakeConn struct{ f *fakeRemote }

var _ remote.DeviceConn = (*fakeConn)(nil)

func (c *fakeConn) Device() string     { return c.f.device }
func (c *fakeConn) MaxMessage() uint32 { return 1 << 20 }
func (c *fakeConn) Close() error       { return nil }

// at is the region's bytes [iova, iova+n) or a REM_ACCESS_ERR.
func (c *fakeConn) at(op string, iova uint64, rkey uint32, n int) ([]byte, error) {
	if rkey != fakeRKey || iova < fakeIOVA || iova+uint64(n) > fakeIOVA+uint64(len(c.f.mem)) {
		return nil, &remote.StatusError{Op: op, Status: verbs.WCRemAccessErr}
	}
	return c.f.mem[iova-fakeIOVA:][:n], nil
}

func (c *fakeConn) Read(dst []byte, iova uint64, rkey uint32) error {
	b, err := c.at("READ", iova, rkey, len(dst))
	copy(dst, b)
	return err
}

func (c *fakeConn) Write(iova uint64, rkey uint32, src []byte) error {
	b, err := c.at("WRITE", iova, rkey, len(src))
	copy(b, src)
	return err
}

func (c *fakeConn) CompareSwap(iova uint64, rkey uint32, compare, swap uint64) (uint64, error) {
	b, err := c.at("COMPARE_AND_SWAP", iova, rkey, 8)
	if err != nil {
		return 0, err
	}
	old := binary.NativeEndian.Uint64(b)
	if old == compare {
		binary.NativeEndian.PutUint64(b, swap)
	}
	return old, nil
}

func (c *fakeConn) FetchAdd(iova uint64, rkey uint32, add uint64) (uint64, error) {
	b, err := c.at("FETCH_AND_ADD", iova, rkey, 8)
	if err != nil {
		return 0, err
	}
	old := binary.NativeEndian.Uint64(b)
	binary.NativeEndian.PutUint64(b, old+add)
	return old, nil
}

// Usage errors exit 2 with a message naming the problem, and connect to
// nothing.
func TestRemoteUsageErrors(t *testing.T) {
	f := installFakeRemote(t)
	ok := []string{"--peer", "127.0.0.1:7471", "--pd", "/", "--token-file", f.tokenFile, "--addr", "0x1000", "--rkey", "0x1234"}
	without := func(flag string) []string {
		var a []string
		for i := 0; i < len(ok); i += 2 {
			if ok[i] != flag {
				a = append(a, ok[i], ok[i+1])
			}
		}
		return a
	}
	with := func(extra ...string) []string { return append(append([]string(nil), ok...), extra...) }
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{nil, "want an operation"},
		{[]string{"frob"}, `unknown operation "frob"`},
		{[]string{"READ"}, `unknown operation "READ"`},
		{append([]string{"write"}, without("--peer")...), "--peer is required"},
		{append([]string{"write"}, without("--pd")...), "--pd is required"},
		{append([]string{"write"}, without("--token-file")...), "no token: give the PD's token (user.mrfs.token of the directory) with --token-file FILE or MRFS_TOKEN"},
		{append([]string{"write"}, with("--token-file", writeToken(t, "0x12"))...), "not 32 hex digits"},
		{append([]string{"write"}, with("--token-file", writeToken(t, fakeToken[1:]))...), "not 32 hex digits"},
		{append([]string{"write"}, with("--token-file", "/nonexistent/token")...), "--token-file: open /nonexistent/token: no such file"},
		{append([]string{"write"}, with("--token", fakeToken)...), "--token is refused: a command line is readable by every user"},
		{append([]string{"write"}, with("--token="+fakeToken)...), "give the token with --token-file FILE or the MRFS_TOKEN environment variable"},
		{append([]string{"write"}, with("-token", fakeToken)...), "--token is refused"},
		{append([]string{"write", "--token", fakeToken}, without("--token-file")...), "--token is refused"},
		{[]string{"read", "--name", "h/b", "--endpoints", "http://127.0.0.1:1", "--length", "1"}, "--name needs the PD's token from --token-file or MRFS_TOKEN"},
		{append([]string{"write"}, without("--addr")...), "--addr is required"},
		{append([]string{"write"}, without("--rkey")...), "--rkey is required"},
		{append([]string{"write"}, with("--pd", "")...), "--pd is required"},
		{append([]string{"write"}, with("--addr", "0xzz")...), `--addr "0xzz" is not a number`},
		{append([]string{"write"}, with("--addr", "-1")...), `--addr "-1" is not a number`},
		{append([]string{"write"}, with("--rkey", "0x123456789")...), `--rkey "0x123456789" is not a number (decimal or 0x hex, 32 bits)`},
		{append([]string{"write"}, with("--rkey", "key")...), `--rkey "key" is not a number`},
		{append([]string{"read"}, ok...), "--length is required"},
		{append([]string{"read"}, with("--length", "lots")...), `--length "lots" is not a number`},
		{append([]string{"read"}, with("--length", "-5")...), `--length "-5" is not a number`},
		{append([]string{"read"}, with("--length", "0x100000000")...), `--length "0x100000000" is not a number`},
		{append([]string{"write"}, with("--length", "1.5")...), `--length "1.5" is not a number`},
		{append([]string{"cas"}, with("--swap", "1")...), "--compare is required"},
		{append([]string{"cas"}, with("--compare", "1")...), "--swap is required"},
		{append([]string{"cas"}, with("--compare", "1", "--swap", "0xg")...), `--swap "0xg" is not a number`},
		{append([]string{"fadd"}, ok...), "--add is required"},
		{append([]string{"fadd"}, with("--add", "1e3")...), `--add "1e3" is not a number`},
		{append([]string{"write"}, with("--transport", "udp")...), `unknown --transport "udp"`},
		{append([]string{"write"}, with("--timeout", "0s")...), "--timeout 0s is not positive"},
		{append([]string{"write"}, with("--timeout", "soon")...), "invalid value"},
		{append([]string{"write"}, with("--bogus")...), "flag provided but not defined: -bogus"},
		{append([]string{"write"}, with("extra")...), "want 0 argument(s), got 1"},
		{append([]string{"write"}, with("--desc", fakeDesc)...), "--desc replaces --addr and --rkey"},
		{append([]string{"write"}, with("--offset", "8")...), "--offset needs --desc"},
		{[]string{"write", "--peer", "p:1", "--pd", "/", "--token-file", f.tokenFile, "--desc", "{}"}, "--desc: it lists no regions"},
		{[]string{"write", "--peer", "p:1", "--pd", "/", "--token-file", f.tokenFile, "--desc", "not json"}, "--desc: not a desc"},
		{[]string{"write", "--peer", "p:1", "--pd", "/", "--token-file", f.tokenFile, "--desc", "@/nonexistent/desc"}, "no such file"},
		{[]string{"write", "--peer", "p:1", "--pd", "/", "--token-file", f.tokenFile, "--desc", fakeDesc, "--offset", "4096"}, "--offset 4096: address 0x2000 is in no region"},
	} {
		args := append([]string{"remote"}, tc.args...)
		code, stdout, stderr := runCLI(args...)
		if code != exitUsage || !strings.Contains(stderr, tc.msg) || !strings.Contains(stderr, "usage:") || stdout != "" {
			t.Errorf("mrfs %q: exit %d, stdout %q, stderr %q; want exit 2 naming %q", args, code, stdout, stderr, tc.msg)
		}
		if strings.Contains(stderr, fakeToken[1:9]) {
			t.Errorf("mrfs %q: the error repeats the token: %q", args, stderr)
		}
	}
	if len(f.dials) != 0 {
		t.Errorf("usage errors connected: %q", f.dials)
	}
}

// The operations go through the build's transport by default, print
// old values of atomics in hex and failed completions' status names.
func TestRemoteOperations(t *testing.T) {
	f := installFakeRemote(t)
	saved := stdin
	t.Cleanup(func() { stdin = saved })
	base := []string{"--peer", "10.0.0.1:7471", "--pd", "/tenant", "--token-file", f.tokenFile, "--rkey", "0x1234"}
	remote := func(op string, args ...string) (int, string, string) {
		return runCLI(append(append([]string{"remote", op}, base...), args...)...)
	}

	stdin = strings.NewReader("hello, remote")
	if code, out, errs := remote("write", "--addr", "0x1010"); code != exitOK || out != "" || errs != "" {
		t.Fatalf("write: exit %d, stdout %q, stderr %q", code, out, errs)
	}
	if got := string(f.mem[0x10 : 0x10+13]); got != "hello, remote" {
		t.Errorf("write landed %q", got)
	}
	stdin = strings.NewReader("abcdef")
	if code, _, errs := remote("write", "--addr", "0x1100", "--length", "3"); code != exitOK || string(f.mem[0x100:0x104]) != "abc\x00" {
		t.Errorf("write --length 3: exit %d, stderr %q, region %q", code, errs, f.mem[0x100:0x104])
	}
	stdin = strings.NewReader("ab")
	if code, _, errs := remote("write", "--addr", "0x1100", "--length", "3"); code != exitFailure || !strings.Contains(errs, "stdin had only 2 bytes") {
		t.Errorf("write --length 3 of 2 bytes: exit %d, stderr %q", code, errs)
	}
	if code, out, errs := remote("read", "--addr", "4112", "--length", "5"); code != exitOK || out != "hello" {
		t.Errorf("read: exit %d, stdout %q, stderr %q", code, out, errs)
	}
	if code, out, _ := remote("read", "--addr", "0x1000", "--length", "0"); code != exitOK || out != "" {
		t.Errorf("read of 0 bytes: exit %d, stdout %q", code, out)
	}
	for _, tc := range []struct {
		op   string
		args []string
		out  string
	}{
		{"fadd", []string{"--add", "5"}, "0x0\n"},
		{"fadd", []string{"--add", "0x10"}, "0x5\n"},
		{"cas", []string{"--compare", "21", "--swap", "0xabc"}, "0x15\n"},
		{"cas", []string{"--compare", "21", "--swap", "7"}, "0xabc\n"},
	} {
		code, out, errs := remote(tc.op, append([]string{"--addr", "0x1400"}, tc.args...)...)
		if code != exitOK || out != tc.out {
			t.Errorf("%s %q: exit %d, stdout %q, stderr %q; want %q", tc.op, tc.args, code, out, errs, tc.out)
		}
	}

	// A failed completion: the status name first on stderr, exit 1.
	stdin = strings.NewReader("x")
	for _, args := range [][]string{
		{"write", "--addr", "0x2000"},
		{"read", "--addr", "0x1ff8", "--length", "9"},
		{"fadd", "--addr", "0x800", "--add", "1"},
	} {
		code, out, errs := remote(args[0], args[1:]...)
		if code != exitFailure || out != "" || !strings.HasPrefix(errs, "mrfs: IBV_WC_REM_ACCESS_ERR: remote "+args[0]) {
			t.Errorf("%q outside the region: exit %d, stdout %q, stderr %q; want exit 1, IBV_WC_REM_ACCESS_ERR", args, code, out, errs)
		}
	}
	code, _, errs := runCLI("remote", "read", "--peer", "p:1", "--pd", "/", "--token-file", f.tokenFile, "--addr", "0x1000", "--rkey", "0x99", "--length", "1")
	if code != exitFailure || !strings.Contains(errs, "IBV_WC_REM_ACCESS_ERR") || strings.Contains(errs, "usage:") {
		t.Errorf("read with a wrong rkey: exit %d, stderr %q", code, errs)
	}

	for _, d := range f.dials {
		if want := defaultTransport + " 10.0.0.1:7471 /tenant"; d != want && !strings.HasPrefix(d, defaultTransport+" p:1 ") {
			t.Errorf("dialed %q, want %q (the build's transport)", d, want)
		}
	}
	// --transport picks one; rdma is short for rdma_cm.
	f.dials = nil
	for _, name := range []string{"tcp", "rdma", "rdma_cm"} {
		want, _ := transportName(name)
		if want == transportRDMA && !rdmaBuilt {
			continue
		}
		if code, _, errs := remote("fadd", "--addr", "0x1400", "--add", "0", "--transport", name); code != exitOK {
			t.Errorf("--transport %s: exit %d, %s", name, code, errs)
		}
		if len(f.dials) == 0 || !strings.HasPrefix(f.dials[len(f.dials)-1], want+" ") {
			t.Errorf("--transport %s dialed %q", name, f.dials)
		}
	}
}

// With a desc of several devices, the keys are those of the device the
// connection came through; the desc's own (the first device's) are
// wrong here on purpose.
func TestRemoteDescOnDevice(t *testing.T) {
	f := installFakeRemote(t)
	saved := stdin
	t.Cleanup(func() { stdin = saved })
	const d = `{"device":"soft0","addr":"0x1000","rkey":"0x9999","regions":[{"addr":"0x1000","length":"4096","rkey":"0x9999"}],
		"devices":[{"device":"soft0","rkey":"0x9999","regions":[{"addr":"0x1000","length":"4096","rkey":"0x9999"}]},
		{"device":"soft1","rkey":"0x1234","regions":[{"addr":"0x1000","length":"4096","rkey":"0x1234"}]}]}`
	write := func() (int, string) {
		stdin = strings.NewReader("via soft1")
		code, _, errs := runCLI("remote", "write", "--peer", "p:1", "--pd", "/", "--token-file", f.tokenFile, "--desc", d, "--offset", "8")
		return code, errs
	}
	f.device = "soft1"
	if code, errs := write(); code != exitOK || string(f.mem[8:17]) != "via soft1" {
		t.Errorf("write through soft1: exit %d, stderr %q, region %q", code, errs, f.mem[8:17])
	}
	f.device = "soft0"
	if code, errs := write(); code != exitFailure || !strings.Contains(errs, "IBV_WC_REM_ACCESS_ERR") || !strings.Contains(errs, "rkey 0x9999") {
		t.Errorf("write through soft0 (whose key the fake refuses): exit %d, stderr %q", code, errs)
	}
	f.device = "soft2"
	if code, errs := write(); code != exitFailure || !strings.Contains(errs, "came through device soft2, and the desc has keys for soft0, soft1 only") {
		t.Errorf("write through a device the desc lacks: exit %d, stderr %q", code, errs)
	}
}

// A binary without rdma_cm says how to get it, and fails (exit 1) like
// `mrfs devices --backend rdma` does.
func TestRemoteTransportMissing(t *testing.T) {
	f := installFakeRemote(t)
	if rdmaBuilt {
		t.Skip("built with -tags rdma: rdma_cm is there")
	}
	if defaultTransport != transportTCP {
		t.Errorf("default transport %q without -tags rdma, want tcp", defaultTransport)
	}
	code, _, errs := runCLI("remote", "write", "--transport", "rdma", "--peer", "h:1", "--pd", "/", "--token-file", f.tokenFile, "--addr", "0", "--rkey", "0")
	if code != exitFailure || !strings.Contains(errs, "no rdma_cm transport") || !strings.Contains(errs, "-tags rdma") {
		t.Errorf("--transport rdma without -tags rdma: exit %d, stderr %q", code, errs)
	}
}

// The token comes from --token-file, else from MRFS_TOKEN (a file given
// wins); a malformed one is a usage error that does not repeat it.
func TestRemoteTokenSources(t *testing.T) {
	f := installFakeRemote(t)
	args := []string{"remote", "fadd", "--peer", "p:1", "--pd", "/", "--addr", "0x1000", "--rkey", "0x1234", "--add", "1"}
	t.Setenv(tokenEnv, fakeToken)
	if code, out, errs := runCLI(args...); code != exitOK || out != "0x0\n" {
		t.Errorf("with %s: exit %d, stdout %q, stderr %q", tokenEnv, code, out, errs)
	}
	wrong := "ffeeddccbbaa99887766554433221100"
	t.Setenv(tokenEnv, wrong)
	if code, out, errs := runCLI(append(args, "--token-file", f.tokenFile)...); code != exitOK || out != "0x1\n" {
		t.Errorf("--token-file with another token in %s: exit %d, stdout %q, stderr %q; want the file's", tokenEnv, code, out, errs)
	}
	if code, _, errs := runCLI(args...); code != exitFailure || !strings.Contains(errs, "wrong token") {
		t.Errorf("a wrong %s: exit %d, stderr %q; want exit 1, wrong token", tokenEnv, code, errs)
	}
	t.Setenv(tokenEnv, wrong[:31]+"g")
	if code, _, errs := runCLI(args...); code != exitUsage || !strings.Contains(errs, tokenEnv+": the token is not 32 hex digits") || strings.Contains(errs, wrong[:8]) {
		t.Errorf("a malformed %s: exit %d, stderr %q; want exit 2 naming it, without its value", tokenEnv, code, errs)
	}
	if len(f.dials) != 2 {
		t.Errorf("dials %q, want the two with the right token", f.dials)
	}
}

// --device picks the address published for that device of the mount.
func TestListenOfDevice(t *testing.T) {
	d := desc.Desc{Listen: "rdma_cm 10.0.2.15:7471", Devices: []desc.DeviceRegions{
		{Device: "rxe0", Listen: "rdma_cm 10.0.2.15:7471"},
		{Device: "rxe1", Listen: "rdma_cm 10.0.3.15:7471"},
		{Device: "rxe2"},
	}}
	for device, want := range map[string]string{"": "rdma_cm 10.0.2.15:7471", "rxe1": "rdma_cm 10.0.3.15:7471"} {
		if got, err := listenOf(d, device); err != nil || got != want {
			t.Errorf("listenOf(%q) = %q, %v; want %q", device, got, err, want)
		}
	}
	if _, err := listenOf(d, "rxe2"); err == nil || !strings.Contains(err.Error(), "no address of device rxe2 is published; these devices have one: rxe0, rxe1") {
		t.Errorf("listenOf(rxe2): %v", err)
	}
	if _, err := listenOf(desc.Desc{Listen: "tcp 10.0.2.15:7471"}, "soft1"); err == nil || !strings.Contains(err.Error(), "leave --device out") {
		t.Errorf("listenOf a one-device desc: %v", err)
	}
	code, _, errs := runCLI("remote", "read", "--peer", "p:1", "--pd", "/", "--addr", "0x1000", "--rkey", "1", "--length", "1", "--device", "rxe1")
	if code != exitUsage || !strings.Contains(errs, "--device need --name") {
		t.Errorf("--device without --name: exit %d, %q", code, errs)
	}
}
