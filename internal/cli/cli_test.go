package cli

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func runCLI(args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestExitCodes(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.toml")
	if err := os.WriteFile(bad, []byte("[buffers]\nmax_bufers = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{nil, exitUsage, "usage:"},
		{[]string{"bogus"}, exitUsage, `unknown command "bogus"`},
		{[]string{"mount"}, exitUsage, "want 1 argument"},
		{[]string{"mount", "a", "b"}, exitUsage, "want 1 argument"},
		{[]string{"mount", "--nope", "/x"}, exitUsage, "flag provided but not defined"},
		{[]string{"mount", "--config", bad, "/x"}, exitUsage, "buffers.max_bufers"},
		{[]string{"mount", "--backend", "gpu", "/x"}, exitUsage, "gpu"},
		{[]string{"mount", "--config", "/nonexistent/mrfs.toml", "/x"}, exitUsage, "/nonexistent/mrfs.toml"},
		{[]string{"devices", "--backend", "rdma"}, exitFailure, "-tags rdma"},
		{[]string{"status", t.TempDir()}, exitFailure, "not the root of an mrfs mount"},
		{[]string{"umount", t.TempDir()}, exitFailure, "not a mount point"},
	} {
		if tc.msg == "-tags rdma" && rdmaBuilt {
			continue // built with the rdma backend: the outcome depends on the machine's devices
		}
		code, _, stderr := runCLI(tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.msg) {
			t.Errorf("mrfs %q: exit %d, stderr %q; want exit %d mentioning %q", tc.args, code, stderr, tc.code, tc.msg)
		}
	}
}

func TestVersionAndDevices(t *testing.T) {
	code, out, _ := runCLI("version")
	if code != 0 || !strings.HasPrefix(out, "mrfs ") {
		t.Errorf("version: %d %q", code, out)
	}
	code, out, stderr := runCLI("devices", "--backend", "soft")
	if code != 0 || !strings.Contains(out, "soft0") || !strings.Contains(out, "524287") {
		t.Errorf("devices: %d %q %q", code, out, stderr)
	}
}

func TestParseInterleavesFlagsAndArguments(t *testing.T) {
	f := flag.NewFlagSet("mount", flag.ContinueOnError)
	backend := f.String("backend", "", "")
	pos, err := parse(f, []string{"/mnt", "--backend", "soft"}, 1)
	if err != nil || len(pos) != 1 || pos[0] != "/mnt" || *backend != "soft" {
		t.Errorf("parse = %q, %v, backend %q", pos, err, *backend)
	}
}

func TestUmountRefusesOtherFilesystems(t *testing.T) {
	// /proc is always a mount, and never an mrfs one.
	code, _, stderr := runCLI("umount", "/proc")
	if code != exitFailure || !strings.Contains(stderr, "a proc mount, not mrfs") {
		t.Errorf("umount /proc: exit %d, %q", code, stderr)
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	if got := unescapeMountinfo(`/tmp/a\040b\134c`); got != `/tmp/a b\c` {
		t.Errorf("unescape = %q", got)
	}
}

func TestPlural(t *testing.T) {
	if plural(1, "PD") != "1 PD" || plural(2, "buffer") != "2 buffers" || plural(0, "PD") != "0 PDs" {
		t.Error(plural(1, "PD"), plural(2, "buffer"), plural(0, "PD"))
	}
}
