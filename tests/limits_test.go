package tests

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestMaxBuffersENOSPC: creating past max_buffers is ENOSPC, nothing
// appears, the daemon logs the limit; after an rm a create works again.
func TestMaxBuffersENOSPC(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_buffers = 2"})
	makeBuffer(t, d.path("a"), 4096)
	makeBuffer(t, d.path("b"), 0)
	before := takeSnapshot(t, d.mnt, d.path("a"), d.path("b"))
	_, err := os.OpenFile(d.path("c"), os.O_CREATE|os.O_RDWR, 0o600)
	wantErrno(t, err, unix.ENOSPC, "third create with max_buffers = 2")
	if _, err := os.Lstat(d.path("c")); !os.IsNotExist(err) {
		t.Errorf("c exists after a refused create: %v", err)
	}
	_, errOut, err := run(t, "touch", d.path("c2"))
	if err == nil || !strings.Contains(errOut, "No space left on device") {
		t.Errorf("touch past max_buffers: %v, %q; want No space left on device", err, errOut)
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, d.path("a"), d.path("b")), "refused creates")
	if ents, err := os.ReadDir(d.mnt); err != nil || len(ents) != 2 {
		t.Errorf("readdir: %d entries, %v; want 2", len(ents), err)
	}
	if line, ok := d.waitLog(regexp.MustCompile(`max_buffers`), 2*time.Second); !ok {
		t.Errorf("daemon did not log which limit was hit (no line mentioning max_buffers)")
	} else {
		t.Logf("log: %s", line)
	}
	if err := os.Remove(d.path("a")); err != nil {
		t.Fatal(err)
	}
	makeBuffer(t, d.path("c"), 4096)
	requireRegistered(t, d.path("c"), 4096)
}

// TestMaxPinnedENOSPC: a size that fits max_pinned but not what is free
// now is ENOSPC; one past the whole budget is EFBIG (as a file past the
// maximum size); either way the buffers keep their sizes and keys.
func TestMaxPinnedENOSPC(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: `max_pinned = "1MiB"`})
	f := d.path("f")
	makeBuffer(t, f, 512<<10)
	if err := os.WriteFile(d.path("g"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	before := takeSnapshot(t, d.mnt, f, d.path("g"))

	wantErrno(t, unix.Truncate(f, 2<<20), unix.EFBIG, "truncate to 2 MiB with max_pinned 1 MiB")
	before.requireSame(t, takeSnapshot(t, d.mnt, f, d.path("g")), "refused truncate(2)")

	_, errOut, err := run(t, "truncate", "-s", "2M", f)
	if err == nil || !strings.Contains(errOut, "File too large") {
		t.Errorf("truncate -s 2M: %v, %q; want File too large", err, errOut)
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, f, d.path("g")), "refused truncate -s 2M")

	fh, err := os.OpenFile(f, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	wantErrno(t, fh.Truncate(4<<20), unix.EFBIG, "ftruncate to 4 MiB")
	fh.Close()
	// A second buffer that fits the budget but not beside the first.
	wantErrno(t, unix.Truncate(d.path("g"), 1<<20), unix.ENOSPC, "second buffer of 1 MiB over a 512 KiB one")
	_, errOut, err = run(t, "truncate", "-s", "768K", d.path("g"))
	if err == nil || !strings.Contains(errOut, "No space left on device") {
		t.Errorf("truncate -s 768K beside 512 KiB: %v, %q; want No space left on device", err, errOut)
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, f, d.path("g")), "refused ftruncate/second buffer")

	if _, ok := d.waitLog(regexp.MustCompile(`max_pinned`), 2*time.Second); !ok {
		t.Errorf("daemon did not log which limit was hit (no line mentioning max_pinned)")
	}
	// Up to the limit exactly still works; one byte more pins one page
	// too many.
	if err := unix.Truncate(d.path("g"), 512<<10); err != nil {
		t.Errorf("512 KiB beside 512 KiB under a 1 MiB limit: %v", err)
	}
	wantErrno(t, unix.Truncate(d.path("g"), 512<<10+1), unix.ENOSPC, "one byte (a page) past max_pinned")
	requireRegistered(t, d.path("g"), 512<<10)
}

// TestSoftMaxMREINVAL: the device's max_mr exhausted: the registration fails
// with the device's EINVAL and the file stays empty.
func TestSoftMaxMREINVAL(t *testing.T) {
	t.Parallel()
	if !backend.soft() {
		// A real device's max_mr cannot be lowered, and filling rxe's
		// takes 524287 registrations, each with kernel memory of its
		// own: what mrfs does at the device's EINVAL is checked on the
		// soft model, which refuses as rxe does.
		max := deviceMaxMR(t)
		backend.differs(t, fmt.Sprintf("max_mr is the device's %d, too many regions to fill here", max))
		d := startDaemon(t, daemonConfig{})
		if s := readStats(t, d.mnt); s.Limits.MaxMR != max {
			t.Errorf("stats limits.max_mr = %d, the device reports %d", s.Limits.MaxMR, max)
		}
		return
	}
	d := startDaemon(t, daemonConfig{Verbs: "soft_max_mr = 2"})
	if s := readStats(t, d.mnt); s.Limits.MaxMR != 2 {
		t.Errorf("stats limits.max_mr = %d, want 2", s.Limits.MaxMR)
	}
	makeBuffer(t, d.path("a"), 4096)
	makeBuffer(t, d.path("b"), 4096)
	c := d.path("c")
	makeBuffer(t, c, 0)
	before := takeSnapshot(t, d.mnt, d.path("a"), d.path("b"), c)
	wantErrno(t, unix.Truncate(c, 4096), unix.EINVAL, "third registration with max_mr = 2")
	before.requireSame(t, takeSnapshot(t, d.mnt, d.path("a"), d.path("b"), c), "refused registration")
	requireEmpty(t, c)
	// A resize or an access change registers anew before deregistering the
	// old region, so with the device full both fail and change nothing.
	wantErrno(t, unix.Truncate(d.path("a"), 8192), unix.EINVAL, "grow a with max_mr used up")
	wantErrno(t, setxattr(d.path("a"), xAccess, "local_write,remote_read"), unix.EINVAL, "set access with max_mr used up")
	before.requireSame(t, takeSnapshot(t, d.mnt, d.path("a"), d.path("b"), c), "re-registrations refused by max_mr")
	// Freeing one makes room.
	if err := os.Remove(d.path("a")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Truncate(c, 4096); err != nil {
		t.Errorf("registration after freeing an MR: %v", err)
	}
	requireRegistered(t, c, 4096)
}

// TestMemlockENOMEM: without CAP_IPC_LOCK and with RLIMIT_MEMLOCK 1 MiB, a
// 4 MiB registration fails with ENOMEM, nothing changes, and the log names
// RLIMIT_MEMLOCK.
func TestMemlockENOMEM(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Wrapper: []string{
		"prlimit", "--memlock=1048576:1048576",
		"setpriv", "--inh-caps=-ipc_lock", "--ambient-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--",
	}})
	// The test's own setup: the daemon really lacks CAP_IPC_LOCK.
	capEff := procStatusField(t, d.pid(), "CapEff")
	caps, err := strconv.ParseUint(capEff, 16, 64)
	if err != nil {
		t.Fatalf("CapEff %q: %v", capEff, err)
	}
	if caps&(1<<unix.CAP_IPC_LOCK) != 0 {
		t.Fatalf("test setup: the daemon still has CAP_IPC_LOCK (CapEff %s)", capEff)
	}
	if s := readStats(t, d.mnt); s.Limits.Memlock != 1<<20 {
		t.Errorf("stats limits.memlock = %d, want 1048576", s.Limits.Memlock)
	}

	f := d.path("f")
	makeBuffer(t, f, 256<<10)
	requireRegistered(t, f, 256<<10)
	g := d.path("g")
	makeBuffer(t, g, 0)
	before := takeSnapshot(t, d.mnt, f, g)

	_, errOut, err := run(t, "truncate", "-s", "4M", f)
	if err == nil || !strings.Contains(errOut, "Cannot allocate memory") {
		t.Errorf("truncate -s 4M under RLIMIT_MEMLOCK 1 MiB: %v, %q; want Cannot allocate memory", err, errOut)
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, f, g), "truncate -s 4M refused by RLIMIT_MEMLOCK")
	wantErrno(t, unix.Truncate(g, 4<<20), unix.ENOMEM, "truncate(2) an empty file to 4 MiB")
	before.requireSame(t, takeSnapshot(t, d.mnt, f, g), "truncate(2) refused by RLIMIT_MEMLOCK")
	requireEmpty(t, g)

	if line, ok := d.waitLog(regexp.MustCompile(`RLIMIT_MEMLOCK`), 2*time.Second); !ok {
		t.Errorf("daemon stderr has no line mentioning RLIMIT_MEMLOCK")
	} else {
		t.Logf("log: %s", line)
	}
}

// TestWritePastMaxPinned: a client's writes past EOF go to the backing
// store, whose size is max_pinned: the write that crosses it fails (ENOSPC,
// as on a full tmpfs), the file holds what fitted, and that registers; a
// later truncate within the limit registers again.
func TestWritePastMaxPinned(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: `max_pinned = "1MiB"`})
	src := filepath.Join(t.TempDir(), "src")
	data := patternBytes(2 << 20)
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f := d.path("big")
	_, errOut, err := run(t, "cp", src, f)
	if err == nil || !strings.Contains(errOut, "No space left on device") {
		t.Errorf("cp of 2 MiB into a 1 MiB budget: %v, %q; want No space left on device", err, errOut)
	}
	size := fileSize(t, f)
	if size == 0 || size > 1<<20 {
		t.Fatalf("size %d after writing 2 MiB into a 1 MiB budget", size)
	}
	requireRegistered(t, f, size)
	if s := readStats(t, d.mnt); s.PinnedBytes > 1<<20 || s.RegisteredBytes > 1<<20 {
		t.Errorf("stats %+v pass max_pinned 1 MiB", s)
	}
	got, err := os.ReadFile(f)
	if err != nil || !bytes.Equal(got, data[:size]) {
		t.Errorf("what fitted: %v", err)
	}
	mustRun(t, "truncate", "-s", "512K", f)
	requireRegistered(t, f, 512<<10)
	got, err = os.ReadFile(f)
	if err != nil || !bytes.Equal(got, data[:512<<10]) {
		t.Errorf("prefix after truncate: %v", err)
	}
}

// TestMkdirPastMaxPD: each directory is a protection domain; past the
// device's max_pd, mkdir is ENOSPC and the log names max_pd (not the
// device's EINVAL, which names nothing), and an rmdir makes room.
func TestMkdirPastMaxPD(t *testing.T) {
	t.Parallel()
	if !backend.soft() {
		// A real device's max_pd cannot be lowered (rxe's is 1048576):
		// the rule is checked on the soft model, which refuses as rxe does.
		backend.differs(t, "max_pd is the device's, too many directories to fill here")
		return
	}
	d := startDaemon(t, daemonConfig{Verbs: "soft_max_pd = 4"})
	for _, dir := range []string{"a", "b", "c"} { // and the root's PD
		if err := os.Mkdir(d.path(dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, errOut, err := run(t, "mkdir", d.path("d"))
	if err == nil || !strings.Contains(errOut, "No space left on device") {
		t.Errorf("mkdir past max_pd 4: %v %q; want No space left on device", err, errOut)
	}
	if _, ok := d.waitLog(regexp.MustCompile(`max_pd.*value=4|limit=max_pd`), 2*time.Second); !ok {
		t.Error("the log does not name max_pd")
	}
	if err := os.Remove(d.path("a")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(d.path("d"), 0o755); err != nil {
		t.Errorf("mkdir once a directory went: %v", err)
	}
}
