package tests

import (
	"context"
	"errors"
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

	"mrfs/internal/bytesize"
)

// populate creates registered buffers in the root and a sub-PD.
// Afterwards the daemon holds populatedFreed: what its teardown must free.
func populate(t *testing.T, d *daemon) {
	t.Helper()
	makeBuffer(t, d.path("a"), 1<<20)
	if err := os.Mkdir(d.path("tenant"), 0o700); err != nil {
		t.Fatal(err)
	}
	makeBuffer(t, d.path("tenant", "b"), 256<<10)
	makeBuffer(t, d.path("empty"), 0)
	mustSh(t, "echo hello > "+d.path("tenant", "msg"))
}

// populatedFreed is what the teardown of a populated mount frees, as its
// log lines say it: three regions (the empty file has none) of 1 MiB,
// 256 KiB and one page, in two PDs.
var populatedFreed = fmt.Sprintf("deregistered_regions=3 deallocated_pds=2 unpinned_bytes=%d", 1<<20+256<<10+pageSize)

// requireFreedLog wants a log line matching re that reports populatedFreed.
func requireFreedLog(t *testing.T, d *daemon, re *regexp.Regexp) {
	t.Helper()
	line, ok := d.waitLog(re, stopTimeout)
	if !ok {
		t.Fatalf("no log line matching %q; log:\n%s", re, tail(d.stderr.String(), 20))
	}
	if !strings.Contains(line, populatedFreed) {
		t.Errorf("log line %q does not report what the teardown freed: %s", line, populatedFreed)
	}
}

var teardownCompleteRe = regexp.MustCompile(`msg="teardown complete"`)

// TestSIGINTTeardown: with registered buffers (pinned while running), SIGINT
// makes the daemon tear down, unmount and exit 0.
func TestSIGINTTeardown(t *testing.T) {
	t.Parallel()
	testSignalTeardown(t, syscall.SIGINT)
}

// TestSIGTERMTeardown: the same for SIGTERM.
func TestSIGTERMTeardown(t *testing.T) {
	t.Parallel()
	testSignalTeardown(t, syscall.SIGTERM)
}

func testSignalTeardown(t *testing.T, sig syscall.Signal) {
	d := startDaemon(t, daemonConfig{})
	populate(t, d)
	s := readStats(t, d.mnt)
	if s.PinnedBytes < 1<<20+256<<10 {
		t.Errorf("stats pinned_bytes = %d, want >= %d", s.PinnedBytes, 1<<20+256<<10)
	}
	pid := d.pid()
	lck := procStatusKB(t, pid, backend.pinned)
	if lck <= 0 || lck*1024 < s.PinnedBytes {
		t.Errorf("daemon %s = %d kB while %d bytes are pinned; the %s backend's pins count there", backend.pinned, lck, s.PinnedBytes, backend.name)
	}

	if code := d.stop(sig); code != 0 {
		t.Errorf("exit status after %v = %d, want 0 (%v)", sig, code, d.waitErr)
	}
	if isMounted(d.mnt) {
		t.Errorf("%s still mounted after %v", d.mnt, sig)
	}
	if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("daemon process %d still exists (pins would outlive it): %v", pid, err)
	}
	// Nothing of mrfs is left at the mountpoint: it is an empty plain dir.
	ents, err := os.ReadDir(d.mnt)
	if err != nil || len(ents) != 0 {
		t.Errorf("mountpoint after exit: %v entries, err %v", len(ents), err)
	}
	requireFreedLog(t, d, teardownCompleteRe)
}

// TestTeardownFreesWhileAlive: the teardown itself deregisters every
// region and deallocates every PD, before the device closes (which
// would release them anyway) and before the exit. The test hook
// MRFS_TEST_PAUSE_AFTER_TEARDOWN holds the daemon at that point: it
// locks no page any more and reports what it freed.
func TestTeardownFreesWhileAlive(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Env: []string{"MRFS_TEST_PAUSE_AFTER_TEARDOWN=1"}})
	populate(t, d)
	pid := d.pid()
	if lck := procStatusKB(t, pid, backend.pinned); lck*1024 < 1<<20+256<<10 {
		t.Fatalf("daemon %s = %d kB with 1.25 MiB registered; the %s backend's pins count there", backend.pinned, lck, backend.name)
	}
	if err := d.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	requireFreedLog(t, d, regexp.MustCompile(`msg="paused after teardown`))
	if d.exited() {
		t.Fatal("the daemon exited instead of pausing after its teardown")
	}
	if lck := procStatusKB(t, pid, backend.pinned); lck != 0 {
		t.Errorf("daemon %s = %d kB after its teardown, want 0: regions left registered", backend.pinned, lck)
	}
	if code := d.stop(syscall.SIGINT); code != 0 {
		t.Errorf("exit status after the pause = %d, want 0 (%v)", code, d.waitErr)
	}
	requireFreedLog(t, d, teardownCompleteRe)
}

// TestSIGKILLThenUmount: a killed daemon leaves a dead mount; `mrfs umount`
// clears it.
func TestSIGKILLThenUmount(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	populate(t, d)
	d.stop(syscall.SIGKILL)
	if !isMounted(d.mnt) {
		t.Fatalf("precondition: a SIGKILLed daemon cannot unmount, yet %s is not mounted", d.mnt)
	}
	_, err := os.Stat(d.path("a"))
	wantErrno(t, err, unix.ENOTCONN, "stat in a mount whose daemon was killed")
	out, errOut, err := run(t, mrfsBin, "umount", d.mnt)
	if err != nil {
		t.Fatalf("mrfs umount after SIGKILL: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	if isMounted(d.mnt) {
		t.Errorf("%s still mounted after mrfs umount", d.mnt)
	}
	if fi, err := os.Stat(d.mnt); err != nil || !fi.IsDir() {
		t.Errorf("mountpoint after umount: %v", err)
	}
}

// TestMrfsUmountStopsDaemon: `mrfs umount` on a live mount unmounts it and
// the daemon tears down and exits 0.
func TestMrfsUmountStopsDaemon(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	populate(t, d)
	out, errOut, err := run(t, mrfsBin, "umount", d.mnt)
	if err != nil {
		t.Fatalf("mrfs umount: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	if code := d.waitExit(); code != 0 {
		t.Errorf("daemon exit status after mrfs umount = %d, want 0 (%v)", code, d.waitErr)
	}
	if isMounted(d.mnt) {
		t.Errorf("%s still mounted after mrfs umount", d.mnt)
	}
}

// TestMrfsUmountLazy: `mrfs umount --lazy` detaches at once.
func TestMrfsUmountLazy(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	populate(t, d)
	out, errOut, err := run(t, mrfsBin, "umount", "--lazy", d.mnt)
	if err != nil {
		t.Fatalf("mrfs umount --lazy: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	if isMounted(d.mnt) {
		t.Errorf("%s still mounted after mrfs umount --lazy", d.mnt)
	}
	if code := d.waitExit(); code != 0 {
		t.Errorf("daemon exit status after mrfs umount --lazy = %d, want 0 (%v)", code, d.waitErr)
	}
}

// TestStatusTable: `mrfs status` lists buffers with keys and access;
// run by a user who may not read a directory, it lists the rest, names
// that directory, and its buffers still count in the totals.
func TestStatusTable(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true"})
	makeBuffer(t, d.path("alpha.buf"), 4<<20)
	mustSetxattr(t, d.path("alpha.buf"), xAccess, "local_write,remote_read")
	if err := os.Mkdir(d.path("tenant"), 0o700); err != nil {
		t.Fatal(err)
	}
	makeBuffer(t, d.path("tenant", "beta.buf"), 64<<10)
	makeBuffer(t, d.path("gamma.empty"), 0)
	out := mustRun(t, "mrfs", "status", d.mnt)
	// Every row in full: PATH PD LENGTH STATE LKEY RKEY ADDR ACCESS.
	row := func(p, rel string) string {
		return strings.Join([]string{rel, mustXattr(t, p, xPD), mustXattr(t, p, xLength), mustXattr(t, p, xState),
			mustXattr(t, p, xLkey), mustXattr(t, p, xRkey), mustXattr(t, p, xAddr), mustXattr(t, p, xAccess)}, " ")
	}
	lines := map[string]bool{}
	for _, l := range strings.Split(out, "\n") {
		lines[strings.Join(strings.Fields(l), " ")] = true
	}
	for _, want := range []string{
		row(d.path("alpha.buf"), "alpha.buf"),
		row(d.path("tenant", "beta.buf"), "tenant/beta.buf"),
		strings.Join([]string{"gamma.empty", mustXattr(t, d.path("gamma.empty"), xPD), "0", "empty", "-", "-", "-", "local_write"}, " "),
	} {
		if !lines[want] {
			t.Errorf("mrfs status lacks the row %q:\n%s", want, out)
		}
	}
	// The totals: what the store holds and who is charged, the limits,
	// and the mappings left under vm.max_map_count.
	s := readStats(t, d.mnt)
	for _, want := range []string{
		fmt.Sprintf("memory: the store holds %s, %s charged to owners", bytesize.Format(uint64(s.StoreBytes)), bytesize.Format(uint64(s.ChargedBytes))),
		fmt.Sprintf("by owner: uid 0 %s (3 buffers)", bytesize.Format(uint64(s.ChargedBytes))),
		fmt.Sprintf("mappings: %d of vm.max_map_count %d, room for %d more buffers or pool slots", s.Mappings, s.Limits.MaxMapCount, s.MapRoom),
	} {
		if !strings.Contains(out, want) {
			t.Errorf("mrfs status lacks %q:\n%s", want, out)
		}
	}
	if s.ChargedBytes != 4<<20+64<<10 || s.Limits.MaxMapCount == 0 {
		t.Errorf("stats: %+v", s)
	}
	_, _, err := run(t, mrfsBin, "status", t.TempDir())
	if err == nil {
		t.Errorf("mrfs status on a directory that is not an mrfs mount succeeded")
	}

	for p := d.mnt; p != os.TempDir() && p != "/"; p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	nb, err := asNobody(mrfsBin, "status", d.mnt).CombinedOutput()
	if err != nil || !strings.Contains(string(nb), "\nalpha.buf ") || strings.Contains(string(nb), "beta.buf") ||
		!strings.Contains(string(nb), "not readable by this user: tenant\n") || !strings.Contains(string(nb), "totals: 3 buffers") {
		t.Errorf("mrfs status as uid 65534, with tenant 0700: %v\n%s", err, nb)
	}
}

// TestSIGINTRightAfterReady: once the mount is there, SIGINT must tear the
// daemon down cleanly, however early.
// A daemon that installs its signal handling only after it starts serving
// dies by the signal (no teardown, mount left behind) or, started from a
// shell with `&`, ignores it.
func TestSIGINTRightAfterReady(t *testing.T) {
	t.Parallel()
	for i := 0; i < 20; i++ {
		// Even rounds: the moment the mount shows in mountinfo; odd rounds:
		// once the root answers too.
		d := startDaemon(t, daemonConfig{MountedIsReady: i%2 == 0})
		if code := d.stop(syscall.SIGINT); code != 0 {
			t.Errorf("round %d: SIGINT right after the mount appeared: exit %d (%v), want 0; stderr:\n%s", i, code, d.waitErr, d.stderr)
		}
		if isMounted(d.mnt) {
			t.Errorf("round %d: %s still mounted", i, d.mnt)
		}
	}
}

// TestSIGINTRightAfterReadyFromShell: the same through `mrfs mount &` in a
// script (where SIGINT starts out ignored) and `kill -INT`, as in the
// issue's session.
func TestSIGINTRightAfterReadyFromShell(t *testing.T) {
	t.Parallel()
	requireMountEnv(t)
	w := t.TempDir()
	cfg := filepath.Join(w, "config.toml")
	if err := os.WriteFile(cfg, []byte(daemonConfig{}.toml()), 0o644); err != nil {
		t.Fatal(err)
	}
	const script = `
for round in 1 2 3 4 5; do
  M="$W/mnt$round"
  mkdir "$M"
  mrfs mount --config "$CFG" "$M" >"$W/daemon$round.log" 2>&1 &
  pid=$!
  echo $pid >> "$W/pids"
  until grep -q " $M " /proc/self/mountinfo; do
    kill -0 $pid
  done
  kill -INT $pid
  for i in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.05; done
  if kill -0 $pid 2>/dev/null; then echo "round $round: mrfs ignored SIGINT sent right after its mount appeared"; exit 1; fi
  wait $pid || { echo "round $round: mrfs exited $? after SIGINT"; exit 1; }
  if grep -q " $M " /proc/self/mountinfo; then echo "round $round: still mounted"; exit 1; fi
done
echo rounds-ok
`
	t.Cleanup(func() {
		// Daemons that ignored the signal are bash's children: end them.
		b, _ := os.ReadFile(filepath.Join(w, "pids"))
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil || syscall.Kill(pid, 0) != nil {
				continue
			}
			if comm, _ := os.ReadFile("/proc/" + f + "/comm"); strings.TrimSpace(string(comm)) == "mrfs" {
				_ = syscall.Kill(pid, syscall.SIGINT) // handled by now
			}
		}
		time.Sleep(500 * time.Millisecond)
		for i := 1; i <= 5; i++ {
			m := filepath.Join(w, "mnt"+strconv.Itoa(i))
			if isMounted(m) {
				_ = exec.Command("umount", "-l", m).Run()
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", "set -e\n"+script)
	cmd.Env = append(os.Environ(), "W="+w, "CFG="+cfg)
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "rounds-ok") {
		t.Errorf("%v\n%s", err, out)
	}
}
