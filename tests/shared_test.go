package tests

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestNoStallDuringRegistration: while a 1 GiB registration holds a
// buffer (slowed per chunk by the test hook) and an rm of that buffer
// waits for it, every other name of the mount answers: ls of another
// directory and stat of names there complete while both still run.
// (Before, unlink held the namespace lock while it waited, and stat took
// as long as the registration: 11.4 s for 3 GiB.) Two registrations: a
// truncate, during which the kernel itself keeps the rm from the daemon
// (it holds the file's inode lock), and the flush at the close of a
// zero-copy write past the end, during which the rm reaches the daemon's
// unlink and waits there. Each again with both CPUs kept busy by other
// processes (a stall of 6.6 s was seen once on a loaded machine).
func TestNoStallDuringRegistration(t *testing.T) {
	t.Parallel()
	const size = 1 << 30
	d := startDaemon(t, daemonConfig{Buffers: "populate_threshold = \"16MiB\"\npopulate_workers = 2", Env: []string{"MRFS_TEST_CHUNK_DELAY=100ms"}})
	if err := os.Mkdir(d.path("b"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		makeBuffer(t, d.path("b", strconv.Itoa(i)), 4096)
	}
	for _, way := range []string{"truncate", "flush", "truncate-busy", "flush-busy"} {
		t.Run(way, func(t *testing.T) {
			if w, ok := strings.CutSuffix(way, "-busy"); ok {
				way = w
				busyCPUs(t)
			}
			dir := d.path("a-" + t.Name()[strings.LastIndex(t.Name(), "/")+1:])
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			big := filepath.Join(dir, "big")
			makeBuffer(t, big, 0)
			grown, grew := growBig(t, big, size, way)
			noStall(t, d, big, size, grown, grew)
		})
	}
}

// busyCPUs keeps every CPU busy with a process of its own until the
// test ends.
func busyCPUs(t *testing.T) {
	for range runtime.NumCPU() {
		burner := exec.Command("sh", "-c", "while :; do :; done")
		if err := burner.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { burner.Process.Kill(); burner.Wait() })
	}
}

// growBig starts a registration of big to size bytes: a truncate, or
// (way "flush") one byte written at the end through a zero-copy open and
// a close, whose FLUSH registers the new size. grown is closed when the
// call that registers returns; grew then says how it ended. Whoever looks
// at the file first after such a write registers (a getxattr too), so the
// write and the close are one step here, and the caller's first look
// waits a moment for the FLUSH to have begun.
func growBig(t testing.TB, big string, size int, way string) (grown <-chan struct{}, grew func() error) {
	t.Helper()
	if way == "truncate" {
		cmd := exec.Command("truncate", "-s", strconv.Itoa(size), big)
		return started(t, cmd), func() error {
			if !cmd.ProcessState.Success() {
				return fmt.Errorf("truncate: %v", cmd.ProcessState)
			}
			return nil
		}
	}
	f, err := os.OpenFile(big, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err = f.WriteAt([]byte{1}, int64(size-1)); err != nil {
			f.Close()
			return
		}
		err = f.Close()
	}()
	time.Sleep(time.Duration(slowFactor()) * 100 * time.Millisecond)
	return done, func() error { return err }
}

// noStall: while a registration of size bytes of big runs (grown is
// closed at its end), an rm of big; ls and stat in d's directory b must
// answer while both run.
func noStall(t *testing.T, d *daemon, big string, size int, grown <-chan struct{}, grew func() error) {
	waitRegistering(t, big, size, grown)
	rm := exec.Command("rm", big)
	removed := started(t, rm)
	// rm is in the daemon's unlink now (or the kernel's), waiting for the
	// registration.
	time.Sleep(200 * time.Millisecond)

	running := func() bool {
		select {
		case <-removed:
			return false
		case <-grown:
			return false
		default:
			return true
		}
	}
	if !running() {
		t.Fatal("the registration or the rm ended before the lookups began: the registration did not last")
	}
	answered, slowest := 0, time.Duration(0)
	for i := 0; running(); i++ {
		start := time.Now()
		ents, err := os.ReadDir(d.path("b"))
		if err != nil || len(ents) != 20 {
			t.Fatalf("ls b: %d entries, %v", len(ents), err)
		}
		if _, err := os.Stat(d.path("b", "new"+strconv.Itoa(i))); !os.IsNotExist(err) {
			t.Fatalf("stat of a name that is not there: %v", err)
		}
		if _, err := os.Stat(d.path("b", strconv.Itoa(i%20))); err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		slowest = max(slowest, took)
		if running() {
			answered++
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%d rounds of ls and stat answered while the registration and the rm ran; the slowest took %v", answered, slowest)
	if answered < 3 {
		t.Errorf("only %d rounds of ls and stat of another directory answered while a registration and an rm waiting for it ran: the namespace stalls", answered)
	}
	<-removed
	<-grown
	if !rm.ProcessState.Success() {
		t.Errorf("rm: %v", rm.ProcessState)
	}
	if err := grew(); err != nil {
		t.Error(err)
	}
	if _, err := os.Stat(big); !os.IsNotExist(err) {
		t.Errorf("big after rm: %v", err)
	}
	requireHeld(t, d, "after rm")
}

// TestMapCountLimit: on the kernel's default vm.max_map_count (never
// lowered here: it is the machine's), creating 4 KiB buffers (one mapping
// each) until refused ends in ENOSPC that names vm.max_map_count, its
// value and the fix, before the daemon runs out of mappings for itself:
// the daemon lives, every earlier buffer is intact, and status shows the
// mappings. max_buffers is set past the limit so that it is the one hit.
// (Before, the daemon aborted with "runtime: out of memory".)
func TestMapCountLimit(t *testing.T) {
	t.Parallel()
	limit := readInt(t, "/proc/sys/vm/max_map_count")
	if limit > 1<<20 {
		t.Skipf("vm.max_map_count is %d on this machine: too many buffers to reach it in a test", limit)
	}
	cfg := daemonConfig{Buffers: fmt.Sprintf("max_buffers = %d\nmax_pinned = \"2GiB\"", 2*limit), Quiet: true, Hang: 5 * time.Minute}
	if slowFactor() > 1 {
		// Under emulation 64,000 buffers take too long: the daemon keeps
		// more of the limit for itself (a test hook), and meets it after
		// about 1,500.
		cfg.Env = []string{fmt.Sprintf("MRFS_TEST_MAP_RESERVE=%d", limit-1500)}
	}
	d := startDaemon(t, cfg)
	dir := d.path("many")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	n := 0
	var refused error
	for ; n < int(2*limit); n++ {
		fd, err := unix.Open(filepath.Join(dir, strconv.Itoa(n)), unix.O_CREAT|unix.O_RDWR, 0o600)
		if err != nil {
			refused = fmt.Errorf("create: %w", err)
			break
		}
		err = unix.Ftruncate(fd, 4096)
		unix.Close(fd)
		if err != nil {
			refused = fmt.Errorf("ftruncate: %w", err)
			break
		}
	}
	t.Logf("%d buffers of 4 KiB before the refusal: %v", n, refused)
	if refused == nil || !strings.Contains(refused.Error(), "ftruncate") {
		t.Fatalf("after %d buffers: %v; want the registration (ftruncate) refused", n, refused)
	}
	wantErrno(t, refused, unix.ENOSPC, "the registration past vm.max_map_count")
	if d.exited() {
		t.Fatalf("the daemon died:\n%s", tail(d.stderr.String(), 30))
	}
	if line, ok := d.waitLog(regexp.MustCompile(`vm\.max_map_count \(`+strconv.FormatInt(limit, 10)+`\).*sysctl vm\.max_map_count=`), 5*time.Second); !ok {
		t.Errorf("the log does not name vm.max_map_count, its value and the fix")
	} else {
		t.Logf("log: %s", line)
	}
	s := readStats(t, d.mnt)
	if s.Limits.MaxMapCount != limit || s.Mappings > limit || s.Mappings < int64(n) || s.MapRoom != 0 {
		t.Errorf("stats: %d mappings of %d, room for %d more, for %d buffers; want no room left", s.Mappings, s.Limits.MaxMapCount, s.MapRoom, n)
	}
	if s.RegisteredBytes != int64(n)*4096 || s.Buffers != int64(n)+1 {
		t.Errorf("stats: %d buffers, %d bytes registered; want %d registered buffers of 4 KiB (and the refused one, empty)", s.Buffers, s.RegisteredBytes, n)
	}
	// Every earlier buffer is intact: some are looked at one by one, and
	// the first and the last take bytes and give them back.
	for _, i := range append([]int{0, n - 1}, rand.Perm(n)[:200]...) {
		f := filepath.Join(dir, strconv.Itoa(i))
		if st := mustXattr(t, f, xState); st != "registered" {
			t.Fatalf("buffer %d: state %q", i, st)
		}
	}
	// Written in place (no O_TRUNC: at the edge, a truncate to 0 and a new
	// registration would race the runtime's own mappings for the one
	// freed, which the daemon counts as they come).
	for _, i := range []int{0, n - 1} {
		f := filepath.Join(dir, strconv.Itoa(i))
		fh, err := os.OpenFile(f, os.O_RDWR, 0)
		if err == nil {
			_, err = fh.WriteAt([]byte("still here"), 0)
			if cerr := fh.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			t.Fatalf("write buffer %d: %v", i, err)
		}
		if b, err := os.ReadFile(f); err != nil || len(b) != 4096 || string(b[:10]) != "still here" {
			t.Fatalf("read buffer %d: %d bytes, %q %v", i, len(b), b[:min(len(b), 10)], err)
		}
	}
	// Room again once buffers go.
	for i := range 100 {
		if err := os.Remove(filepath.Join(dir, strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Truncate(filepath.Join(dir, strconv.Itoa(n)), 4096); err != nil {
		t.Errorf("a buffer once others were removed: %v", err)
	}
}
