package tests

// Big buffers (issue 12): regions split at the device's max_mr_size,
// reached remotely across their boundaries; a registration's progress
// seen from another process; an interrupted truncate that changes
// nothing.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"mrfs/remote"
	"mrfs/verbs"
)

// descJSON is user.mrfs.desc as a peer reads it.
type descJSON struct {
	Addr       string `json:"addr"`
	Length     string `json:"length"`
	RKey       string `json:"rkey"`
	State      string `json:"state"`
	Generation uint64 `json:"generation"`
	PageSize   uint64 `json:"page_size"`
	// Source is a file registered in place's.
	Source *struct {
		Path string `json:"path"`
		Kind string `json:"kind"`
	} `json:"source"`
	Regions []struct {
		Addr   string `json:"addr"`
		Length string `json:"length"`
		LKey   string `json:"lkey"`
		RKey   string `json:"rkey"`
	} `json:"regions"`
}

func readDesc(t *testing.T, path string) descJSON {
	t.Helper()
	var d descJSON
	if err := json.Unmarshal([]byte(mustXattr(t, path, xDesc)), &d); err != nil {
		t.Fatalf("%s of %s: %v", xDesc, path, err)
	}
	return d
}

func hexNum(t *testing.T, s string) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(s, 0, 64)
	if err != nil {
		t.Fatalf("%q is not a number: %v", s, err)
	}
	return v
}

// A buffer past the soft device's max_mr_size (on a real device,
// buffers.max_region_size) is registered as regions of at most that
// size: desc lists them in order, state says how many, the top-level
// keys are the first's; every byte is reached through its own region's
// key and no other; mrfs remote reads and writes across
// the boundaries with --desc.
func TestRegionsSplitMounted(t *testing.T) {
	const maxSize = 64 << 10
	const size = 3*maxSize + 8<<10
	cfg := daemonConfig{Verbs: fmt.Sprintf("soft_max_mr_size = %d", maxSize), Remote: remoteConfig()}
	if !backend.soft() {
		backend.differs(t, "the device's max_mr_size is not below 2^64: the regions are buffers.max_region_size's")
		cfg.Verbs, cfg.Buffers = "", fmt.Sprintf("max_region_size = %d", maxSize)
	}
	d := startDaemon(t, cfg)
	peer := d.remotePeer(t)
	f := d.path("big")
	if err := os.WriteFile(f, patternBytes(size), 0o600); err != nil {
		t.Fatal(err)
	}
	mustSetxattr(t, f, xAccess, allRemote)
	if st := mustXattr(t, f, xState); st != "registered in 4 regions" {
		t.Fatalf("state %q, want registered in 4 regions", st)
	}
	desc := readDesc(t, f)
	if len(desc.Regions) != 4 || desc.State != "registered in 4 regions" {
		t.Fatalf("desc: %+v", desc)
	}
	base := hexNum(t, desc.Addr)
	if desc.RKey != desc.Regions[0].RKey || hexNum(t, desc.Regions[0].Addr) != base || desc.Length != strconv.Itoa(size) {
		t.Fatalf("desc's top level is not the first region's: %+v", desc)
	}
	c := dialPD(t, peer, "/")
	next := base
	for i, r := range desc.Regions {
		addr, n, rkey := hexNum(t, r.Addr), hexNum(t, r.Length), uint32(hexNum(t, r.RKey))
		if want := min(uint64(maxSize), base+size-addr); addr != next || n != want {
			t.Fatalf("region %d at 0x%x of %d bytes, want 0x%x and %d", i, addr, n, next, want)
		}
		next += n
		got := make([]byte, n)
		if err := c.Read(got, addr, rkey); err != nil {
			t.Fatalf("READ of region %d with its key: %v", i, err)
		}
		if off := addr - base; !bytes.Equal(got, patternBytes(size)[off:off+n]) {
			t.Fatalf("region %d reads other bytes", i)
		}
		// Another region's key does not reach these bytes.
		other := uint32(hexNum(t, desc.Regions[(i+1)%len(desc.Regions)].RKey))
		if st := remote.Status(c.Read(make([]byte, 8), addr, other)); st != verbs.WCRemAccessErr {
			t.Fatalf("READ of region %d with region %d's key: %v, want REM_ACCESS_ERR", i, (i+1)%4, st)
		}
		c = dialPD(t, peer, "/") // the error state ends a connection
	}
	// One operation cannot cross a boundary, as on a NIC.
	r0 := uint32(hexNum(t, desc.Regions[0].RKey))
	if st := remote.Status(c.Read(make([]byte, 16), base+maxSize-8, r0)); st != verbs.WCRemAccessErr {
		t.Fatalf("a READ across a boundary with one key: %v, want REM_ACCESS_ERR", st)
	}

	// mrfs remote splits at the boundaries.
	descFile := d.path("..", "desc.json")
	if err := os.WriteFile(descFile, []byte(mustXattr(t, f, xDesc)), 0o600); err != nil {
		t.Fatal(err)
	}
	off := maxSize - 1000
	out := mustSh(t, fmt.Sprintf(remoteCLI(d, "read")+" --desc @%s --offset %d --length %d", descFile, off, 2*maxSize+2000))
	if out != string(patternBytes(size)[off:off+2*maxSize+2000]) {
		t.Fatal("mrfs remote read across three regions returned other bytes")
	}
	data := bytes.Repeat([]byte("across"), 1000)
	mustSh(t, fmt.Sprintf("printf '%%s' %s | "+remoteCLI(d, "write")+" --desc @%s --offset %d",
		data, descFile, 2*maxSize-3000))
	got, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	want := patternBytes(size)
	copy(want[2*maxSize-3000:], data)
	if !bytes.Equal(got, want) {
		t.Fatal("the file does not show mrfs remote write's bytes across the boundary")
	}
}

// chunkDelay slows each 16 MiB chunk a big registration populates, so
// that one lasts long enough to watch and to interrupt.
var chunkDelayEnv = []string{"MRFS_TEST_CHUNK_DELAY=150ms"}

var registeringRe = regexp.MustCompile(`^registering ([0-9]+)/([0-9]+)$`)

// started starts cmd and returns a channel closed once it has exited
// (its Wait done: cmd.ProcessState is set then).
func started(t testing.TB, cmd *exec.Cmd) <-chan struct{} {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	return exited
}

// waitRegistering polls f's state until a registration of total bytes is
// under way, part done, while the command that resizes f runs.
func waitRegistering(t testing.TB, f string, total int, exited <-chan struct{}) (done int) {
	t.Helper()
	deadline := time.Now().Add(cmdTimeout)
	for time.Now().Before(deadline) {
		st, err := getxattr(f, xState)
		if m := registeringRe.FindStringSubmatch(st); err == nil && m != nil {
			d, _ := strconv.Atoi(m[1])
			if m[2] != strconv.Itoa(total) {
				t.Fatalf("state %q: want a total of %d", st, total)
			}
			if d > 0 && d < total {
				return d
			}
		}
		select {
		case <-exited:
			t.Fatalf("the resize ended before its progress was seen (state %q)", st)
		default:
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no registration under way seen on %s", f)
	return 0
}

// While truncate registers a big buffer, another process reads its
// progress from user.mrfs.state (and stat does not wait); at the end the
// buffer is registered at the new size.
func TestRegistrationProgressMounted(t *testing.T) {
	const size = 160 << 20
	d := startDaemon(t, daemonConfig{Buffers: `populate_threshold = "16MiB"`, Env: chunkDelayEnv})
	f := d.path("big")
	makeBuffer(t, f, 4096)
	cmd := exec.Command("truncate", "-s", strconv.Itoa(size), f)
	exited := started(t, cmd)
	first := waitRegistering(t, f, size, exited)
	if fi, err := os.Stat(f); err != nil || fi.Size() != 4096 {
		t.Errorf("stat during the registration: %v, %v; want the size before it", fi, err)
	}
	second := waitRegistering(t, f, size, exited)
	for second == first {
		second = waitRegistering(t, f, size, exited)
	}
	if second < first {
		t.Errorf("progress went back: %d, then %d", first, second)
	}
	<-exited
	if !cmd.ProcessState.Success() {
		t.Fatalf("truncate: %v", cmd.ProcessState)
	}
	requireRegistered(t, f, size)
}

// Ctrl-C on a truncate that registers a big buffer: the kernel sends FUSE
// INTERRUPT, the daemon stops, and the buffer is exactly as before: size,
// keys, generation, pinned bytes.
func TestInterruptedTruncate(t *testing.T) {
	const size = 160 << 20
	d := startDaemon(t, daemonConfig{Buffers: `populate_threshold = "16MiB"`, Env: chunkDelayEnv})
	f := d.path("big")
	makeBuffer(t, f, 8192)
	if err := os.WriteFile(f, patternBytes(8192), 0o600); err != nil {
		t.Fatal(err)
	}
	before, stats := takeSnapshot(t, d.mnt, f), readStats(t, d.mnt)
	cmd := exec.Command("truncate", "-s", strconv.Itoa(size), f)
	exited := started(t, cmd)
	waitRegistering(t, f, size, exited)
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	<-exited
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGINT {
		t.Fatalf("truncate: %v; want it killed by SIGINT", cmd.ProcessState)
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, f), "an interrupted truncate")
	if st := readStats(t, d.mnt); st.PinnedBytes != stats.PinnedBytes || st.RegisteredBytes != stats.RegisteredBytes || st.StoreBytes != stats.StoreBytes {
		t.Fatalf("stats before %+v, after %+v", stats, st)
	}
	if got, err := os.ReadFile(f); err != nil || !bytes.Equal(got, patternBytes(8192)) {
		t.Fatalf("the bytes changed: %v", err)
	}
}

// mrfs alloc creates a buffer and waits until it is registered, printing
// its progress (plain lines without a terminal, a bar when asked); Ctrl-C
// stops it and leaves the file as it was, exit status 130.
func TestAllocCommand(t *testing.T) {
	const size = 160 << 20
	d := startDaemon(t, daemonConfig{Buffers: `populate_threshold = "16MiB"`, Env: chunkDelayEnv})
	f := d.path("new")
	out, errOut, err := run(t, mrfsBin, "alloc", "--access", "local_write,remote_read", "160MiB", f)
	if err != nil {
		t.Fatalf("mrfs alloc: %v\n%s", err, errOut)
	}
	if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(f) + `: registering [0-9]+ (B|KiB|MiB) of 160 MiB$`).MatchString(errOut) {
		t.Errorf("no progress line on stderr:\n%s", errOut)
	}
	if !strings.HasPrefix(out, f+": 160 MiB registered in ") {
		t.Errorf("stdout %q", out)
	}
	requireRegistered(t, f, size)
	if a := mustXattr(t, f, xAccess); a != "local_write,remote_read" {
		t.Errorf("access %q", a)
	}

	// A bar when asked for one (a terminal asks by default).
	_, errOut, err = run(t, mrfsBin, "alloc", "--progress", "bar", "200MiB", f)
	if err != nil || !strings.Contains(errOut, "registering "+f) || !strings.Contains(errOut, "%") {
		t.Errorf("mrfs alloc --progress bar: %v, stderr %q", err, errOut)
	}

	g := d.path("old")
	if err := os.WriteFile(g, patternBytes(8192), 0o600); err != nil {
		t.Fatal(err)
	}
	before := takeSnapshot(t, d.mnt, g)
	cmd := exec.Command(mrfsBin, "alloc", "160MiB", g)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	exited := started(t, cmd)
	waitRegistering(t, g, size, exited)
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	<-exited
	if code := cmd.ProcessState.ExitCode(); code != 130 || !strings.Contains(stderr.String(), "interrupted; "+g+" is unchanged") {
		t.Fatalf("mrfs alloc after SIGINT: exit %d, stderr %q; want exit 130 saying the file is unchanged", code, stderr.String())
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, g), "an interrupted mrfs alloc")
	if got, err := os.ReadFile(g); err != nil || !bytes.Equal(got, patternBytes(8192)) {
		t.Fatalf("the bytes changed: %v", err)
	}
	// Not a buffer of mrfs.
	_, errOut, err = run(t, mrfsBin, "alloc", "1MiB", t.TempDir()+"/x")
	if exitCode(err) != 1 || !strings.Contains(errOut, "not a buffer of an mrfs mount") {
		t.Errorf("alloc outside mrfs: %v, %q", err, errOut)
	}
}

// A signal that reaches the thread of mrfs alloc's ftruncate, with no
// Ctrl-C, interrupts its FUSE request too, and the daemon stops the
// registration with EINTR: alloc tries again and finishes (Go's runtime
// sends itself such signals, SIGURG, and a terminal SIGWINCH).
func TestAllocSpuriousSignals(t *testing.T) {
	const size = 160 << 20
	d := startDaemon(t, daemonConfig{Buffers: `populate_threshold = "16MiB"`, Env: chunkDelayEnv})
	f := d.path("big")
	makeBuffer(t, f, 4096)
	cmd := exec.Command(mrfsBin, "alloc", "--progress", "plain", "160MiB", f)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	exited := started(t, cmd)
	waitRegistering(t, f, size, exited)
	signaled := 0
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", cmd.Process.Pid))
	for _, task := range tasks {
		if tid, err := strconv.Atoi(task.Name()); err == nil && syscall.Tgkill(cmd.Process.Pid, tid, syscall.SIGURG) == nil {
			signaled++
		}
	}
	<-exited
	if code := cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("mrfs alloc after SIGURG to its %d threads: exit %d, stderr %q; want it to go on", signaled, code, stderr.String())
	}
	requireRegistered(t, f, size)
	if !strings.Contains(d.stderr.String(), "interrupted") {
		t.Logf("(no registration was interrupted: the signals reached no thread in the FUSE request)")
	}
}
