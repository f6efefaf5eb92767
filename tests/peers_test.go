package tests

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The Python peer of the soft transport (contrib/peer/python): the
// program docs/PEERS.md shows, run exactly as written there, writes into
// a buffer named by its desc and the bytes are in the file; the module's
// self-test checks every operation and error against the same mount.
func TestPythonSoftPeer(t *testing.T) {
	if !backend.soft() {
		t.Skip("the soft transport needs the soft backend (tests/vm runs the suite on rxe0 too)")
	}
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("no python3 here (bash scripts/test installs it)")
	}
	t.Parallel()
	d := startDaemon(t, daemonConfig{Remote: remoteConfig()})
	peer := d.remotePeer(t)
	f := d.path("rx")
	makeBuffer(t, f, 64<<10)
	if err := setxattr(f, xAccess, allRemote); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	desc := filepath.Join(dir, "desc.json")
	if err := os.WriteFile(desc, []byte(mustXattr(t, f, xDesc)), 0o600); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../docs/PEERS.md")
	if err != nil {
		t.Fatal(err)
	}
	_, prog, ok := strings.Cut(string(doc), "<!-- peer-soft.py -->\n```python\n")
	prog, _, ok2 := strings.Cut(prog, "```\n<!-- end -->")
	if !ok || !ok2 {
		t.Fatal("docs/PEERS.md has no program between <!-- peer-soft.py --> and <!-- end -->")
	}
	if n := strings.Count(prog, "\n"); n > 15 {
		t.Errorf("docs/PEERS.md's Python program is %d lines; the issue asks for about 15", n)
	}
	script := filepath.Join(dir, "write.py")
	if err := os.WriteFile(script, []byte(prog), 0o600); err != nil {
		t.Fatal(err)
	}
	lib, _ := filepath.Abs("../contrib/peer/python")
	token := mustXattr(t, d.mnt, "user.mrfs.token")
	env := append(os.Environ(), "MRFS_TOKEN="+token, "MRFS_PEER_PY="+lib)

	data := bytes.Repeat([]byte("from a Python peer. "), 300) // 6000 bytes: two pages
	cmd := exec.Command("python3", script, peer, "/", desc, "4000")
	cmd.Env, cmd.Stdin = env, bytes.NewReader(data)
	out, err := cmd.CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "wrote 6000 bytes at offset 4000" {
		t.Fatalf("the program of docs/PEERS.md: %v: %s", err, out)
	}
	got, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[4000:10000], data) || !bytes.Equal(got[:4000], make([]byte, 4000)) {
		t.Errorf("the file does not hold what the Python peer wrote at 4000")
	}

	cmd = exec.Command("python3", filepath.Join(lib, "selftest.py"), peer, "/", desc)
	cmd.Env = env
	out, err = cmd.CombinedOutput()
	t.Logf("selftest.py:\n%s", out)
	if err != nil {
		t.Errorf("contrib/peer/python/selftest.py: %v", err)
	}
}
