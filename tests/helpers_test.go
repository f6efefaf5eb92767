package tests

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

var (
	// mrfsBin is the binary built once by TestMain; its directory is first
	// on PATH so shell scripts can call `mrfs`.
	mrfsBin string
	// binDir holds the built binaries (mrfs, the C client); removed at exit.
	binDir string
	// skipReason, when set, skips every test: the environment cannot mount.
	skipReason string

	pageSize = os.Getpagesize()

	hexRe = regexp.MustCompile(`^0x[0-9a-f]+$`)
	decRe = regexp.MustCompile(`^[0-9]+$`)
)

const (
	readyTimeout = 10 * time.Second
	stopTimeout  = 10 * time.Second
	cmdTimeout   = 60 * time.Second
	// hangTimeout bounds one test's use of its mount. A daemon that stops
	// answering would otherwise block the test in a syscall until go test's
	// own timeout; the watchdog dumps the daemon's goroutines (SIGQUIT) and
	// kills it, which aborts the FUSE connection and unblocks the test.
	hangTimeout = 90 * time.Second

	xLkey     = "user.mrfs.lkey"
	xRkey     = "user.mrfs.rkey"
	xAddr     = "user.mrfs.addr"
	xLength   = "user.mrfs.length"
	xAccess   = "user.mrfs.access"
	xDevice   = "user.mrfs.device"
	xPD       = "user.mrfs.pd"
	xState    = "user.mrfs.state"
	xZeroCopy = "user.mrfs.zero_copy"
	xDesc     = "user.mrfs.desc"
	xDefAcc   = "user.mrfs.default_access"
	xStats    = "user.mrfs.stats"
)

// fileXattrs are the xattrs every buffer file has (DESIGN.md, "Extended
// attributes").
var fileXattrs = []string{xLkey, xRkey, xAddr, xLength, xAccess, xDevice, xPD, xState, xZeroCopy, xDesc}

func TestMain(m *testing.M) {
	switch {
	case os.Geteuid() != 0:
		skipReason = "mrfs end-to-end tests need root (FUSE mount, pagemap PFNs)"
	default:
		if _, err := os.Stat("/dev/fuse"); err != nil {
			skipReason = "mrfs end-to-end tests need /dev/fuse: " + err.Error()
		}
	}
	if skipReason == "" {
		var err error
		binDir, err = os.MkdirTemp("", "mrfs-e2e-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "tests: temp dir:", err)
			os.Exit(1)
		}
		root, err := filepath.Abs("..")
		if err != nil {
			fmt.Fprintln(os.Stderr, "tests: module root:", err)
			os.Exit(1)
		}
		mrfsBin = filepath.Join(binDir, "mrfs")
		build := exec.Command("go", "build", "-o", mrfsBin, "mrfs/cmd/mrfs")
		build.Dir = root
		if out, err := build.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "tests: go build mrfs/cmd/mrfs failed: %v\n%s", err, out)
			os.RemoveAll(binDir)
			os.Exit(1)
		}
		os.Setenv("PATH", binDir+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// requireMountEnv skips only for the package-wide reasons (not root, no
// /dev/fuse). Nothing else may skip.
func requireMountEnv(t testing.TB) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

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
// backend is always soft (device soft0).
type daemonConfig struct {
	Verbs   string
	Buffers string
	Mount   string
	Remote  string // the [remote] table (docs/REMOTE.md)
	// Wrapper is a command prefix such as prlimit/setpriv; each must exec
	// the next so the daemon keeps the pid we started.
	Wrapper []string
	// MountedIsReady: return as soon as the mount is in mountinfo, without
	// waiting for the root to answer (for signals sent at that moment).
	MountedIsReady bool
}

func (c daemonConfig) toml() string {
	return "[verbs]\nbackend = \"soft\"\n" + c.Verbs + "\n\n[buffers]\n" + c.Buffers +
		"\n\n[mount]\n" + c.Mount + "\n\n[log]\nlevel = \"debug\"\n\n[remote]\n" + c.Remote + "\n"
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
	// watchdog: closed by cleanup; hung is set when the watchdog fired.
	watchdog chan struct{}
	hung     atomic.Bool
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
	d := &daemon{t: t, mnt: mnt, cfgPath: cfgPath, stderr: &syncBuffer{}, done: make(chan struct{}), watchdog: make(chan struct{})}
	d.cmd = exec.Command(args[0], args[1:]...)
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
	case <-time.After(hangTimeout):
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
			hangTimeout, tail(d.stderr.String(), 400))
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
func isMounted(mnt string) bool {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
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
			return true
		}
	}
	return false
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

// ---- commands ----

// run runs a command with a timeout and returns its stdout, stderr and error.
func run(t *testing.T, name string, args ...string) (string, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second // a leftover grandchild must not keep Run waiting on the pipes
	var out, errb bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func mustRun(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, errOut, err := run(t, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\nstdout: %s\nstderr: %s", name, strings.Join(args, " "), err, out, errOut)
	}
	return out
}

// sh runs a bash script with `set -e`.
func sh(t *testing.T, script string) (string, string, error) {
	t.Helper()
	return run(t, "bash", "-c", "set -e\n"+script)
}

func mustSh(t *testing.T, script string) string {
	t.Helper()
	out, errOut, err := sh(t, script)
	if err != nil {
		t.Fatalf("bash script failed: %v\nscript:\n%s\nstdout: %s\nstderr: %s", err, script, out, errOut)
	}
	return out
}

func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err == nil {
		return 0
	}
	return -1
}

// ---- xattrs ----

func getxattr(path, name string) (string, error) {
	for {
		n, err := unix.Getxattr(path, name, nil)
		if err != nil {
			return "", err
		}
		buf := make([]byte, n)
		m, err := unix.Getxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew in between
		}
		if err != nil {
			return "", err
		}
		return string(buf[:m]), nil
	}
}

func mustXattr(t *testing.T, path, name string) string {
	t.Helper()
	v, err := getxattr(path, name)
	if err != nil {
		t.Fatalf("getxattr(%s, %s): %v", path, name, err)
	}
	return v
}

func setxattr(path, name, value string) error {
	return unix.Setxattr(path, name, []byte(value), 0)
}

func mustSetxattr(t *testing.T, path, name, value string) {
	t.Helper()
	if err := setxattr(path, name, value); err != nil {
		t.Fatalf("setxattr(%s, %s, %q): %v", path, name, value, err)
	}
}

func listxattr(path string) ([]string, error) {
	for {
		n, err := unix.Listxattr(path, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		m, err := unix.Listxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, s := range strings.Split(string(buf[:m]), "\x00") {
			if s != "" {
				names = append(names, s)
			}
		}
		return names, nil
	}
}

func errnoString(err error) string {
	var e unix.Errno
	if errors.As(err, &e) {
		return unix.ErrnoName(e)
	}
	return err.Error()
}

// wantErrno requires err to be exactly errno want.
func wantErrno(t *testing.T, err error, want unix.Errno, what string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want %s", what, unix.ErrnoName(want))
		return
	}
	if !errors.Is(err, want) {
		t.Errorf("%s: got %v (%s), want %s", what, err, errnoString(err), unix.ErrnoName(want))
	}
}

// ---- stats ----

type statsLimits struct {
	MaxBuffers uint64 `json:"max_buffers"`
	MaxPinned  uint64 `json:"max_pinned"`
	MaxMR      uint64 `json:"max_mr"`
	Memlock    uint64 `json:"memlock"`
}

type mrfsStats struct {
	Backend         string      `json:"backend"`
	Device          string      `json:"device"`
	Buffers         int64       `json:"buffers"`
	PDs             int64       `json:"pds"`
	RegisteredBytes int64       `json:"registered_bytes"`
	PinnedBytes     int64       `json:"pinned_bytes"`
	Limits          statsLimits `json:"limits"`
}

func readStats(t *testing.T, mnt string) mrfsStats {
	t.Helper()
	raw := mustXattr(t, mnt, xStats)
	var s mrfsStats
	if err := json.Unmarshal([]byte(raw), &s); err != nil {
		t.Fatalf("user.mrfs.stats is not the documented JSON: %v\n%s", err, raw)
	}
	return s
}

// ---- state snapshots ("no state change") ----

// snapshot holds the observable state of some files and of the mount: every
// file xattr (or its errno), the size, and the stats.
type snapshot map[string]string

func takeSnapshot(t *testing.T, mnt string, files ...string) snapshot {
	t.Helper()
	s := snapshot{}
	for _, f := range files {
		for _, name := range []string{xLkey, xRkey, xAddr, xLength, xAccess, xState, xPD, xDesc} {
			v, err := getxattr(f, name)
			if err != nil {
				v = "error " + errnoString(err)
			}
			s[f+" "+name] = v
		}
		if fi, err := os.Stat(f); err != nil {
			s[f+" size"] = "error " + errnoString(err)
		} else {
			s[f+" size"] = strconv.FormatInt(fi.Size(), 10)
		}
	}
	st := readStats(t, mnt)
	s["stats buffers"] = strconv.FormatInt(st.Buffers, 10)
	s["stats pds"] = strconv.FormatInt(st.PDs, 10)
	s["stats registered_bytes"] = strconv.FormatInt(st.RegisteredBytes, 10)
	s["stats pinned_bytes"] = strconv.FormatInt(st.PinnedBytes, 10)
	return s
}

func (s snapshot) requireSame(t *testing.T, after snapshot, what string) {
	t.Helper()
	if reflect.DeepEqual(s, after) {
		return
	}
	var keys []string
	for k := range s {
		keys = append(keys, k)
	}
	for k := range after {
		if _, ok := s[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var diff []string
	for _, k := range keys {
		if s[k] != after[k] {
			diff = append(diff, fmt.Sprintf("  %s: %q -> %q", k, s[k], after[k]))
		}
	}
	t.Errorf("%s changed state:\n%s", what, strings.Join(diff, "\n"))
}

// ---- files ----

// makeBuffer creates path and sizes it with ftruncate.
func makeBuffer(t *testing.T, path string, size int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("create %s: %v", path, err)
	}
	defer f.Close()
	if size > 0 {
		if err := f.Truncate(size); err != nil {
			t.Fatalf("ftruncate %s to %d: %v", path, size, err)
		}
	}
}

// pattern is the byte the C and Python clients write at offset i.
func pattern(i int) byte { return byte((i*131 + (i >> 12) + 7) & 0xff) }

func patternBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = pattern(i)
	}
	return b
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	return fi.Size()
}

// requireRegistered checks a file is registered with the given length: the
// key formats, length xattr, state and size.
func requireRegistered(t *testing.T, path string, length int64) {
	t.Helper()
	if got := mustXattr(t, path, xState); got != "registered" {
		t.Errorf("%s: state %q, want registered", path, got)
	}
	if got := mustXattr(t, path, xLength); got != strconv.FormatInt(length, 10) {
		t.Errorf("%s: length %q, want %d", path, got, length)
	}
	if got := fileSize(t, path); got != length {
		t.Errorf("%s: size %d, want %d", path, got, length)
	}
	for _, k := range []string{xLkey, xRkey, xAddr} {
		if v := mustXattr(t, path, k); !hexRe.MatchString(v) {
			t.Errorf("%s: %s = %q, want %s", path, k, v, hexRe)
		}
	}
}

// requireEmpty checks an empty, unregistered file.
func requireEmpty(t *testing.T, path string) {
	t.Helper()
	if got := mustXattr(t, path, xState); got != "empty" {
		t.Errorf("%s: state %q, want empty", path, got)
	}
	for _, k := range []string{xLkey, xRkey, xAddr} {
		_, err := getxattr(path, k)
		wantErrno(t, err, unix.ENODATA, "getxattr "+k+" of an empty file")
	}
	if got := fileSize(t, path); got != 0 {
		t.Errorf("%s: size %d, want 0", path, got)
	}
}

// ---- pagemap ----

// pagemapEntry returns the PFN of the page holding va in pid's address space
// and whether it is present (bit 63). Needs root for the PFN bits.
func pagemapEntry(t *testing.T, pid int, va uintptr) (pfn uint64, present bool) {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		t.Fatalf("open pagemap of %d: %v", pid, err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[:], int64(va/uintptr(pageSize))*8); err != nil {
		t.Fatalf("read pagemap of %d at %#x: %v", pid, va, err)
	}
	e := binary.LittleEndian.Uint64(b[:])
	return e & (1<<55 - 1), e&(1<<63) != 0
}

// requireSamePages requires that npages pages from clientVA in clientPID and
// from daemonVA in the daemon are present and have equal, non-zero PFNs.
func requireSamePages(t *testing.T, clientPID int, clientVA uintptr, daemonPID int, daemonVA uintptr, npages int) {
	t.Helper()
	for i := 0; i < npages; i++ {
		off := uintptr(i * pageSize)
		cp, cok := pagemapEntry(t, clientPID, clientVA+off)
		dp, dok := pagemapEntry(t, daemonPID, daemonVA+off)
		if !cok || !dok || cp == 0 || dp == 0 {
			t.Fatalf("page %d: client pfn %#x present=%v, daemon pfn %#x present=%v; want both present", i, cp, cok, dp, dok)
		}
		if cp != dp {
			t.Fatalf("page %d: client pfn %#x != daemon pfn %#x at user.mrfs.addr+%#x: not zero copy", i, cp, dp, off)
		}
		// Control: distinct pages have distinct frames, so equality above
		// is not an artefact.
		if i > 0 {
			if prev, _ := pagemapEntry(t, clientPID, clientVA+off-uintptr(pageSize)); prev == cp {
				t.Fatalf("pages %d and %d share pfn %#x", i-1, i, cp)
			}
		}
	}
}

func parseHex(t *testing.T, s string) uint64 {
	t.Helper()
	if !hexRe.MatchString(s) {
		t.Fatalf("%q is not 0x-prefixed lower-case hex", s)
	}
	v, err := strconv.ParseUint(s[2:], 16, 64)
	if err != nil {
		t.Fatalf("parse %q: %v", s, err)
	}
	return v
}

// procStatusField returns the raw value of a /proc/PID/status line.
func procStatusField(t *testing.T, pid int, key string) string {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", key, pid)
	return ""
}

// procStatusKB reads a "Key:   N kB" line of /proc/PID/status.
func procStatusKB(t *testing.T, pid int, key string) int64 {
	t.Helper()
	v := procStatusField(t, pid, key)
	n, err := strconv.ParseInt(strings.TrimSuffix(v, " kB"), 10, 64)
	if err != nil {
		t.Fatalf("parse %s of %d: %q", key, pid, v)
	}
	return n
}

// sliceAddr is the virtual address of a mapping's first byte.
func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }
