package tests

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// nobody is the unprivileged user the non-root test runs mrfs as.
const nobody = "65534"

// asNobody runs argv as uid/gid 65534 with no capabilities.
func asNobody(argv ...string) *exec.Cmd {
	return exec.Command("setpriv", append([]string{"--reuid=" + nobody, "--regid=" + nobody, "--clear-groups", "--"}, argv...)...)
}

// TestNonRoot: as an ordinary user (mounting through fusermount3), mrfs
// refuses to start without passthrough, saying why and what to do, and
// leaves no mount; with mount.zero_copy = false it runs, the mount's root
// belongs to that user, who creates, writes, reads and unmounts.
func TestNonRoot(t *testing.T) {
	requireMountEnv(t)
	if _, err := exec.LookPath("fusermount3"); err != nil {
		t.Skip("fusermount3 not installed (scripts/test installs fuse3): non-root mounts need it")
	}
	// Distributions ship /dev/fuse as 0666; some sandboxes as 0600, where
	// no user but root could mount at all.
	st, err := os.Stat("/dev/fuse")
	if err != nil {
		t.Fatal(err)
	}
	if mode := st.Mode().Perm(); mode&0o006 != 0o006 {
		if err := os.Chmod("/dev/fuse", mode|0o006); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Chmod("/dev/fuse", mode) })
	}

	// Everything the user touches must be reachable by it: not under
	// the test's 0700 temporary directories.
	dir, err := os.MkdirTemp("", "mrfs-nonroot-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "mrfs")
	data, err := os.ReadFile(mrfsBin)
	if err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(dir, "mnt")
	degraded := filepath.Join(dir, "degraded.toml")
	for _, step := range []error{
		os.Chmod(dir, 0o755),
		os.WriteFile(bin, data, 0o755),
		os.WriteFile(degraded, []byte("[mount]\nzero_copy = false\n"), 0o644),
		os.Mkdir(mnt, 0o755),
		exec.Command("chown", nobody+":"+nobody, mnt).Run(),
	} {
		if step != nil {
			t.Fatal(step)
		}
	}

	// Passthrough needs CAP_SYS_ADMIN: refused, with the way out.
	out, err := asNobody(bin, "mount", mnt).CombinedOutput()
	if exitCode(err) != 1 || !strings.Contains(string(out), "passthrough") || !strings.Contains(string(out), "zero_copy = false") {
		t.Errorf("non-root mount with zero copy: exit %d, output:\n%s\nwant exit 1 naming passthrough and mount.zero_copy = false", exitCode(err), out)
	}
	if isMounted(mnt) {
		exec.Command("umount", "-l", mnt).Run()
		t.Fatal("the refused mount was left behind")
	}

	// Degraded mode works for the user who mounts.
	var stderr bytes.Buffer
	daemon := asNobody(bin, "mount", "--config", degraded, mnt)
	daemon.Stderr = &stderr
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- daemon.Wait() }()
	t.Cleanup(func() {
		if isMounted(mnt) {
			exec.Command("umount", "-l", mnt).Run()
		}
		daemon.Process.Kill()
	})
	deadline := time.Now().Add(10 * time.Second)
	for !isMounted(mnt) {
		if time.Now().After(deadline) {
			t.Fatalf("non-root degraded mount did not appear:\n%s", stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	f := filepath.Join(mnt, "f")
	script := `set -e
echo hello > "$1"
test "$(cat "$1")" = hello
truncate -s 64K "$1"
test "$(getfattr --only-values -n user.mrfs.state "$1")" = registered
test "$(stat -c %U "$2")" = nobody
if "$3" pool "$2/p" --slot 64KiB --slots 2; then echo a pool was made without CAP_SYS_ADMIN; exit 1; fi
"$3" umount "$2"`
	if out, err := asNobody("sh", "-c", script, "sh", f, mnt, bin).CombinedOutput(); err != nil {
		t.Fatalf("as the mounting user: %v\n%s\ndaemon:\n%s", err, out, stderr.String())
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("daemon after umount: %v\n%s", err, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("daemon did not exit after mrfs umount:\n%s", stderr.String())
	}
	if isMounted(mnt) {
		t.Error("still mounted after mrfs umount")
	}
	// Without CAP_SYS_ADMIN there is no private tmpfs: memfds, and the
	// log says what that costs.
	if !strings.Contains(stderr.String(), "backing store: memfds") || !strings.Contains(stderr.String(), "CAP_SYS_ADMIN") {
		t.Errorf("the degraded daemon does not say it uses memfds:\n%s", stderr.String())
	}
	if !strings.Contains(stderr.String(), "cannot make a pool: a client's open of a pool file reopens its slot") {
		t.Errorf("the degraded daemon does not say why it made no pool:\n%s", stderr.String())
	}
}
