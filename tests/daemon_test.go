package tests

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// syncBuffer collects a subprocess's output while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// daemonConfig is the per-test config.toml: extra lines for each table. The
// backend and device are the package's (backend_test.go).
type daemonConfig struct {
	Verbs   string
	Buffers string
	Mount   string
	Remote  string // the [remote] table (docs/REMOTE.md)
	Log     string // more of the [log] table (its level is debug)
	// Quiet logs at info, as a daemon in production does: for benchmarks.
	Quiet   bool
	Metrics string // the [metrics] table
	Publish string // the [publish] table
	// Wrapper is a command prefix such as prlimit/setpriv; each must exec
	// the next so the daemon keeps the pid we started.
	Wrapper []string
	// Env are KEY=value settings added to the daemon's environment (test
	// hooks such as MRFS_TEST_PAUSE_AFTER_TEARDOWN).
	Env []string
	// MountedIsReady: return as soon as the mount is in mountinfo, without
	// waiting for the root to answer (for signals sent at that moment).
	MountedIsReady bool
	// Keeper: mount --keeper (the daemon, the keeper's child, is
	// started again when it dies).
	Keeper bool
	// Hang replaces hangTimeout for a test that uses its mount longer.
	Hang time.Duration
	// FakeSystemd runs the daemon under a stand-in for systemd with an
	// fd store (fakeSystemd), which writes the names it keeps to this
	// file.
	FakeSystemd string
}

func (c daemonConfig) toml() string {
	level := "debug"
	if c.Quiet {
		level = "info"
	}
	return "[verbs]\n" + backend.verbs() + c.Verbs + "\n\n[buffers]\n" + c.Buffers +
		"\n\n[mount]\n" + c.Mount + "\n\n[log]\nlevel = \"" + level + "\"\n" + c.Log + "\n\n[remote]\n" + c.Remote +
		"\n\n[metrics]\n" + c.Metrics + "\n\n[publish]\n" + c.Publish + "\n"
}

type daemon struct {
	t       testing.TB
	mnt     string
	cfgPath string
	cmd     *exec.Cmd
	stderr  *syncBuffer
	done    chan struct{}
	waitErr error
	// stoppedByTest: the test ended the daemon itself and checked the result.
	stoppedByTest bool
	// watchdog: closed by cleanup; hung is set when the watchdog fired
	// after hang.
	watchdog chan struct{}
	hung     atomic.Bool
	hang     time.Duration
}

// startDaemon mounts mrfs on a fresh temporary mountpoint with cfg, waits
// until the mount is in /proc/self/mountinfo and the root's stats xattr is
// readable, and registers a cleanup that sends SIGINT and requires exit 0.
func startDaemon(t testing.TB, cfg daemonConfig) *daemon {
	t.Helper()
	requireMountEnv(t)
	dir := t.TempDir()
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg.toml()), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, cfg.Wrapper...), mrfsBin, "mount", "--config", cfgPath, mnt)
	if cfg.Keeper {
		args = slices.Insert(args, len(cfg.Wrapper)+2, "--keeper")
	}
	var env []string
	if cfg.FakeSystemd != "" {
		self, err := os.Executable()
		if err != nil {
			t.Fatal(err)
		}
		args = append([]string{self}, args...)
		env = append(env, fakeSystemdEnv+"="+cfg.FakeSystemd)
	}
	d := &daemon{t: t, mnt: mnt, cfgPath: cfgPath, stderr: &syncBuffer{}, done: make(chan struct{}), watchdog: make(chan struct{}), hang: cfg.Hang}
	if d.hang == 0 {
		d.hang = hangTimeout
	}
	d.cmd = exec.Command(args[0], args[1:]...)
	d.cmd.Env = append(append(os.Environ(), env...), cfg.Env...)
	d.cmd.Stdout = d.stderr
	d.cmd.Stderr = d.stderr
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("starting %v: %v", args, err)
	}
	go func() {
		d.waitErr = d.cmd.Wait()
		close(d.done)
	}()
	go d.watch()
	t.Cleanup(d.cleanup)

	deadline := time.Now().Add(readyTimeout)
	for {
		select {
		case <-d.done:
			d.stoppedByTest = true
			t.Fatalf("mrfs mount exited before it was ready (%v); stderr:\n%s", d.waitErr, d.stderr)
		default:
		}
		if isMounted(mnt) {
			if cfg.MountedIsReady {
				return d
			}
			if _, err := getxattr(mnt, xStats); err == nil {
				return d
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("mrfs mount not ready after %v (mounted=%v); stderr:\n%s", readyTimeout, isMounted(mnt), d.stderr)
		}
		time.Sleep(time.Millisecond)
	}
}

func (d *daemon) pid() int { return d.cmd.Process.Pid }

func (d *daemon) path(elem ...string) string {
	return filepath.Join(append([]string{d.mnt}, elem...)...)
}

func (d *daemon) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// stop sends sig (unless the daemon already exited) and waits up to
// stopTimeout. It returns the exit code (-1 when killed by a signal or when
// it could not be ended). On a timeout it fails the test and kills the
// daemon.
func (d *daemon) stop(sig syscall.Signal) int {
	d.t.Helper()
	d.stoppedByTest = true
	if !d.exited() && sig != 0 {
		_ = d.cmd.Process.Signal(sig)
	}
	select {
	case <-d.done:
	case <-time.After(stopTimeout):
		d.t.Errorf("mrfs mount did not exit within %v after %v; killing it", stopTimeout, sig)
		d.kill()
	}
	if !d.exited() {
		return -1
	}
	return d.cmd.ProcessState.ExitCode()
}

// kill SIGKILLs the daemon without ever blocking for good. A process killed
// while it has a file of its own mount open can wedge in exit, flushing
// that file to a server whose threads are gone; `umount -f` aborts the
// connection and lets it finish.
func (d *daemon) kill() {
	_ = d.cmd.Process.Kill()
	select {
	case <-d.done:
	case <-time.After(3 * time.Second):
		_ = exec.Command("umount", "-f", d.mnt).Run()
		select {
		case <-d.done:
		case <-time.After(5 * time.Second):
			d.t.Errorf("mrfs mount (pid %d) did not exit after SIGKILL and umount -f", d.pid())
		}
	}
	if isMounted(d.mnt) {
		_ = exec.Command("umount", "-l", d.mnt).Run()
	}
}

// waitExit waits for the daemon to exit on its own (e.g. after `mrfs umount`).
func (d *daemon) waitExit() int {
	d.t.Helper()
	return d.stop(0)
}

// watch kills a daemon that is still running hangTimeout after its start,
// with a goroutine dump first.
func (d *daemon) watch() {
	select {
	case <-d.watchdog:
		return
	case <-d.done:
		return
	case <-time.After(d.hang):
	}
	d.hung.Store(true)
	_ = d.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-d.done:
	case <-time.After(3 * time.Second):
	}
	_ = exec.Command("umount", "-f", d.mnt).Run()
	_ = exec.Command("umount", "-l", d.mnt).Run()
	_ = d.cmd.Process.Kill()
}

func (d *daemon) cleanup() {
	t := d.t
	close(d.watchdog)
	if d.hung.Load() {
		t.Errorf("the test was still using its mount %v after the daemon started; the watchdog dumped the daemon's goroutines (SIGQUIT) and killed it:\n%s",
			d.hang, tail(d.stderr.String(), 400))
		d.kill()
		return
	}
	if !d.stoppedByTest {
		if code := d.stop(syscall.SIGINT); code != 0 {
			t.Errorf("mrfs mount exited with status %d after SIGINT, want 0 (%v)", code, d.waitErr)
		}
	} else if !d.exited() {
		d.kill()
	}
	if isMounted(d.mnt) {
		t.Errorf("%s is still mounted after the daemon exited", d.mnt)
		_ = exec.Command("umount", "-l", d.mnt).Run()
	}
	if t.Failed() {
		t.Logf("mrfs mount stderr:\n%s", tail(d.stderr.String(), 60))
	}
}

// waitLog polls the daemon's stderr for a line matching re.
func (d *daemon) waitLog(re *regexp.Regexp, timeout time.Duration) (string, bool) {
	deadline := time.Now().Add(timeout)
	for {
		for _, line := range strings.Split(d.stderr.String(), "\n") {
			if re.MatchString(line) {
				return line, true
			}
		}
		if time.Now().After(deadline) {
			return "", false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// isMounted reports whether /proc/self/mountinfo has a FUSE mount at mnt.
func isMounted(mnt string) bool { return fuseDevice(mnt) != "" }

// abort ends d's FUSE connection from the kernel's side (fusectl), which
// unblocks every call on the mount at once without touching it: for a
// daemon that stopped answering, where even forking umount can hang (the
// child closes the parent's descriptors of the mount).
func (d *daemon) abort() { abortMount(d.t, d.mnt) }

// abortMount aborts the FUSE connection of the mount at mnt
// (/sys/fs/fuse/connections/N/abort): its requests fail with ENOTCONN.
func abortMount(t testing.TB, mnt string) {
	dev := fuseDevice(mnt)
	_, minor, ok := strings.Cut(dev, ":")
	if !ok {
		return
	}
	const ctl = "/sys/fs/fuse/connections"
	if _, err := os.Stat(ctl + "/" + minor); err != nil {
		_ = unix.Mount("fusectl", ctl, "fusectl", 0, "")
	}
	if err := os.WriteFile(ctl+"/"+minor+"/abort", []byte("1"), 0o200); err != nil {
		t.Logf("abort the FUSE connection %s of %s: %v", dev, mnt, err)
	}
}

// fuseDevice is the device (major:minor) of the FUSE mount at mnt, from
// mountinfo (which does not touch the mount), or "".
func fuseDevice(mnt string) string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(data), "\n") {
		left, right, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		f := strings.Fields(left)
		r := strings.Fields(right)
		if len(f) < 5 || len(r) < 1 {
			continue
		}
		if unescapeMountinfo(f[4]) == mnt && (r[0] == "fuse" || strings.HasPrefix(r[0], "fuse.")) {
			return f[2]
		}
	}
	return ""
}

func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
