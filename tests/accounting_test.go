package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Every page the store holds is charged to someone (DESIGN.md,
// "Accounting"): these tests run what users do on a shared mount and read
// what the daemon says it holds against what the store holds.

// readInt reads a number from a file such as a sysctl.
func readInt(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}

// sharedDir opens the mount to other users: the test's directories on
// the way become 0755, and a 0777 directory of the mount is returned (not
// sticky: users may remove and, through fs.protected_regular, reopen
// each other's files, as root's chown makes them).
func sharedDir(t *testing.T, d *daemon) string {
	t.Helper()
	for p := d.mnt; p != os.TempDir() && p != "/"; p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	shared := d.path("shared")
	if err := os.Mkdir(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	return shared
}

// asUser runs script with sh as uid (gid the same, no other groups).
func asUser(uid int, script string, args ...string) (string, error) {
	cmd := exec.Command("setpriv", append([]string{fmt.Sprintf("--reuid=%d", uid), fmt.Sprintf("--regid=%d", uid), "--clear-groups", "sh", "-c", script, "sh"}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// requireHeld checks the one invariant of the accounting at rest: the
// store holds what the owners are charged, no more and no less. A
// release the kernel sends after a close returns may still be on its way:
// it is waited for, briefly.
func requireHeld(t *testing.T, d *daemon, what string) mrfsStats {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s := readStats(t, d.mnt)
		var users int64
		for _, u := range s.Users {
			users += u.ChargedBytes
		}
		if s.StoreBytes == s.ChargedBytes && users == s.ChargedBytes {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the store holds %d bytes, %d are charged (%d to users: %+v)", what, s.StoreBytes, s.ChargedBytes, users, s.Users)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitReleased waits until no unlinked file is held open or mapped: the
// kernel sends FUSE's RELEASE after a client's close returns, and its
// FORGET after the unlink or the munmap.
func waitReleased(t *testing.T, d *daemon) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second * slowFactor()); readStats(t, d.mnt).OpenUnlinked != 0; {
		if time.Now().After(deadline) {
			t.Fatal("an unlinked file is still held open, though every client closed it")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// dfUsed is what df says the mount uses, in bytes.
func dfUsed(t *testing.T, mnt string) int64 {
	t.Helper()
	out := mustRun(t, "df", "-B1", "--output=used", mnt)
	f := strings.Fields(out)
	n, err := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err != nil {
		t.Fatalf("df: %q", out)
	}
	return n
}

// TestFallocateCharged: fallocate with and without KEEP_SIZE charges the
// owner before the pages exist. The bypass seen on a shared mount
// (`truncate -s 4096 f; fallocate -n -l 200MiB f` as nobody, charged to
// nobody, and then root refused) is EDQUOT at the call; root's own
// buffer fits; df and the stats show what the store holds.
func TestFallocateCharged(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"256MiB\"\nmax_pinned_per_user = \"64MiB\"", Mount: "allow_other = true"})
	shared := sharedDir(t, d)
	out, err := asUser(65534, `cd "$1" && truncate -s 4096 f && fallocate -n -l 200MiB f`, shared)
	if err == nil || !strings.Contains(out, "Disk quota exceeded") {
		t.Errorf("fallocate -n of 200 MiB past a 64 MiB quota: %v %q; want Disk quota exceeded", err, out)
	}
	s := requireHeld(t, d, "after the refused fallocate")
	if s.Users["65534"].ChargedBytes != 4096 {
		t.Errorf("nobody is charged %d bytes after a refused fallocate, want 4096", s.Users["65534"].ChargedBytes)
	}
	// Within the quota it works, and is charged though the size stays.
	if out, err := asUser(65534, `cd "$1" && fallocate -n -l 32MiB f && stat -c %s f`, shared); err != nil || strings.TrimSpace(out) != "4096" {
		t.Fatalf("fallocate -n of 32 MiB within the quota: %v %q", err, out)
	}
	s = requireHeld(t, d, "after fallocate -n")
	if got := s.Users["65534"].ChargedBytes; got != 32<<20 {
		t.Errorf("nobody is charged %d bytes for 32 MiB fallocated past its 4 KiB file, want %d", got, 32<<20)
	}
	if used := dfUsed(t, d.mnt); used != s.StoreBytes {
		t.Errorf("df says %d bytes used, the store holds %d", used, s.StoreBytes)
	}
	// 32 MiB held (4 KiB of it registered), 40 MiB more is past 64 MiB.
	out, err = asUser(65534, `cd "$1" && fallocate -n -o 32MiB -l 40MiB f`, shared)
	if err == nil || !strings.Contains(out, "Disk quota exceeded") {
		t.Errorf("fallocate -n of 40 MiB more over 32 MiB held, quota 64 MiB: %v %q; want Disk quota exceeded", err, out)
	}
	// Past the end, in a range partly held already: only the new pages
	// count.
	out, err = asUser(65534, `cd "$1" && fallocate -n -o 16MiB -l 48MiB f`, shared)
	if err != nil {
		t.Errorf("fallocate -n of [16, 64) MiB over 32 MiB held, quota 64 MiB: %v %q", err, out)
	}
	out, err = asUser(65534, `cd "$1" && fallocate -l 65MiB g`, shared)
	if err == nil || !strings.Contains(out, "Disk quota exceeded") {
		t.Errorf("fallocate of a second file past the quota: %v %q; want Disk quota exceeded", err, out)
	}
	requireHeld(t, d, "after the second file")
	// Another user's own quota is untouched by all of it.
	if out, err := run2(t, "truncate", "-s", "64M", d.path("root")); err != nil {
		t.Errorf("root's 64 MiB beside nobody's 64 MiB (budget 256 MiB): %v %s", err, out)
	}
	s = requireHeld(t, d, "after root's buffer")
	if s.Users["0"].ChargedBytes != 64<<20 || s.Users["65534"].ChargedBytes != 64<<20 {
		t.Errorf("users %+v", s.Users)
	}
	if _, ok := d.waitLog(regexp.MustCompile(`max_pinned_per_user.*uid=65534|uid 65534.*max_pinned_per_user`), 2*time.Second); !ok {
		t.Error("the log does not name the quota of uid 65534")
	}
}

// run2 is run that returns stdout and stderr together.
func run2(t *testing.T, name string, args ...string) (string, error) {
	t.Helper()
	out, errOut, err := run(t, name, args...)
	return out + errOut, err
}

// TestZeroCopyWritesCharged: what a client writes past the end through a
// zero-copy open is charged to the file's owner once the daemon sees it
// (at close): within the quota it is registered; past it, it is taken
// back and the writer's close says so (EDQUOT), as a write past a quota
// fails elsewhere; another user is not refused for it.
func TestZeroCopyWritesCharged(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"64MiB\"\nmax_pinned_per_user = \"8MiB\"", Mount: "allow_other = true"})
	shared := sharedDir(t, d)
	if out, err := asUser(2001, `dd if=/dev/zero of="$1/f" bs=1M count=4 status=none`, shared); err != nil {
		t.Fatalf("4 MiB through a zero-copy open: %v %s", err, out)
	}
	requireRegistered(t, filepath.Join(shared, "f"), 4<<20)
	s := requireHeld(t, d, "after 4 MiB written")
	if s.Users["2001"].ChargedBytes != 4<<20 {
		t.Errorf("uid 2001 charged %d for 4 MiB", s.Users["2001"].ChargedBytes)
	}
	out, err := asUser(2001, `dd if=/dev/zero of="$1/g" bs=1M count=12 status=none`, shared)
	if err == nil || !strings.Contains(out, "Disk quota exceeded") {
		t.Errorf("12 MiB more past an 8 MiB quota: %v %q; want dd to report Disk quota exceeded at close", err, out)
	}
	s = requireHeld(t, d, "after the writes past the quota")
	if got := s.Users["2001"].ChargedBytes; got != 4<<20 {
		t.Errorf("uid 2001 charged %d, want the 4 MiB of f: g's writes past the quota are taken back", got)
	}
	if fi, err := os.Stat(filepath.Join(shared, "g")); err != nil || fi.Size() != 0 {
		t.Errorf("g after writes past the quota: %v, %v; want 0 bytes", fi, err)
	}
	if _, ok := d.waitLog(regexp.MustCompile(`uid 2001 wrote .* past its max_pinned_per_user`), 2*time.Second); !ok {
		t.Error("the log does not say writes past the quota were taken back")
	}
	if out, err := asUser(2002, `truncate -s 8M "$1/other"`, shared); err != nil {
		t.Errorf("uid 2002 inside its quota: %v %s", err, out)
	}
	if out, err := asUser(2001, `truncate -s 4M "$1/h"`, shared); err != nil {
		t.Errorf("uid 2001 inside its quota again: %v %s", err, out)
	}
	requireHeld(t, d, "at the end")
}

// TestOpenUnlinkedCharged: an unlinked file a client holds open keeps its
// memory, charged to its owner (and counted against the quota) until the
// client lets go; ftruncate, fallocate and fchown through the open
// descriptor work as on tmpfs, fchown moving the charge.
func TestOpenUnlinkedCharged(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"64MiB\"\nmax_pinned_per_user = \"8MiB\""})
	f, err := os.OpenFile(d.path("f"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(make([]byte, 2<<20)); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(d.path("f")); err != nil {
		t.Fatal(err)
	}
	s := requireHeld(t, d, "unlinked, open")
	if s.OpenUnlinked != 1 || s.Users["0"].ChargedBytes != 2<<20 || s.Buffers != 0 {
		t.Errorf("with an unlinked file open: %+v", s)
	}
	if err := f.Truncate(6 << 20); err != nil {
		t.Errorf("ftruncate of an unlinked file: %v", err)
	}
	if err := unix.Fallocate(int(f.Fd()), 0, 0, 6<<20); err != nil {
		t.Errorf("fallocate of an unlinked file: %v", err)
	}
	s = requireHeld(t, d, "after fallocate through the unlinked file")
	if s.Users["0"].ChargedBytes != 6<<20 {
		t.Errorf("root charged %d for 6 MiB it holds unlinked", s.Users["0"].ChargedBytes)
	}
	// The quota holds for it: 6 MiB held, 4 MiB more is past 8 MiB.
	wantErrno(t, unix.Fallocate(int(f.Fd()), 0, 0, 10<<20), unix.EDQUOT, "fallocate of an unlinked file past the quota")
	wantErrno(t, os.Truncate(d.path("g"), 4<<20), unix.ENOENT, "no g yet")
	makeBuffer(t, d.path("g"), 0)
	wantErrno(t, os.Truncate(d.path("g"), 4<<20), unix.EDQUOT, "a second file while the unlinked one holds 6 of 8 MiB")
	if err := f.Chown(2001, 2001); err != nil {
		t.Errorf("fchown of an unlinked file: %v", err)
	}
	s = requireHeld(t, d, "after fchown")
	if s.Users["2001"].ChargedBytes != 6<<20 || s.Users["0"].ChargedBytes != 0 {
		t.Errorf("after fchown to 2001: users %+v", s.Users)
	}
	if err := os.Truncate(d.path("g"), 4<<20); err != nil {
		t.Errorf("root's own file once the unlinked one is 2001's: %v", err)
	}
	f.Close()
	waitReleased(t, d)
	s = requireHeld(t, d, "after the last close")
	if s.OpenUnlinked != 0 || s.Users["2001"].ChargedBytes != 0 || s.ChargedBytes != 4<<20 {
		t.Errorf("after the unlinked file's close: %+v", s)
	}
}

// TestRemovedFileMakesRoom: a file that filled the budget through a
// zero-copy open, then removed, makes room for the next call at once,
// though the kernel's RELEASE of the writer's close reaches the daemon
// only after that close returned: admission waits for it briefly. First
// with the file removed while still open (so that its release is the
// daemon's last word on it, every time), then as a shell does it. The
// first round closes the file only once the truncate that needs its room
// has been asked for, so that a refusal not waiting for the release
// fails here every time, not only when the RELEASE comes late.
func TestRemovedFileMakesRoom(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: `max_pinned = "16MiB"`})
	// removedWhileOpen fills the budget through f, removes f and returns
	// it still open.
	removedWhileOpen := func() *os.File {
		// The write below goes to the store, not through the daemon: the
		// memory of the files removed before must be back (at the
		// kernel's FORGET, which comes after the unlink returns).
		waitReleased(t, d)
		f, err := os.OpenFile(d.path("f"), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write(make([]byte, 15<<20)); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(d.path("f")); err != nil {
			t.Fatal(err)
		}
		return f
	}
	removeG := func() {
		if err := os.Remove(d.path("g")); err != nil {
			t.Fatal(err)
		}
	}
	f := removedWhileOpen()
	makeBuffer(t, d.path("g"), 0)
	closed := time.AfterFunc(200*time.Millisecond, func() { f.Close() })
	if err := os.Truncate(d.path("g"), 5<<20); err != nil {
		t.Errorf("truncate while the removed file was being closed: %v", err)
	}
	if closed.Stop() {
		t.Error("the truncate returned before the removed file's close")
		f.Close()
	}
	removeG()
	for range 5 {
		removedWhileOpen().Close()
		makeBuffer(t, d.path("g"), 5<<20) // right after the close
		removeG()
	}
	script := `
set -u
for i in 1 2 3 4 5 6 7 8; do
  dd if=/dev/zero of="$1/f" bs=1M count=24 status=none 2>/dev/null && { echo "dd of 24 MiB fit a 16 MiB budget"; exit 1; }
  rm "$1/f"
  truncate -s 5M "$1/g" || { echo "truncate after rm failed, round $i"; exit 1; }
  rm "$1/g"
done`
	if out, err := run2(t, "sh", "-c", script, "sh", d.mnt); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	requireHeld(t, d, "at the end")
}
