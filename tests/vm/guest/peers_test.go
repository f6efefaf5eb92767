//go:build rdma

package guest

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// src holds what the guest tests read of the tree: docs/PEERS.md and
// contrib/peer, which tests/vm/run copies into the share.
const src = "/run/mrfs-vm/src"

// peerDoc is the program of docs/PEERS.md between `<!-- name -->` and
// `<!-- end -->`, in a fence of lang, exactly as written there; a test
// fails when it is longer than max lines (the issue asks for short ones).
func peerDoc(t *testing.T, name, lang string, max int) string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(src, "docs/PEERS.md"))
	if err != nil {
		t.Fatalf("docs/PEERS.md is not in the share (tests/vm/run copies it): %v", err)
	}
	_, prog, ok := strings.Cut(string(doc), "<!-- "+name+" -->\n```"+lang+"\n")
	prog, _, ok2 := strings.Cut(prog, "```\n<!-- end -->")
	if !ok || !ok2 {
		t.Fatalf("docs/PEERS.md has no %s program between <!-- %s --> and <!-- end -->", lang, name)
	}
	if n := strings.Count(prog, "\n"); n > max {
		t.Errorf("docs/PEERS.md's %s is %d lines; at most %d", name, n, max)
	}
	return prog
}

// peerMount is a mount with the rdma_cm listener on rxe0 and, in the
// root PD and in the PD of "tenant", a 64 KiB buffer rx with every remote
// access, its desc in a file beside the test's programs.
type peerMount struct {
	*remoteDaemon
	dir string // the test's scratch directory
}

func newPeerMount(t *testing.T) *peerMount {
	t.Helper()
	m := &peerMount{remoteDaemon: remoteMount(t), dir: t.TempDir()}
	if err := os.Mkdir(filepath.Join(m.daemon.dir, "tenant"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, pd := range []string{"/", "tenant"} {
		buffer(t, m.file(pd), 64<<10, "local_write,remote_read,remote_write,remote_atomic")
		if err := os.WriteFile(m.desc(pd), []byte(getxattr(t, m.file(pd), "user.mrfs.desc")), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

// file is the buffer of pd's directory; desc its desc's file.
func (m *peerMount) file(pd string) string { return filepath.Join(m.daemon.dir, pd, "rx") }
func (m *peerMount) desc(pd string) string {
	if pd == "/" {
		pd = "root"
	}
	return filepath.Join(m.dir, pd+"-desc.json")
}

// badRKeyDesc writes pd's desc with every rkey of its regions changed
// (the key byte: rxe finds the region by the rest and then refuses it).
func (m *peerMount) badRKeyDesc(t *testing.T, pd string) string {
	t.Helper()
	var d map[string]any
	if err := json.Unmarshal([]byte(getxattr(t, m.file(pd), "user.mrfs.desc")), &d); err != nil {
		t.Fatal(err)
	}
	for _, r := range d["regions"].([]any) {
		reg := r.(map[string]any)
		k := mustHex(t, reg["rkey"].(string))
		reg["rkey"] = "0x" + strconv.FormatUint(k^1, 16)
	}
	b, _ := json.Marshal(d)
	path := filepath.Join(m.dir, "bad-rkey-desc.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// run runs a peer program with MRFS_TOKEN and stdin, returning its exit
// code and its output.
func (m *peerMount) run(t *testing.T, token string, stdin []byte, name string, args ...string) (int, string) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), "MRFS_TOKEN="+token, "MRFS_PEER_PY="+filepath.Join(src, "contrib/peer/python"))
	cmd.Stdin = bytes.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run %s: %v", name, err)
	}
	t.Logf("%s %s (exit %d):\n%s", filepath.Base(name), strings.Join(args, " "), code, out)
	return code, string(out)
}

// peerChecks runs the program of docs/PEERS.md (prog, with args before
// its own) against both buffers and checks, through the client's view
// of the files, what it wrote and its count; then that a wrong rkey
// completes with IBV_WC_REM_ACCESS_ERR and changes nothing, and that a
// wrong token is refused.
func (m *peerMount) peerChecks(t *testing.T, lang string, prog ...string) {
	t.Helper()
	argv := func(more ...string) []string { return append(append([]string{}, prog[1:]...), more...) }
	for i, pd := range []string{"/", "tenant"} {
		data := bytes.Repeat([]byte("from a "+lang+" peer over rdma_cm. "), 200) // two pages and more
		const off = 4000
		code, out := m.run(t, m.tokenHex(t, pd), data, prog[0], argv(m.peer, pd, m.desc(pd), strconv.Itoa(off))...)
		want := "wrote " + strconv.Itoa(len(data)) + " bytes at offset " + strconv.Itoa(off) + "; the count was 0"
		if code != 0 || strings.TrimSpace(out) != want {
			t.Fatalf("the %s program of docs/PEERS.md in %q: exit %d, %q; want %q", lang, pd, code, out, want)
		}
		got, err := os.ReadFile(m.file(pd))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[off:off+len(data)], data) || !bytes.Equal(got[8:off], make([]byte, off-8)) ||
			!bytes.Equal(got[off+len(data):], make([]byte, len(got)-off-len(data))) {
			t.Errorf("%s: the file does not hold exactly what the %s peer wrote at %d", m.file(pd), lang, off)
		}
		if n := binary.NativeEndian.Uint64(got); n != 1 {
			t.Errorf("%s: the count in the first word is %d after the %s peer's fetch-and-add, want 1", m.file(pd), n, lang)
		}
		if i == 0 {
			t.Logf("%s peer over rdma_cm landed: the mrfs file holds at %d: %q...", lang, off, got[off:off+40])
		}
	}

	bad := m.badRKeyDesc(t, "/")
	before, _ := os.ReadFile(m.file("/"))
	code, out := m.run(t, m.tokenHex(t, "/"), []byte("never lands"), prog[0], argv(m.peer, "/", bad, "30000")...)
	if code == 0 || !strings.Contains(out, "IBV_WC_REM_ACCESS_ERR") {
		t.Errorf("the %s program with a wrong rkey: exit %d, %q; want a failure with IBV_WC_REM_ACCESS_ERR", lang, code, out)
	}
	if after, _ := os.ReadFile(m.file("/")); !bytes.Equal(before, after) {
		t.Errorf("a WRITE with a wrong rkey changed the buffer")
	}
	code, out = m.run(t, strings.Repeat("0", 32), []byte("never lands"), prog[0], argv(m.peer, "/", m.desc("/"), "30000")...)
	if code == 0 || (!strings.Contains(out, "Permission denied") && !strings.Contains(out, "EACCES")) {
		t.Errorf("the %s program with a wrong token: exit %d, %q; want a refusal with EACCES", lang, code, out)
	}
}

// selftest runs a peer's self-test (cmd) against the root's buffer and
// checks that what its WRITE put at 100 (marker) and the word its
// atomics left at 0 are in the file.
func (m *peerMount) selftest(t *testing.T, marker string, word uint64, cmd ...string) {
	t.Helper()
	args := append(append([]string{}, cmd[1:]...), m.peer, "/", m.desc("/"))
	code, out := m.run(t, m.tokenHex(t, "/"), nil, cmd[0], args...)
	if code != 0 || strings.Contains(out, "FAIL") {
		t.Fatalf("%s: exit %d", strings.Join(cmd, " "), code)
	}
	got, err := os.ReadFile(m.file("/"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(got[100:140], []byte(marker)) {
		t.Errorf("the self-test's WRITE %q is not in the file: %q", marker, got[100:140])
	}
	if w := binary.NativeEndian.Uint64(got); w != word {
		t.Errorf("the self-test's atomics left %d in the first word, want %d", w, word)
	}
}

// TestCPeer is issue 23's C peer on rxe0: the program docs/PEERS.md
// shows, built with cc against contrib/peer/c exactly as written there,
// WRITEs into a buffer by its desc, READs it back and fetch-and-adds its
// first word, in the root's PD and in another directory's, and the
// client's files hold what it wrote; with a wrong rkey its WRITE
// completes with IBV_WC_REM_ACCESS_ERR, with a wrong token mrfs refuses
// it; the library's self-test passes (every operation, both atomics,
// the errors).
func TestCPeer(t *testing.T) {
	requireGuest(t)
	m := newPeerMount(t)
	lib := filepath.Join(src, "contrib/peer/c")
	prog := filepath.Join(m.dir, "write.c")
	if err := os.WriteFile(prog, []byte(peerDoc(t, "peer-c.c", "c", 30)), 0o600); err != nil {
		t.Fatal(err)
	}
	build := func(out, main string) string {
		t.Helper()
		bin := filepath.Join(m.dir, out)
		cc := exec.Command("cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I"+lib, "-o", bin, main,
			filepath.Join(lib, "mrfs_peer.c"), "-lrdmacm", "-libverbs")
		if out, err := cc.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(cc.Args, " "), err, out)
		}
		return bin
	}
	m.peerChecks(t, "C", build("write", prog))
	m.selftest(t, "rdma_cm peer in C", 7, build("selftest", filepath.Join(lib, "selftest.c")))
}

// TestPythonVerbsPeer is issue 23's Python peer on pyverbs on rxe0: the
// program docs/PEERS.md shows, run exactly as written there, does what
// TestCPeer's does, with the same checks; the module's self-test passes.
func TestPythonVerbsPeer(t *testing.T) {
	requireGuest(t)
	if out, err := exec.Command("python3", "-c", "import pyverbs.cmid").CombinedOutput(); err != nil {
		t.Fatalf("no pyverbs in the guest (tests/vm/run installs python3-pyverbs on the host): %v: %s", err, out)
	}
	m := newPeerMount(t)
	prog := filepath.Join(m.dir, "write_verbs.py")
	if err := os.WriteFile(prog, []byte(peerDoc(t, "peer-verbs.py", "python", 15)), 0o600); err != nil {
		t.Fatal(err)
	}
	m.peerChecks(t, "Python", "python3", prog)
	m.selftest(t, "rdma_cm peer in Python", 42, "python3", filepath.Join(src, "contrib/peer/python/selftest.py"), "--verbs")
}
