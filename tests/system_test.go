package tests

import (
	"bytes"
	"fmt"
	"io"
	"net"
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

// bgMount is a mount whose daemon is in the background (--daemon, or
// mount(8) through mount.fuse3): not the test's child, so the test
// follows it through its log file, which the config names.
type bgMount struct {
	t       *testing.T
	dir     string
	mnt     string
	cfgPath string
	logPath string
}

// newBgMount prepares a mount point and a config whose log.output is a
// file; cfg's Log is replaced. The cleanup stops a daemon left running.
func newBgMount(t *testing.T, cfg daemonConfig) *bgMount {
	t.Helper()
	requireMountEnv(t)
	dir := t.TempDir()
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	m := &bgMount{t: t, dir: dir, mnt: filepath.Join(dir, "mnt"), cfgPath: filepath.Join(dir, "config.toml"), logPath: filepath.Join(dir, "daemon.log")}
	cfg.Log = fmt.Sprintf("output = %q", m.logPath)
	if err := os.Mkdir(m.mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(m.cfgPath, []byte(cfg.toml()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.cleanup)
	return m
}

func (m *bgMount) log() string {
	b, _ := os.ReadFile(m.logPath)
	return string(b)
}

// pids are the daemons the log says were mounted.
func (m *bgMount) pids() []int {
	var pids []int
	for _, match := range regexp.MustCompile(`msg=mounted .* pid=(\d+)`).FindAllStringSubmatch(m.log(), -1) {
		pid, _ := strconv.Atoi(match[1])
		pids = append(pids, pid)
	}
	return pids
}

func (m *bgMount) pid() int {
	m.t.Helper()
	pids := m.pids()
	if len(pids) == 0 {
		m.t.Fatalf("the daemon's log has no mounted line:\n%s", m.log())
	}
	return pids[len(pids)-1]
}

// waitLog waits for a line of the daemon's log matching re.
func (m *bgMount) waitLog(re *regexp.Regexp) string {
	m.t.Helper()
	deadline := time.Now().Add(stopTimeout)
	for {
		if line := re.FindString(m.log()); line != "" {
			return line
		}
		if time.Now().After(deadline) {
			m.t.Fatalf("no log line matching %v after %v:\n%s", re, stopTimeout, m.log())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// procStat is the fields of /proc/PID/stat after the command's name
// (the state first), nil for a process that is gone.
func procStat(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	s := string(b)
	return strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
}

// procState is the state letter of /proc/PID/stat ("Z" for a zombie),
// "" for a process that is gone.
func procState(pid int) string {
	f := procStat(pid)
	if f == nil {
		return ""
	}
	if len(f) < 1 {
		return "?"
	}
	return f[0]
}

func running(pid int) bool { st := procState(pid); return st != "" && st != "Z" }

func (m *bgMount) cleanup() {
	for _, pid := range m.pids() {
		if !running(pid) {
			continue
		}
		m.t.Errorf("the daemon (pid %d) is still running at the end of the test", pid)
		_ = syscall.Kill(pid, syscall.SIGTERM)
		for deadline := time.Now().Add(stopTimeout); running(pid) && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	for isMounted(m.mnt) {
		m.t.Errorf("%s is still mounted at the end of the test", m.mnt)
		if exec.Command("umount", "-l", m.mnt).Run() != nil {
			break
		}
	}
	if m.t.Failed() {
		m.t.Logf("daemon log:\n%s", tail(m.log(), 40))
	}
}

var (
	exitedOK   = regexp.MustCompile(`msg="daemon exiting" status=0`)
	teardownRe = regexp.MustCompile(`msg="teardown complete" deregistered_regions=(\d+)`)
)

// requireTornDown checks the log's account of a teardown that
// deregistered n regions (buffers with bytes) and ended with status 0.
func (m *bgMount) requireTornDown(n int) {
	m.t.Helper()
	m.waitLog(exitedOK)
	if got := teardownRe.FindStringSubmatch(m.log()); got == nil || got[1] != strconv.Itoa(n) {
		m.t.Errorf("teardown deregistered %v regions, want %d:\n%s", got, n, m.log())
	}
}

// TestDaemonFlag: `mrfs mount --daemon` returns 0 once the mount answers,
// having let go of the caller's stdout and stderr, with the daemon in its
// own session; `mrfs umount` returns once that daemon has torn down and
// exited.
func TestDaemonFlag(t *testing.T) {
	t.Parallel()
	m := newBgMount(t, daemonConfig{})
	cmd := exec.Command(mrfsBin, "mount", "--daemon", "--config", m.cfgPath, m.mnt)
	// The daemon stays after its teardown until told to go on, so that
	// `mrfs umount` is seen waiting for it.
	cmd.Env = append(os.Environ(), "MRFS_TEST_PAUSE_AFTER_TEARDOWN=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The command's own exit, as mount(8) waits for it (not its pipes').
	state, err := cmd.Process.Wait()
	if err != nil || state.ExitCode() != 0 {
		t.Fatalf("mrfs mount --daemon: %v, %v", err, state)
	}
	// Ready means usable, at once.
	if !isMounted(m.mnt) {
		t.Fatalf("mrfs mount --daemon exited 0 before %s was mounted", m.mnt)
	}
	if _, err := getxattr(m.mnt, xStats); err != nil {
		t.Fatalf("mrfs mount --daemon exited 0 before the mount answered: %v", err)
	}
	// And the daemon let go of the caller's stderr (a pipe whose reader
	// would wait for its end, like a shell's $(...)).
	letGo(t, stderr, "mrfs mount --daemon")
	pid := m.pid()
	if sid, err := unix.Getsid(pid); err != nil || sid != pid {
		t.Errorf("daemon %d is in session %d (%v), want its own", pid, sid, err)
	}
	// Out of the caller's working directory, which may be unmounted.
	if cwd, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd"); err != nil || cwd != "/" {
		t.Errorf("daemon %d works in %q (%v), want /", pid, cwd, err)
	}
	const n = 64
	for i := range n {
		makeBuffer(t, filepath.Join(m.mnt, "b"+strconv.Itoa(i)), 256<<10)
	}

	umount := exec.Command(mrfsBin, "umount", m.mnt)
	var umountOut bytes.Buffer
	umount.Stdout, umount.Stderr = &umountOut, &umountOut
	if err := umount.Start(); err != nil {
		t.Fatal(err)
	}
	returned := make(chan error, 1)
	go func() { returned <- umount.Wait() }()
	m.waitLog(regexp.MustCompile(`msg="paused after teardown`))
	// The daemon has torn down but not exited: umount must still wait.
	select {
	case err := <-returned:
		t.Fatalf("mrfs umount returned (%v) while the daemon was still there: %s", err, umountOut.String())
	case <-time.After(time.Second):
	}
	if err := unix.Kill(pid, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := <-returned; err != nil {
		t.Fatalf("mrfs umount: %v\n%s", err, umountOut.String())
	}
	// Returned once the daemon exited (a zombie until init reaps it),
	// not merely once the kernel detached the mount.
	if running(pid) || !exitedOK.MatchString(m.log()) {
		t.Errorf("mrfs umount returned while the daemon (state %q) was still tearing down; log:\n%s", procState(pid), tail(m.log(), 5))
	}
	m.requireTornDown(n)
}

// TestDaemonFlagKeeper: `mrfs mount --daemon --keeper` returns 0 once
// the mount answers, the keeper and its daemon both off the caller's
// stderr, the keeper in its own session; a SIGKILL of the daemon is
// survived (the keeper starts another, which takes the mount over; what
// both say is in the log); `mrfs umount` ends the daemon and the keeper.
func TestDaemonFlagKeeper(t *testing.T) {
	t.Parallel()
	m := newBgMount(t, daemonConfig{})
	cmd := exec.Command(mrfsBin, "mount", "--daemon", "--keeper", "--config", m.cfgPath, m.mnt)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Ready or failed, it returns: a readiness that nobody passes on
	// would keep it waiting.
	hung := time.AfterFunc(readyTimeout, func() { cmd.Process.Kill() })
	state, err := cmd.Process.Wait()
	hung.Stop()
	if err != nil || state.ExitCode() != 0 {
		t.Fatalf("mrfs mount --daemon --keeper: %v, %v", err, state)
	}
	if _, err := getxattr(m.mnt, xStats); err != nil {
		t.Fatalf("mrfs mount --daemon --keeper exited 0 before the mount answered: %v", err)
	}
	if !letGo(t, stderr, "mrfs mount --daemon --keeper") {
		t.FailNow()
	}
	pid := readStats(t, m.mnt).PID
	keeper := procParent(pid)
	if sid, err := unix.Getsid(keeper); err != nil || sid != keeper {
		t.Errorf("the keeper %d (the daemon %d's parent) is in session %d (%v), want its own", keeper, pid, sid, err)
	}
	if cwd, err := os.Readlink("/proc/" + strconv.Itoa(keeper) + "/cwd"); err != nil || cwd != "/" {
		t.Errorf("the keeper %d works in %q (%v), want /", keeper, cwd, err)
	}

	f := filepath.Join(m.mnt, "kept")
	want := patternBytes(256 << 10)
	if err := os.WriteFile(f, want, 0o644); err != nil {
		t.Fatal(err)
	}
	killDaemonAt(t, m.mnt)
	if got, err := os.ReadFile(f); err != nil || !bytes.Equal(got, want) {
		t.Errorf("a file read after the daemon's crash: %v (%d bytes)", err, len(got))
	}
	next := readStats(t, m.mnt).PID
	if procParent(next) != keeper {
		t.Errorf("the daemon %d after the crash is the child of %d, want the keeper %d", next, procParent(next), keeper)
	}
	// The keeper's account and the new daemon's log go where the first
	// daemon's went, not to a stderr nobody reads.
	m.waitLog(regexp.MustCompile(`keeper: the daemon died; starting another`))
	m.waitLog(regexp.MustCompile(`pid=` + strconv.Itoa(next) + `\b`))

	if out, err := exec.Command(mrfsBin, "umount", m.mnt).CombinedOutput(); err != nil {
		t.Fatalf("mrfs umount: %v\n%s", err, out)
	}
	for deadline := time.Now().Add(stopTimeout); running(keeper); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the keeper %d still runs %v after the unmount", keeper, stopTimeout)
		}
	}
	if isMounted(m.mnt) {
		t.Errorf("%s is mounted after mrfs umount", m.mnt)
	}
	// The daemon started again is in the background too: its last line
	// is in the log (where the keeper's is).
	if n := len(exitedOK.FindAllString(m.log(), -1)); n != 2 {
		t.Errorf("the log says %d times that a program exited 0, want 2 (the keeper and the last daemon)", n)
	}
}

// letGo says whether what cmd (a command that went to the background)
// left running let go of the caller's stderr within stopTimeout, having
// written nothing to it; it fails the test otherwise.
func letGo(t *testing.T, stderr io.Reader, cmd string) bool {
	t.Helper()
	released := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(stderr); released <- b }()
	select {
	case b := <-released:
		if len(b) > 0 {
			t.Errorf("%s wrote %q", cmd, b)
		}
		return true
	case <-time.After(stopTimeout):
		t.Errorf("what %s left running still holds the caller's stderr", cmd)
		return false
	}
}

// procParent is the parent of process pid (0 when it is gone).
func procParent(pid int) int {
	f := procStat(pid)
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// TestDaemonFlagStoppedWhileMounting: SIGTERM to `mrfs mount --daemon`
// while its child is mounting reaches the child, which tears down: the
// command is not killed, and nothing stays mounted. The child is held in
// its mount by a mount point inside a stopped daemon's mount. (Whether
// the child sees the signal before it would report ready depends on when
// its blocked thread takes it: the command then fails, "stopped before
// its mount was ready", or succeeds and the daemon stops at once.)
func TestDaemonFlagStoppedWhileMounting(t *testing.T) {
	t.Parallel()
	// SIGHUP, a terminal's hangup, reaches the child as SIGTERM: in its
	// own session it handles only INT and TERM.
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGHUP} {
		t.Run(sig.String(), func(t *testing.T) { testStoppedWhileMounting(t, sig) })
	}
}

func testStoppedWhileMounting(t *testing.T, sig syscall.Signal) {
	outer := startDaemon(t, daemonConfig{})
	target := outer.path("sub")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	m := newBgMount(t, daemonConfig{})
	if err := outer.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			_ = outer.cmd.Process.Signal(syscall.SIGCONT)
		}
	}
	defer resume()
	var stderr syncBuffer
	cmd := exec.Command(mrfsBin, "mount", "--daemon", "--config", m.cfgPath, target)
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// The child logs its backend after it subscribed to signals, just
	// before it looks at the mount point and blocks.
	m.waitLog(regexp.MustCompile(`msg="verbs backend`))
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	resume()
	var err error
	select {
	case err = <-exited:
	case <-time.After(stopTimeout):
		t.Fatalf("mrfs mount --daemon did not return within %v of %v", stopTimeout, sig)
	}
	switch code := exitCode(err); {
	case code == 1 && strings.Contains(stderr.String(), "stopped before its mount was ready"):
	case code == 0:
	default:
		t.Fatalf("mrfs mount --daemon after %v while mounting: %v (exit %d), stderr %q; want it to pass the signal on", sig, err, code, stderr.String())
	}
	m.waitLog(regexp.MustCompile(`msg="teardown complete"`))
	for _, pid := range m.pids() { // it exits right after
		for deadline := time.Now().Add(stopTimeout); running(pid) && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if !strings.Contains(m.log(), `msg="shutting down" signal=terminated`) {
		t.Errorf("the daemon did not stop on the %v as on SIGTERM:\n%s", sig, m.log())
	}
	if isMounted(target) {
		t.Errorf("%s is mounted after the teardown", target)
	}
}

// TestMrfsUmountLazyReturns: with --lazy, `mrfs umount` does not wait for
// the daemon, which serves an open file until it is closed.
func TestMrfsUmountLazyReturns(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	makeBuffer(t, d.path("held"), 4096)
	f, err := os.Open(d.path("held"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if out, errOut, err := run(t, mrfsBin, "umount", "--lazy", d.mnt); err != nil {
		t.Fatalf("mrfs umount --lazy with a file open: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	if d.exited() {
		t.Errorf("the daemon exited while a file of its mount was open")
	}
	f.Close()
	if code := d.waitExit(); code != 0 {
		t.Errorf("daemon exit status once the file was closed = %d, want 0", code)
	}
}

// TestMrfsUmountBusy: `mrfs umount` of a mount with a file open fails,
// saying to close it or use --lazy, and the mount goes on serving; a file
// closed while it tries (a holder gone within a moment, such as a child
// between its fork and its exec) does not fail it.
func TestMrfsUmountBusy(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	makeBuffer(t, d.path("held"), 4096)
	f, err := os.Open(d.path("held"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, errOut, err := run(t, mrfsBin, "umount", d.mnt); err == nil || !strings.Contains(errOut, "--lazy") {
		t.Fatalf("mrfs umount with a file open: %v, stderr %q; want a failure that names --lazy", err, errOut)
	}
	if _, err := os.Stat(d.path("held")); err != nil || d.exited() {
		t.Fatalf("the mount after a refused unmount: %v (daemon exited: %v)", err, d.exited())
	}
	time.AfterFunc(300*time.Millisecond, func() { f.Close() })
	if out, errOut, err := run(t, mrfsBin, "umount", d.mnt); err != nil {
		t.Fatalf("mrfs umount while the last open file was closed: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	if code := d.waitExit(); code != 0 {
		t.Errorf("daemon exit status after mrfs umount = %d, want 0", code)
	}
}

// TestDaemonFlagFailures: a failure before the mount is ready comes back
// from `mrfs mount --daemon` as its status and message; nothing stays.
func TestDaemonFlagFailures(t *testing.T) {
	t.Parallel()
	m := newBgMount(t, daemonConfig{})
	file := filepath.Join(m.dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(m.dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("[log]\noutput = \"relative.log\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args    []string
		code    int
		mention string
	}{
		// In the child, after it started: the parent reports its status.
		{[]string{"mount", "-d", "--config", m.cfgPath, file}, 1, "not a directory"},
		{[]string{"mount", "--daemon", "--config", m.cfgPath, filepath.Join(m.dir, "absent")}, 1, "absent"},
		// Before the child: usage and configuration.
		{[]string{"mount", "--daemon", "--config", bad, m.mnt}, 2, "log.output"},
		{[]string{"mount", "--daemon", "-o", "backend=" + backend.name + ",frob", m.mnt}, 2, "frob"},
	} {
		_, errOut, err := run(t, mrfsBin, c.args...)
		if code := exitCode(err); code != c.code || !strings.Contains(errOut, c.mention) {
			t.Errorf("mrfs %q: exit %d (%v), stderr %q; want %d mentioning %q", c.args, code, err, errOut, c.code, c.mention)
		}
		if isMounted(m.mnt) {
			t.Errorf("mrfs %q left a mount", c.args)
		}
	}
	if pids := m.pids(); len(pids) > 0 {
		t.Errorf("a failed --daemon mounted (pids %v)", pids)
	}
}

// TestMountFuse3Helper: mount.fuse3, as mount(8) runs it for type
// fuse.mrfs, starts `mrfs SOURCE MOUNTPOINT -o OPTIONS` (found on PATH):
// SOURCE is the config, the options apply over it, the source shows in
// mountinfo, and umount(8) makes the daemon tear down as SIGTERM does.
func TestMountFuse3Helper(t *testing.T) {
	t.Parallel()
	m := newBgMount(t, daemonConfig{Buffers: "max_buffers = 100"})
	out, errOut, err := run(t, "mount.fuse3", m.cfgPath, m.mnt, "-t", "fuse.mrfs", "-o", "rw,allow_other,buffers.max_buffers=2,nofail,x-systemd.automount")
	if err != nil {
		t.Fatalf("mount.fuse3: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	info := mountinfoLine(t, m.mnt)
	if !strings.Contains(info, " - fuse.mrfs "+m.cfgPath+" ") || !strings.Contains(info, "allow_other") {
		t.Errorf("mountinfo: %s; want type fuse.mrfs, source %s, allow_other", info, m.cfgPath)
	}
	if s := readStats(t, m.mnt); s.Limits.MaxBuffers != 2 {
		t.Errorf("max_buffers = %d, want the option's 2 over the config's 100", s.Limits.MaxBuffers)
	}
	makeBuffer(t, filepath.Join(m.mnt, "a"), 1<<20)
	makeBuffer(t, filepath.Join(m.mnt, "b"), 0)
	pid := m.pid()

	if out, err := exec.Command("umount", m.mnt).CombinedOutput(); err != nil {
		t.Fatalf("umount: %v\n%s", err, out)
	}
	m.requireTornDown(1) // b is empty: no region
	for deadline := time.Now().Add(stopTimeout); running(pid) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if running(pid) {
		t.Errorf("the daemon still runs after umount(8) and its last log line")
	}

	out, errOut, err = run(t, "mount.fuse3", "none", m.mnt, "-t", "fuse.mrfs", "-o", "backend="+backend.name+",frobnicate")
	if exitCode(err) != 2 || !strings.Contains(errOut, `"frobnicate"`) || isMounted(m.mnt) {
		t.Errorf("an unknown option: %v (exit %d), mounted %v; stderr %q", err, exitCode(err), isMounted(m.mnt), errOut+out)
	}
}

func mountinfoLine(t *testing.T, mnt string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && unescapeMountinfo(f[4]) == mnt {
			return l
		}
	}
	t.Fatalf("%s is not in mountinfo", mnt)
	return ""
}

// TestMountCommandAndFstab: mount(8) and an fstab line (with the
// everyday noatime, nodiratime, lazytime, relatime), in a mount
// namespace of their own. mount(8) runs its helpers with an empty PATH,
// so the helper's shell looks in the default path: there (on
// /usr/local/sbin, in that namespace only) is the mrfs under test.
func TestMountCommandAndFstab(t *testing.T) {
	t.Parallel()
	m := newBgMount(t, daemonConfig{})
	fstab := filepath.Join(m.dir, "fstab")
	opts := "defaults,noatime,nodiratime,lazytime,nofail,_netdev,x-systemd.requires=network-online.target,backend=" + backend.name + ",allow_other"
	if err := os.WriteFile(fstab, []byte(fmt.Sprintf("%s %s fuse.mrfs %s 0 0\n", m.cfgPath, m.mnt, opts)), 0o644); err != nil {
		t.Fatal(err)
	}
	script := `
set -eu
trap '{ umount -l "$M"; umount -l "$M"; } 2>/dev/null || true' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mounts() { grep -c " $M .* - fuse.mrfs " /proc/self/mountinfo || true; }
exited() { # the nth "daemon exiting" line, within 10 s
  for i in $(seq 1000); do
    [ "$(grep -c 'msg="daemon exiting" status=0' "$LOG")" -ge "$1" ] && return 0
    sleep 0.01
  done
  fail "no daemon exiting line $1 with status 0"
}
mount --bind "$BIN" /usr/local/sbin

mount -t fuse.mrfs "$CFG" "$M" -o relatime,backend=$BACKEND,buffers.max_buffers=7 || fail "mount -t fuse.mrfs: $?"
[ "$(mounts)" = 1 ] || fail "not mounted once"
getfattr --absolute-names --only-values -n user.mrfs.stats "$M" | grep -q '"max_buffers":7' || fail "option not applied"
truncate -s 1M "$M/buf"
getfattr --absolute-names --only-values -n user.mrfs.rkey "$M/buf" | grep -q '^0x' || fail "no rkey"
umount "$M"
exited 1
[ "$(mounts)" = 0 ] || fail "still mounted after umount"

mount -a -T "$FSTAB" || fail "mount -a: $?"
mount -a -T "$FSTAB" || fail "second mount -a: $?"
[ "$(mounts)" = 1 ] || fail "mount -a twice: $(mounts) mounts, want 1"
grep " $M " /proc/self/mountinfo | grep -q allow_other || fail "fstab options not applied"
umount "$M"
exited 2
mount -T "$FSTAB" "$M" || fail "mount by mount point: $?"
[ "$(mounts)" = 1 ] || fail "not mounted from fstab"
umount "$M"
exited 3

if mount -t fuse.mrfs none "$M" -o backend=$BACKEND,frobnicate 2>"$W/err"; then fail "an unknown option mounted"; fi
grep -q frobnicate "$W/err" || fail "the error does not name the option: $(cat "$W/err")"
[ "$(mounts)" = 0 ] || fail "mounted despite the unknown option"
echo ALL-OK
`
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "bash", "-c", script)
	cmd.Env = append(os.Environ(), "M="+m.mnt, "CFG="+m.cfgPath, "LOG="+m.logPath, "FSTAB="+fstab, "BIN="+binDir, "W="+m.dir, "BACKEND="+backend.name)
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(cmdTimeout):
		_ = cmd.Process.Kill()
		<-done
	}
	if err != nil || !strings.Contains(string(out), "ALL-OK") {
		t.Fatalf("mount(8) session: %v\n%s", err, out)
	}
	if got := len(regexp.MustCompile(`msg="teardown complete" deregistered_regions=1 `).FindAllString(m.log(), -1)); got != 1 {
		t.Errorf("the first mount's teardown did not deregister its buffer:\n%s", m.log())
	}
}

// TestSystemdNotify plays systemd for a Type=notify service: it starts
// mrfs mount with NOTIFY_SOCKET set and checks that READY=1 comes from the
// daemon's own pid once the mount is there and answers (checked as each
// datagram arrives), and STOPPING=1 at SIGTERM, before the exit.
func TestSystemdNotify(t *testing.T) {
	t.Parallel()
	requireMountEnv(t)
	dir := t.TempDir()
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	mnt, cfg, sock := filepath.Join(dir, "mnt"), filepath.Join(dir, "config.toml"), filepath.Join(dir, "notify")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg, []byte(daemonConfig{}.toml()), 0o644); err != nil {
		t.Fatal(err)
	}
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// Credentials on each datagram, as systemd reads them for
	// NotifyAccess=main.
	raw, err := conn.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	raw.Control(func(fd uintptr) { err = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_PASSCRED, 1) })
	if err != nil {
		t.Fatal(err)
	}

	type note struct {
		state    string
		pid      int32
		mounted  bool // the mount was in mountinfo when it arrived
		answered bool // and its root answered
	}
	notes := make(chan note, 16)
	go func() {
		defer close(notes)
		buf, oob := make([]byte, 4096), make([]byte, 1024)
		for {
			n, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			nt := note{state: string(buf[:n]), mounted: isMounted(mnt)}
			_, serr := getxattr(mnt, xStats)
			nt.answered = serr == nil
			if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) > 0 {
				if cred, err := syscall.ParseUnixCredentials(&msgs[0]); err == nil {
					nt.pid = cred.Pid
				}
			}
			notes <- nt
		}
	}()

	stderr := &syncBuffer{}
	cmd := exec.Command(mrfsBin, "mount", "--config", cfg, mnt)
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+sock)
	cmd.Stdout, cmd.Stderr = stderr, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
		}
		if isMounted(mnt) {
			_ = exec.Command("umount", "-l", mnt).Run()
		}
		if t.Failed() {
			t.Logf("mrfs mount stderr:\n%s", tail(stderr.String(), 40))
		}
	})
	pid := int32(cmd.Process.Pid)

	var ready note
	select {
	case ready = <-notes:
	case err := <-exited:
		t.Fatalf("mrfs mount exited before READY=1: %v", err)
	case <-time.After(readyTimeout):
		t.Fatalf("no READY=1 within %v", readyTimeout)
	}
	if !strings.Contains(ready.state, "READY=1") || !ready.mounted || !ready.answered || ready.pid != pid {
		t.Fatalf("first notification %+v; want READY=1 from pid %d, with the mount there and answering", ready, pid)
	}
	makeBuffer(t, filepath.Join(mnt, "buf"), 1<<20)
	select {
	case nt := <-notes:
		t.Errorf("a notification before any stop: %+v", nt)
	default:
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("exit after SIGTERM: %v, want status 0", err)
		}
	case <-time.After(stopTimeout):
		t.Fatalf("mrfs mount did not exit within %v of SIGTERM", stopTimeout)
	}
	conn.SetReadDeadline(time.Now()) // what it sent is queued by now
	stopping, ok := <-notes
	if !ok || stopping.state != "STOPPING=1" || stopping.pid != pid {
		t.Errorf("after SIGTERM: %+v, want STOPPING=1 from pid %d", stopping, pid)
	}
	if nt, ok := <-notes; ok {
		t.Errorf("a notification after STOPPING=1: %+v", nt)
	}
	if isMounted(mnt) {
		t.Errorf("%s still mounted after SIGTERM", mnt)
	}
}
