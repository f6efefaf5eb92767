package tests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// sessionScript is the shell session, made checkable. $M is the
// mountpoint, $CFG the config, $W a scratch dir, $DEV the device. The python step maps rx,
// writes through the mapping and checks its pages are the daemon's.
const sessionScript = `
mrfs mount --config "$CFG" "$M" >"$W/daemon.log" 2>&1 &
pid=$!
echo $pid > "$W/daemon.pid"
trap 'kill -INT $pid 2>/dev/null || true' EXIT
ready=
for i in $(seq 200); do
  kill -0 $pid
  if grep -q " $M " /proc/self/mountinfo && getfattr -n user.mrfs.stats "$M" >/dev/null 2>&1; then ready=1; break; fi
  sleep 0.05
done
test -n "$ready"
x() { getfattr --only-values -n "user.mrfs.$1" "$2"; }

truncate -s 4M "$M/rx"
getfattr -d "$M/rx" > "$W/rx.attrs"
for a in lkey rkey addr length access device pd state zero_copy desc; do
  grep -q "^user.mrfs.$a=" "$W/rx.attrs" || { echo "getfattr -d lacks $a"; cat "$W/rx.attrs"; exit 1; }
done
grep -qx 'user.mrfs.length="4194304"' "$W/rx.attrs"
grep -qx 'user.mrfs.state="registered"' "$W/rx.attrs"
grep -qx "user.mrfs.device=\"$DEV\"" "$W/rx.attrs"
grep -qx 'user.mrfs.access="local_write"' "$W/rx.attrs"

old=$(x rkey "$M/rx")
setfattr -n user.mrfs.access -v local_write,remote_write "$M/rx"
test "$(x access "$M/rx")" = local_write,remote_write
test "$(x rkey "$M/rx")" != "$old"

getfattr -d "$M/rx" > "$W/before"
if setfattr -n user.mrfs.access -v remote_write "$M/rx" 2>"$W/err"; then echo "remote_write alone was accepted"; exit 1; fi
grep -q "Invalid argument" "$W/err"
getfattr -d "$M/rx" > "$W/after"
cmp "$W/before" "$W/after"

echo hello > "$M/msg" && cat "$M/msg" > "$W/cat.out"
test "$(cat "$W/cat.out")" = hello
test "$(stat -c %s "$M/msg")" = 6
test "$(x length "$M/msg")" = 6
test "$(x state "$M/msg")" = registered

cp /bin/ls "$M/" && cmp /bin/ls "$M/ls"

python3 - "$M/rx" $pid <<'EOF'
import ctypes, mmap, os, struct, sys
path, dpid = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 4 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[1 << 20:(1 << 20) + 11] = b"from python"
anchor = ctypes.c_char.from_buffer(m)
base = ctypes.addressof(anchor)
addr = int(os.getxattr(path, "user.mrfs.addr").decode(), 16)
ps = mmap.PAGESIZE
def pfn(pid, va):
    with open("/proc/%d/pagemap" % pid, "rb") as f:
        f.seek(va // ps * 8)
        e = struct.unpack("<Q", f.read(8))[0]
    return e & ((1 << 55) - 1) if e >> 63 else None
for off in (0, 1 << 20, (4 << 20) - ps):
    m[off] = m[off]
    c, d = pfn(os.getpid(), base + off), pfn(dpid, addr + off)
    if not c or c != d:
        sys.exit("offset %#x: client pfn %s, daemon pfn %s: not the registered pages" % (off, c, d))
del anchor
m.close()
os.close(fd)
EOF
test "$(dd if="$M/rx" bs=1 skip=1048576 count=11 status=none)" = "from python"

mkdir "$M/tenant"
test "$(x pd "$M/tenant")" != "$(x pd "$M")"
oldk=$(x rkey "$M/msg")
mv "$M/msg" "$M/tenant/"
test "$(x pd "$M/tenant/msg")" = "$(x pd "$M/tenant")"
test "$(x rkey "$M/tenant/msg")" != "$oldk"
test "$(cat "$M/tenant/msg")" = hello

buffers() { x stats "$M" | python3 -c 'import json, sys; print(json.load(sys.stdin)["buffers"])'; }
n=$(buffers)
rm "$M/rx"
test "$(buffers)" = $((n - 1))
test ! -e "$M/rx"

mrfs status "$M" > "$W/status.out"
grep -q ls "$W/status.out"
grep -q msg "$W/status.out"
if grep -qw rx "$W/status.out"; then echo "status still lists rx"; exit 1; fi

kill -INT %1
# By pid, not %1: a job that has already ended may be gone from the job
# table, while bash keeps a reaped child's status for wait PID.
wait "$pid"
trap - EXIT
echo session-ok
`

// TestShellSession runs the session through bash with set -e (and -x
// for the trace on failure).
func TestShellSession(t *testing.T) {
	t.Parallel()
	requireMountEnv(t)
	w := t.TempDir()
	m := filepath.Join(w, "mr")
	if err := os.Mkdir(m, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(w, "config.toml")
	if err := os.WriteFile(cfg, []byte(daemonConfig{}.toml()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// On a failed script the EXIT trap has just sent SIGINT: give the
		// daemon time to tear down before calling the mount a leftover.
		for deadline := time.Now().Add(stopTimeout); isMounted(m) && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
		}
		if isMounted(m) {
			t.Errorf("%s still mounted after the session", m)
			_ = exec.Command("umount", "-l", m).Run()
		}
		// The daemon is bash's child, not ours: make sure it is gone.
		if b, err := os.ReadFile(filepath.Join(w, "daemon.pid")); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && syscall.Kill(pid, 0) == nil {
				if comm, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm"); strings.TrimSpace(string(comm)) == "mrfs" {
					t.Errorf("the session's daemon (pid %d) is still running; killing it", pid)
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", "set -ex\n"+sessionScript)
	cmd.Env = append(os.Environ(), "M="+m, "CFG="+cfg, "W="+w, "DEV="+backend.device)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	cmd.WaitDelay = 5 * time.Second // a leftover child must not keep Run waiting on the pipes
	err := cmd.Run()
	if err != nil || !strings.Contains(out.String(), "session-ok") {
		log, _ := os.ReadFile(filepath.Join(w, "daemon.log"))
		status, _ := os.ReadFile(filepath.Join(w, "status.out"))
		t.Fatalf("session failed: %v\nstdout:\n%s\ntrace (last lines):\n%s\nmrfs status:\n%s\ndaemon log:\n%s",
			err, out.String(), tail(errb.String(), 40), status, tail(string(log), 40))
	}
	// wait "$pid" returned 0 (set -e): the daemon exited 0 after kill -INT.
	if isMounted(m) {
		t.Errorf("%s still mounted after kill -INT", m)
	}
}

// TestCLIVersionDevices: `mrfs version` and `mrfs devices`.
func TestCLIVersionDevices(t *testing.T) {
	t.Parallel()
	requireMountEnv(t)
	out := mustRun(t, mrfsBin, "version")
	if strings.TrimSpace(out) == "" {
		t.Errorf("mrfs version printed nothing")
	}
	out = mustRun(t, mrfsBin, "devices", "--backend", backend.name)
	if !strings.Contains(out, backend.device) || !strings.Contains(strings.ToLower(out), "max_mr") {
		t.Errorf("mrfs devices lacks %s / max_mr:\n%s", backend.device, out)
	}
}

// TestCLIUsageAndConfigErrors: usage and config errors exit 2, say what is
// wrong, and mount nothing.
func TestCLIUsageAndConfigErrors(t *testing.T) {
	t.Parallel()
	requireMountEnv(t)
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	writeCfg := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	unknownKey := writeCfg("unknown.toml", "[buffers]\nbogus_key = 1\n")
	badSize := writeCfg("badsize.toml", "[buffers]\nmax_pinned = \"12 parsecs\"\n")
	badBackend := writeCfg("badbackend.toml", "[verbs]\nbackend = \"nonsense\"\n")
	badSyntax := writeCfg("syntax.toml", "[buffers\n")
	for _, c := range []struct {
		name    string
		args    []string
		mention string
	}{
		{"no args", nil, ""},
		{"unknown subcommand", []string{"frobnicate"}, "frobnicate"},
		{"mount without mountpoint", []string{"mount"}, ""},
		{"mount with an unknown flag", []string{"mount", "--no-such-flag", mnt}, "no-such-flag"},
		{"mount with a bad --backend", []string{"mount", "--backend", "nonsense", mnt}, "nonsense"},
		{"unknown config key", []string{"mount", "--config", unknownKey, mnt}, "bogus_key"},
		{"bad size", []string{"mount", "--config", badSize, mnt}, "max_pinned"},
		{"bad backend in config", []string{"mount", "--config", badBackend, mnt}, "nonsense"},
		{"config syntax error", []string{"mount", "--config", badSyntax, mnt}, ""},
		{"missing config file", []string{"mount", "--config", filepath.Join(dir, "absent.toml"), mnt}, "absent.toml"},
		{"status without mountpoint", []string{"status"}, ""},
		{"umount without mountpoint", []string{"umount"}, ""},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, mrfsBin, c.args...)
		cmd.WaitDelay = 5 * time.Second
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		cancel()
		if isMounted(mnt) {
			t.Errorf("%s: mrfs %v mounted %s", c.name, c.args, mnt)
			_ = exec.Command("umount", "-l", mnt).Run()
		}
		if code := exitCode(err); code != 2 {
			t.Errorf("%s: mrfs %v exited %d (%v), want 2; stderr: %s", c.name, c.args, code, err, stderr.String())
			continue
		}
		if strings.TrimSpace(stderr.String()) == "" {
			t.Errorf("%s: mrfs %v exited 2 with nothing on stderr", c.name, c.args)
		}
		if c.mention != "" && !strings.Contains(stderr.String(), c.mention) {
			t.Errorf("%s: stderr does not name %q: %s", c.name, c.mention, stderr.String())
		}
	}
}

// TestFuseRequestLog: with log.fuse_requests the daemon logs every FUSE
// request it receives. With zero copy, writing, reading and mapping a
// file send it no READ or WRITE (the kernel passes them through to the
// backing file); in the degraded mode each read(2) and write(2) does.
func TestFuseRequestLog(t *testing.T) {
	t.Parallel()
	rx := regexp.MustCompile(`msg="rx [0-9]+: ([A-Z_0-9]+) .* fuse=true`)
	count := func(d *daemon) map[string]int {
		n := map[string]int{}
		for _, m := range rx.FindAllStringSubmatch(d.stderr.String(), -1) {
			n[m[1]]++
		}
		return n
	}
	// The log arrives through a pipe, a moment after the reply.
	waitFor := func(d *daemon, op string) map[string]int {
		for deadline := time.Now().Add(readyTimeout); ; time.Sleep(10 * time.Millisecond) {
			if n := count(d); n[op] > 0 || time.Now().After(deadline) {
				return n
			}
		}
	}
	for _, zc := range []bool{true, false} {
		d := startDaemon(t, daemonConfig{Mount: fmt.Sprintf("zero_copy = %v", zc), Log: "fuse_requests = true"})
		f := d.path("f")
		if err := os.WriteFile(f, []byte("hello"), 0o600); err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(f); err != nil || string(b) != "hello" {
			t.Fatalf("read back %q, %v", b, err)
		}
		if zc {
			fh, err := os.OpenFile(f, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			m, err := unix.Mmap(int(fh.Fd()), 0, 5, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			if err != nil {
				t.Fatal(err)
			}
			m[0] = 'j'
			munmap(m)
			fh.Close()
			mustXattr(t, f, xState) // a request it does get, last
			// Its own line: the daemon's log of the requests startDaemon
			// made holds GETXATTRs too, and the lines come through a pipe.
			last := regexp.MustCompile(`rx [0-9]+: GETXATTR n[0-9]+ .*` + regexp.QuoteMeta(xState))
			if _, ok := d.waitLog(last, readyTimeout); !ok {
				t.Fatalf("zero copy: the request log lacks the last GETXATTR:\n%s", tail(d.stderr.String(), 20))
			}
			n := count(d)
			if n["GETXATTR"] == 0 || n["CREATE"] == 0 {
				t.Fatalf("zero copy: the request log lacks the CREATE and GETXATTR the test sent: %v", n)
			}
			if n["READ"] != 0 || n["WRITE"] != 0 {
				t.Errorf("zero copy: the daemon received %d READ and %d WRITE requests, want none: %v", n["READ"], n["WRITE"], n)
			}
			continue
		}
		if n := waitFor(d, "READ"); n["READ"] == 0 || n["WRITE"] == 0 {
			t.Errorf("degraded mode: the request log shows no READ or WRITE for a read(2) and a write(2): %v", n)
		}
	}
}

// TestFuseRequestLogSecrets: the request log shows requests and the
// sizes of their data, never the data: reading a directory's token, a
// file's desc and listing them, and a setxattr whose value is a token,
// leave no 8 hex digits of either token in the daemon's log, nor a
// file's bytes written in degraded mode, while the GETXATTR, SETXATTR
// and LISTXATTR requests themselves and the names they ask for are
// logged.
func TestFuseRequestLogSecrets(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "zero_copy = false", Log: "fuse_requests = true"})
	dir, f := d.path("tenant"), d.path("tenant", "f")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f, []byte("file bytes, private"), 0o600); err != nil {
		t.Fatal(err)
	}
	mustSetxattr(t, f, xAccess, "local_write,remote_read")
	tok := mustXattr(t, dir, xToken)
	mustXattr(t, f, xDesc)
	if _, err := listxattr(dir); err != nil {
		t.Fatal(err)
	}
	written := "fedcba9876543210fedcba9876543210"
	wantErrno(t, setxattr(dir, xToken, written), unix.EPERM, "set "+xToken)
	mustXattr(t, d.mnt, xPD) // the last request: its line comes after the others'
	// The text log quotes msg, so go-fuse's quotes arrive as \".
	quoted := func(name string) string { return `\\"` + regexp.QuoteMeta(name) + `\\"` }
	marker := regexp.MustCompile(`rx [0-9]+: GETXATTR n1 .*` + quoted(xPD))
	if _, ok := d.waitLog(marker, readyTimeout); !ok {
		t.Fatalf("the request log lacks the last GETXATTR:\n%s", tail(d.stderr.String(), 20))
	}
	log := d.stderr.String()
	for _, secret := range []string{tok, written} {
		for i := 0; i+8 <= len(secret); i++ {
			if strings.Contains(log, secret[i:i+8]) {
				t.Errorf("the log holds %q of the token %s:\n%s", secret[i:i+8], secret, grepLines(log, secret[i:i+8]))
				break
			}
		}
	}
	if strings.Contains(log, "file byt") || strings.Contains(log, "local_wr") {
		t.Errorf("the log holds a file's bytes or an xattr's value:\n%s", grepLines(log, "file byt", "local_wr"))
	}
	for _, re := range []string{
		`rx [0-9]+: GETXATTR n[0-9]+ .*` + quoted(xToken),
		`rx [0-9]+: GETXATTR n[0-9]+ .*` + quoted(xDesc),
		`rx [0-9]+: SETXATTR n[0-9]+ .*` + quoted(xToken) + ` 32b `,
		`rx [0-9]+: LISTXATTR n[0-9]+ `,
		`rx [0-9]+: WRITE n[0-9]+ .* 19b `,
		`tx [0-9]+: +OK, +32b data" fuse=true`, // the token's reply, its size alone
	} {
		if !regexp.MustCompile(re).MatchString(log) {
			t.Errorf("the request log lacks %s:\n%s", re, tail(log, 40))
		}
	}
}

// grepLines is the lines of log that hold any of subs.
func grepLines(log string, subs ...string) string {
	var out []string
	for _, l := range strings.Split(log, "\n") {
		for _, s := range subs {
			if strings.Contains(l, s) {
				out = append(out, l)
				break
			}
		}
	}
	return strings.Join(out, "\n")
}
