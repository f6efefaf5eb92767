package tests

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

var (
	cClientOnce sync.Once
	cClientPath string
	cClientErr  string
)

// cClient compiles testdata/client.c once per test binary run.
func cClient(t *testing.T) string {
	t.Helper()
	requireMountEnv(t)
	cClientOnce.Do(func() {
		cClientPath = filepath.Join(binDir, "client")
		out, err := exec.Command("cc", "-Wall", "-Wextra", "-Werror", "-O2", "-o", cClientPath, "testdata/client.c").CombinedOutput()
		if err != nil {
			cClientErr = err.Error() + "\n" + string(out)
		}
	})
	if cClientErr != "" {
		t.Fatalf("cc testdata/client.c: %s", cClientErr)
	}
	return cClientPath
}

func pyClient() []string {
	abs, _ := filepath.Abs("testdata/client.py")
	return []string{"python3", abs}
}

// clientData is what both clients leave in the buffer.
func clientData(size int) []byte {
	b := patternBytes(size)
	copy(b, "mrfs")
	return b
}

// clientOutput parses "rkey=..." and "addr=..." lines.
func clientOutput(t *testing.T, lines []string) (rkey string, addr uintptr) {
	t.Helper()
	for _, l := range lines {
		if v, ok := strings.CutPrefix(l, "rkey="); ok {
			rkey = v
		}
		if v, ok := strings.CutPrefix(l, "addr="); ok {
			addr = uintptr(parseHex(t, v))
		}
	}
	if rkey == "" || addr == 0 {
		t.Fatalf("client output lacks rkey=/addr=: %q", lines)
	}
	return rkey, addr
}

// holdClient is a client started with --hold: it keeps its mapping until quit.
type holdClient struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *syncBuffer
	done   chan struct{}
	rkey   string
	addr   uintptr
}

func startHoldClient(t *testing.T, argv ...string) *holdClient {
	t.Helper()
	c := &holdClient{t: t, lines: make(chan string, 16), stderr: &syncBuffer{}, done: make(chan struct{})}
	c.cmd = exec.Command(argv[0], argv[1:]...)
	c.cmd.Stderr = c.stderr
	var err error
	if c.stdin, err = c.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	c.cmd.Stdout = pw
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("start %v: %v", argv, err)
	}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	go func() {
		_ = c.cmd.Wait()
		pw.Close()
		close(c.done)
	}()
	// Registered after the daemon's cleanup, so it runs first: the client
	// must let go of its mapping before the daemon can unmount.
	t.Cleanup(func() {
		select {
		case <-c.done:
			return
		default:
		}
		c.stdin.Close()
		select {
		case <-c.done:
		case <-time.After(5 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	})
	var got []string
	for {
		l := c.next()
		if l == "ready" {
			break
		}
		got = append(got, l)
	}
	c.rkey, c.addr = clientOutput(t, got)
	return c
}

func (c *holdClient) next() string {
	c.t.Helper()
	select {
	case l, ok := <-c.lines:
		if !ok {
			<-c.done
			c.t.Fatalf("client %v exited (%v); stderr: %s", c.cmd.Args, c.cmd.ProcessState, c.stderr)
		}
		return l
	case <-time.After(30 * time.Second):
		c.t.Fatalf("client %v: no output in 30s; stderr: %s", c.cmd.Args, c.stderr)
	}
	return ""
}

func (c *holdClient) ask(cmd string) string {
	c.t.Helper()
	if _, err := io.WriteString(c.stdin, cmd+"\n"); err != nil {
		c.t.Fatalf("write to client: %v", err)
	}
	return c.next()
}

// quit ends the client and requires exit 0.
func (c *holdClient) quit() {
	c.t.Helper()
	if _, err := io.WriteString(c.stdin, "quit\n"); err != nil {
		c.t.Errorf("write quit: %v", err)
	}
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		c.t.Fatalf("client did not exit after quit")
	}
	if code := c.cmd.ProcessState.ExitCode(); code != 0 {
		c.t.Errorf("client exited %d; stderr: %s", code, c.stderr)
	}
}

// TestZeroCopyPagemap: the test process maps a buffer MAP_SHARED; its pages
// and the daemon's pages at user.mrfs.addr have the same PFNs; a write
// through the mapping is seen by cat.
func TestZeroCopyPagemap(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("zc")
	const npages = 16
	size := npages * pageSize
	makeBuffer(t, f, int64(size))
	fh, m := mapShared(t, f, size)
	for i := 0; i < size; i += pageSize {
		m[i] = byte(i / pageSize)
	}
	msg := []byte("written through the client mapping")
	copy(m[100:], msg)

	addr := parseHex(t, mustXattr(t, f, xAddr))
	requireSamePages(t, os.Getpid(), sliceAddr(m), d.pid(), uintptr(addr), npages)

	out := mustRun(t, "cat", f)
	if len(out) != size || out[100:100+len(msg)] != string(msg) {
		t.Errorf("cat does not show the write through the mapping")
	}
	// And the other way: a write(2) shows in the mapping.
	if _, err := fh.WriteAt([]byte("via write"), 5000); err != nil {
		t.Fatal(err)
	}
	if string(m[5000:5009]) != "via write" {
		t.Errorf("write(2) not visible in the mapping: %q", m[5000:5009])
	}
}

// TestCClient: the C client creates, sizes, maps and fills a buffer and
// reads its rkey; the test sees the same rkey and data, and while a C client
// holds its mapping its pages are the daemon's registered pages.
func TestCClient(t *testing.T) {
	t.Parallel()
	bin := cClient(t)
	d := startDaemon(t, daemonConfig{})
	f := d.path("cbuf")
	const size = 256<<10 + 100
	out := mustRun(t, bin, f, strconv.Itoa(size))
	rkey, _ := clientOutput(t, strings.Split(strings.TrimSpace(out), "\n"))
	if got := mustXattr(t, f, xRkey); got != rkey {
		t.Errorf("client printed rkey %q, test reads %q", rkey, got)
	}
	if !hexRe.MatchString(rkey) {
		t.Errorf("rkey %q from the C client, want %s", rkey, hexRe)
	}
	requireRegistered(t, f, size)
	got, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, clientData(size)) {
		t.Errorf("buffer content differs from what the C client wrote")
	}

	g := d.path("chold")
	c := startHoldClient(t, bin, "--hold", g, strconv.Itoa(64<<10))
	if got := mustXattr(t, g, xRkey); got != c.rkey {
		t.Errorf("holding client printed rkey %q, test reads %q", c.rkey, got)
	}
	requireSamePages(t, c.cmd.Process.Pid, c.addr, d.pid(), uintptr(parseHex(t, mustXattr(t, g, xAddr))), (64<<10)/pageSize)
	if r := c.ask("check"); r != "ok" {
		t.Errorf("client check: %s", r)
	}
	c.quit()
}

// TestPythonClient: the same with the Python client.
func TestPythonClient(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("pybuf")
	const size = 128<<10 + 5
	out := mustRun(t, pyClient()[0], pyClient()[1], f, strconv.Itoa(size))
	rkey, _ := clientOutput(t, strings.Split(strings.TrimSpace(out), "\n"))
	if got := mustXattr(t, f, xRkey); got != rkey {
		t.Errorf("python printed rkey %q, test reads %q", rkey, got)
	}
	requireRegistered(t, f, size)
	got, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, clientData(size)) {
		t.Errorf("buffer content differs from what the Python client wrote")
	}

	g := d.path("pyhold")
	c := startHoldClient(t, append(pyClient(), "--hold", g, strconv.Itoa(32<<10))...)
	if got := mustXattr(t, g, xRkey); got != c.rkey {
		t.Errorf("holding python printed rkey %q, test reads %q", c.rkey, got)
	}
	requireSamePages(t, c.cmd.Process.Pid, c.addr, d.pid(), uintptr(parseHex(t, mustXattr(t, g, xAddr))), (32<<10)/pageSize)
	if r := c.ask("check"); r != "ok" {
		t.Errorf("python check: %s", r)
	}
	c.quit()
}

// TestUnlinkWhileMapped: rm deregisters at once (stats drop) while the
// client that maps the file keeps its data.
func TestUnlinkWhileMapped(t *testing.T) {
	t.Parallel()
	bin := cClient(t)
	d := startDaemon(t, daemonConfig{})
	makeBuffer(t, d.path("other"), 64<<10)
	f := d.path("mapped")
	c := startHoldClient(t, bin, "--hold", f, strconv.Itoa(1<<20))
	requireRegistered(t, f, 1<<20)
	before := readStats(t, d.mnt)
	mustRun(t, "rm", f)
	after := readStats(t, d.mnt)
	if after.Buffers != before.Buffers-1 || after.RegisteredBytes != before.RegisteredBytes-1<<20 || after.PinnedBytes != before.PinnedBytes-1<<20 {
		t.Errorf("stats right after rm: %+v -> %+v; want buffers -1 and 1 MiB fewer registered and pinned bytes", before, after)
	}
	if _, err := os.Lstat(f); !os.IsNotExist(err) {
		t.Errorf("lstat after rm: %v, want ENOENT", err)
	}
	for i := 0; i < 3; i++ {
		if r := c.ask("check"); r != "ok" {
			t.Fatalf("client lost its data after rm: %s", r)
		}
		time.Sleep(50 * time.Millisecond)
	}
	requireRegistered(t, d.path("other"), 64<<10)
	c.quit()
	if s := readStats(t, d.mnt); s.Buffers != after.Buffers || s.RegisteredBytes != after.RegisteredBytes {
		t.Errorf("stats after the client let go: %+v, want %+v", s, after)
	}
}

// TestDegradedMode: mount.zero_copy = false: I/O works through the daemon,
// zero_copy reads 0, MAP_SHARED mmap fails with ENODEV, MAP_PRIVATE is a
// private copy.
func TestDegradedMode(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "zero_copy = false"})
	mustRun(t, "cp", "/bin/ls", d.mnt+"/")
	mustRun(t, "cmp", "/bin/ls", d.path("ls"))
	requireRegistered(t, d.path("ls"), fileSize(t, "/bin/ls"))
	if got := mustXattr(t, d.path("ls"), xZeroCopy); got != "0" {
		t.Errorf("zero_copy = %q, want 0", got)
	}
	f := d.path("buf")
	data := patternBytes(3*4096 + 11)
	if err := os.WriteFile(f, data, 0o600); err != nil {
		t.Fatal(err)
	}
	requireRegistered(t, f, int64(len(data)))
	got, err := os.ReadFile(f)
	if err != nil || !bytes.Equal(got, data) {
		t.Errorf("read back in degraded mode: %v, equal=%v", err, bytes.Equal(got, data))
	}
	fh, err := os.OpenFile(f, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	m, err := unix.Mmap(int(fh.Fd()), 0, len(data), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err == nil {
		munmap(m)
	}
	wantErrno(t, err, unix.ENODEV, "MAP_SHARED mmap in degraded mode")

	// MAP_PRIVATE the kernel allows (DESIGN, "Zero-copy mmap"): a copy of
	// the buffer's bytes, whose writes stay the client's own.
	p, err := unix.Mmap(int(fh.Fd()), 0, len(data), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("MAP_PRIVATE mmap in degraded mode: %v", err)
	}
	defer munmap(p)
	if !bytes.Equal(p, data) {
		t.Fatal("a private mapping does not show the buffer's bytes")
	}
	p[0] ^= 0xff
	if got, err := os.ReadFile(f); err != nil || !bytes.Equal(got, data) {
		t.Errorf("a store to a private mapping reached the buffer: %v", err)
	}
}

// TestShrinkWhileMapped: shrinking a buffer a client maps keeps the prefix,
// SIGBUSes the client past the new end, leaves the daemon alive, and a grow
// again shows zeros in the same mapping, still the registered pages.
func TestShrinkWhileMapped(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("shrink")
	const size = 64 << 10
	if err := os.WriteFile(f, patternBytes(size), 0o600); err != nil {
		t.Fatal(err)
	}
	_, m := mapShared(t, f, size)

	mustRun(t, "truncate", "-s", "4096", f)
	requireRegistered(t, f, 4096)
	if !bytes.Equal(m[:4096], patternBytes(4096)) {
		t.Errorf("the mapping lost the kept prefix")
	}
	if !faults(func() { faultSink = m[3*4096] }) {
		t.Errorf("reading past the new end through an old mapping did not fault (SIGBUS expected)")
	}
	if s := readStats(t, d.mnt); s.RegisteredBytes != 4096 {
		t.Errorf("stats registered_bytes after shrink = %d, want 4096", s.RegisteredBytes)
	}

	mustRun(t, "truncate", "-s", strconv.Itoa(size), f)
	requireRegistered(t, f, size)
	if !bytes.Equal(m[:4096], patternBytes(4096)) || !bytes.Equal(m[4096:], make([]byte, size-4096)) {
		t.Errorf("after growing back: prefix kept and zero tail expected in the client mapping")
	}
	requireSamePages(t, os.Getpid(), sliceAddr(m), d.pid(), uintptr(parseHex(t, mustXattr(t, f, xAddr))), size/pageSize)
}

// faultSink keeps a load the compiler could otherwise drop.
var faultSink byte

// faults runs fn and reports whether it hit a memory fault (SIGBUS/SIGSEGV).
func faults(fn func()) (faulted bool) {
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	defer func() {
		if r := recover(); r != nil {
			faulted = true
		}
	}()
	fn()
	return false
}

// TestKeySecrecy: with allow_other, another user cannot read the keys of a
// 0600 buffer (default_permissions); a 0644 buffer's keys are readable.
// Other users must reach the files for the refusal to mean anything: the
// path to the mount and its root are made o+x, and the readable 0644
// buffer proves it.
func TestKeySecrecy(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true\numask = \"022\""})
	// Let other users reach the mountpoint and into the mount's root.
	for p := d.mnt; p != os.TempDir() && p != "/"; p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	secret, public := d.path("secret"), d.path("public")
	for p, mode := range map[string]os.FileMode{secret: 0o600, public: 0o644} {
		fh, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, mode)
		if err != nil {
			t.Fatal(err)
		}
		if err := fh.Truncate(4096); err != nil {
			t.Fatal(err)
		}
		fh.Close()
	}
	if fi, _ := os.Stat(secret); fi.Mode().Perm() != 0o600 {
		t.Errorf("secret mode %v, want 0600", fi.Mode().Perm())
	}
	root, err := os.Stat(d.mnt)
	if err != nil {
		t.Fatal(err)
	}
	if root.Mode().Perm() != 0o755 {
		t.Fatalf("test setup: the mount's root is %v after chmod 0755", root.Mode().Perm())
	}
	asNobody := []string{"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "getfattr", "--only-values", "-n", xRkey}
	out, errOut, err := run(t, asNobody[0], append(asNobody[1:], secret)...)
	if err == nil || !strings.Contains(errOut, "Permission denied") {
		t.Errorf("nobody read the rkey of a 0600 buffer: %v, %q, %q", err, out, errOut)
	}
	out, errOut, err = run(t, asNobody[0], append(asNobody[1:], public)...)
	if err != nil || out != mustXattr(t, public, xRkey) {
		t.Errorf("nobody could not read the rkey of a 0644 buffer: %v, %q, %q", err, out, errOut)
	}
}
