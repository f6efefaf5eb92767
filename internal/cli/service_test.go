package cli

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

const unitFile = "../../contrib/mrfs@.service"

// unitSettings reads the unit's Key=Value lines of one section.
func unitSettings(t *testing.T, section string) map[string]string {
	t.Helper()
	f, err := os.Open(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]string{}
	cur := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "["):
			cur = line
		case cur == "["+section+"]" && line != "" && !strings.HasPrefix(line, "#"):
			k, v, _ := strings.Cut(line, "=")
			out[k] = v
		}
	}
	return out
}

// The unit is a notify service for a pinning daemon, and its command line
// is one mrfs mount accepts.
func TestSystemdUnit(t *testing.T) {
	s := unitSettings(t, "Service")
	for k, want := range map[string]string{
		"Type":         "notify",
		"LimitMEMLOCK": "infinity",
		"LimitNOFILE":  "1048576",
	} {
		if s[k] != want {
			t.Errorf("%s=%q, want %q", k, s[k], want)
		}
	}
	// A crash keeps the mount (DESIGN, Restart): systemd starts the
	// daemon again with what it kept, as many descriptors as it needs,
	// and nothing unmounts between the crash and the restart.
	if s["Restart"] != "on-failure" || s["ExecStopPost"] != "" {
		t.Errorf("Restart=%q ExecStopPost=%q: want on-failure and no unmount after a crash", s["Restart"], s["ExecStopPost"])
	}
	if n, err := strconv.Atoi(s["FileDescriptorStoreMax"]); err != nil || n < 4 || s["Environment"] != "FDSTORE="+s["FileDescriptorStoreMax"] {
		t.Errorf("FileDescriptorStoreMax=%q Environment=%q: want room for 4 descriptors, said as $FDSTORE", s["FileDescriptorStoreMax"], s["Environment"])
	}
	reload := strings.Fields(strings.NewReplacer("%f", "/mnt/mr").Replace(s["ExecReload"]))
	if len(reload) != 3 || filepath.Base(reload[0]) != "mrfs" || reload[1] != "upgrade" || reload[2] != "/mnt/mr" {
		t.Errorf("ExecReload=%q, want mrfs upgrade of the mount point", s["ExecReload"])
	}
	argv := strings.Fields(strings.NewReplacer("%i", "mnt-mr", "%f", "/mnt/mr").Replace(s["ExecStart"]))
	if len(argv) < 3 || filepath.Base(argv[0]) != "mrfs" || argv[1] != "mount" {
		t.Fatalf("ExecStart=%q is not mrfs mount", s["ExecStart"])
	}
	fs := flagsOf(*lookupCommand("mount"))
	pos, err := parse(fs, argv[2:], 1)
	if err != nil || pos[0] != "/mnt/mr" || fs.Lookup("daemon").Value.String() != "false" {
		t.Errorf("ExecStart arguments %q: %v, %q; want one mount point, in the foreground", argv[2:], err, pos)
	}

	// systemd's own check, with the binary at hand and the manual it
	// points to generated.
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed (scripts/test installs systemd)")
	}
	dir := t.TempDir()
	unit, err := os.ReadFile(unitFile)
	if err != nil {
		t.Fatal(err)
	}
	unit = bytes.ReplaceAll(unit, []byte("/usr/local/bin/mrfs"), []byte("/bin/true"))
	if err := os.WriteFile(filepath.Join(dir, "mrfs@.service"), unit, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "man", "man8"), 0o755); err != nil {
		t.Fatal(err)
	}
	var man bytes.Buffer
	manPage(&man)
	if err := os.WriteFile(filepath.Join(dir, "man", "man8", "mrfs.8"), man.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(analyze, "verify", filepath.Join(dir, "mrfs@mnt-mr.service"))
	cmd.Env = append(os.Environ(), "MANPATH="+filepath.Join(dir, "man"), "SYSTEMD_LOG_LEVEL=notice")
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
