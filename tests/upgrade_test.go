package tests

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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

// upgrade runs `mrfs upgrade` on d and returns its output.
func upgrade(t *testing.T, d *daemon, args ...string) (string, error) {
	t.Helper()
	out, err := exec.Command(mrfsBin, append([]string{"upgrade", "--timeout", "30s"}, append(args, d.mnt)...)...).CombinedOutput()
	return string(out), err
}

// nodeFacts are what a restart must keep of a node: its inode number,
// type and mode, owner, size and bytes (a file's), token (a directory's).
func nodeFacts(t *testing.T, path string) string {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	facts := fmt.Sprintf("ino %d mode %o uid %d gid %d size %d", st.Ino, st.Mode, st.Uid, st.Gid, st.Size)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		tok, err := getxattr(path, xToken)
		return fmt.Sprintf("%s token %s %v", facts, tok, err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return fmt.Sprintf("%s bytes %x", facts, sha256.Sum256(b))
}

// desc is the part of user.mrfs.desc an upgrade changes.
type upgradeDesc struct {
	RKey       string `json:"rkey"`
	Generation int    `json:"generation"`
}

func descOf(t *testing.T, path string) upgradeDesc {
	t.Helper()
	var d upgradeDesc
	if err := json.Unmarshal([]byte(mustXattr(t, path, xDesc)), &d); err != nil {
		t.Fatal(err)
	}
	return d
}

// TestUpgradeInPlace upgrades a daemon while a client holds a file open
// (read-write, zero copy), a mapping of another whose descriptor it
// closed, and a directory open, and while another loops over stat and
// listings (heldThrough). The daemon keeps its pid.
func TestUpgradeInPlace(t *testing.T) {
	t.Parallel()
	d, _ := startRemoteConf(t, remoteConfig())
	heldThrough(t, d, "the upgrade", func() {
		if out, err := upgrade(t, d); err != nil || !strings.Contains(out, "upgraded in place") {
			t.Errorf("mrfs upgrade: %v: %s\ndaemon:\n%s", err, out, d.stderr)
		}
	}, true)
}

// TestCrashUnderKeeper: the daemon under a keeper (mount --keeper) is
// SIGKILLed while a client holds what TestUpgradeInPlace's holds, and a
// removed file open; the keeper starts another daemon, which takes the
// mount over from the journal: as after an upgrade (heldThrough), but a
// new pid; the removed file, which no name holds, reads on through its
// descriptor (the kernel's backing file) and its memory goes at its
// close (the new daemon swept it from the store).
func TestCrashUnderKeeper(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Remote: remoteConfig(), Keeper: true})
	gonePath := d.path("gone")
	if err := os.WriteFile(gonePath, patternBytes(64<<10), 0o600); err != nil {
		t.Fatal(err)
	}
	gone, err := os.Open(gonePath)
	if err != nil {
		t.Fatal(err)
	}
	defer gone.Close()
	if err := os.Remove(gonePath); err != nil {
		t.Fatal(err)
	}
	heldThrough(t, d, "the crash", func() {
		killDaemon(t, d)
		b := make([]byte, 64<<10)
		if _, err := gone.ReadAt(b, 0); err != nil || !bytes.Equal(b, patternBytes(64<<10)) {
			t.Errorf("a removed file read through its descriptor after the crash: %v", err)
		}
		gone.Close() // its memory goes: heldThrough finds the store as charged
	}, false)
}

// killDaemon SIGKILLs d's daemon and waits until another one (a keeper's,
// systemd's) answers the mount. A request the kernel was copying to the
// killed daemon fails with EIO (heldThrough): such an answer is asked
// again. A mount nobody takes over (its connection held, nobody serving)
// is aborted then: the test fails instead of hanging in the kernel.
func killDaemon(t *testing.T, d *daemon) { killDaemonAt(t, d.mnt) }

// killDaemonAt is killDaemon of the mount at mnt, whoever started it.
func killDaemonAt(t *testing.T, mnt string) {
	t.Helper()
	pid := readStats(t, mnt).PID
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wait := 30 * time.Second * slowFactor()
	hung := time.AfterFunc(wait, func() { abortMount(t, mnt) })
	defer hung.Stop()
	deadline := time.Now().Add(wait)
	for {
		raw, err := getxattr(mnt, xStats)
		switch {
		case err == nil:
			var s mrfsStats
			if err := json.Unmarshal([]byte(raw), &s); err != nil {
				t.Fatalf("user.mrfs.stats: %v", err)
			}
			if s.PID != pid {
				return
			}
		case err != syscall.EIO:
			t.Fatalf("the mount after its daemon (pid %d) was killed: %v", pid, err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("no daemon took the mount over within %v of the kill of pid %d", wait, pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// heldThrough restarts d's daemon (restart) while a client holds a file
// open (read-write, zero copy, opened to truncate), a mapping of another
// whose descriptor it closed, and a directory open, and while another
// loops over stat and listings. Every name, inode number, mode, owner,
// byte and token is the same after; every key is new and every
// generation one more; the open descriptor, the directory and the
// mapping work on, their writes landing in the files the new daemon
// registered (a peer reads them with the new keys); a new open of a file
// a descriptor from before holds works (the kernel's backing file is
// kept); the loop sees no error; and when all is closed nothing is left
// open or uncharged. samePID: the daemon keeps its pid (an upgrade).
func heldThrough(t *testing.T, d *daemon, what string, restart func(), samePID bool) {
	t.Helper()
	sub := d.path("sub")
	if err := os.Mkdir(sub, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(sub, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	const size = 1 << 20
	a, b := d.path("a"), filepath.Join(sub, "b")
	remoteBuf(t, a, size, allRemote)
	if err := os.WriteFile(a, patternBytes(size), 0o600); err != nil {
		t.Fatal(err)
	}
	// Held open across the upgrade, opened to truncate: opened again by
	// the new daemon, it must not be truncated again.
	fb, err := os.OpenFile(b, os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	if _, err := fb.Write([]byte("bee")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(b, 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(d.path("empty"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	paths := []string{d.mnt, sub, a, b, d.path("empty")}
	before := map[string]string{}
	for _, p := range paths {
		before[p] = nodeFacts(t, p)
	}
	descA, descB := descOf(t, a), descOf(t, b)
	life := readStats(t, d.mnt)

	// What else the client holds across the upgrade.
	m := mapClosed(t, d, a, size)
	only := d.path("only-mapped") // no descriptor, no name after the restart
	if err := os.WriteFile(only, []byte("only"), 0o600); err != nil {
		t.Fatal(err)
	}
	mOnly := mapClosed(t, d, only, os.Getpagesize())
	fa, err := os.Open(a) // its passthrough backing is the kernel's from before
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	dir, err := os.Open(sub)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()

	// A metadata loop through the upgrade: it may pause, never fail.
	var stop atomic.Bool
	var loops atomic.Int64
	var loopErrs []string
	var wg sync.WaitGroup
	wg.Go(func() {
		for ; !stop.Load(); loops.Add(1) {
			var st unix.Stat_t
			if err := unix.Stat(a, &st); err != nil {
				loopErrs = append(loopErrs, "stat: "+err.Error())
			}
			if _, err := os.ReadDir(d.mnt); err != nil {
				loopErrs = append(loopErrs, "readdir: "+err.Error())
			}
		}
	})

	restart()
	if t.Failed() {
		stop.Store(true)
		wg.Wait()
		t.FailNow()
	}
	// Long enough for the kernel to forget names it was given before the
	// upgrade (forget.go): lookup counts the new daemon did not restore
	// right would fail it then.
	time.Sleep(2 * time.Second)
	n := loops.Load()
	time.Sleep(500 * time.Millisecond)
	if loops.Load() == n {
		// A daemon that stopped answering would hold every call below:
		// end it (its mount aborts), and fail now.
		d.abort()
		d.kill()
		stop.Store(true)
		wg.Wait()
		t.Fatalf("the metadata loop stopped after %s: the daemon answers no more; stderr:\n%s", what, tail(d.stderr.String(), 60))
	}
	stop.Store(true)
	wg.Wait()
	if len(loopErrs) == 1 && strings.HasSuffix(loopErrs[0], syscall.EIO.Error()) {
		// A request the kernel was copying to the daemon as its reader
		// threads were killed fails with EIO (fuse_dev_do_read: the copy
		// to a dying reader's buffer fails), and is never sent again: a
		// crash kills them, and so does an upgrade's exec (it kills
		// every other thread of the process). Seen once in an upgrade,
		// under the mutation check's load. At most one such request is
		// under way per reader of the loop.
		t.Logf("the metadata loop met %s mid-request: %s", what, loopErrs[0])
		loopErrs = nil
	}
	if len(loopErrs) > 0 {
		t.Errorf("the metadata loop failed %d times through %s: %v", len(loopErrs), what, loopErrs[:min(len(loopErrs), 5)])
	}

	now := readStats(t, d.mnt)
	if (now.PID == life.PID) != samePID || now.Restarts != life.Restarts+1 || now.Started == life.Started || d.exited() {
		t.Fatalf("after %s: pid %d restarts %d started %s, before pid %d restarts %d started %s",
			what, now.PID, now.Restarts, now.Started, life.PID, life.Restarts, life.Started)
	}
	if out, err := exec.Command(mrfsBin, "status", d.mnt).CombinedOutput(); err != nil || !strings.Contains(string(out), "1 restart survived") {
		t.Errorf("mrfs status after %s: %v\n%s", what, err, out)
	}
	for _, p := range paths {
		if got := nodeFacts(t, p); got != before[p] {
			t.Errorf("%s after %s: %s, before: %s", p, what, got, before[p])
		}
	}
	for _, c := range []struct {
		path string
		was  upgradeDesc
	}{{a, descA}, {b, descB}} {
		if got := descOf(t, c.path); got.RKey == c.was.RKey || got.Generation != c.was.Generation+1 {
			t.Errorf("%s: rkey %s generation %d after %s, before %s %d: want a new key, one generation more",
				c.path, got.RKey, got.Generation, what, c.was.RKey, c.was.Generation)
		}
	}

	// What the client held works on.
	copy(m[100:], "through the old mapping")
	if _, err := fb.WriteAt([]byte("through the old descriptor"), 3); err != nil {
		t.Errorf("write through a descriptor opened before the upgrade: %v", err)
	}
	if names, err := dir.Readdirnames(-1); err != nil || len(names) != 1 || names[0] != "b" {
		t.Errorf("list a directory opened before the upgrade: %v %v", names, err)
	}
	fa2, err := os.OpenFile(a, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("a new open of a file a descriptor from before holds: %v", err)
	}
	defer fa2.Close()
	got := make([]byte, 23)
	if _, err := fa2.ReadAt(got, 100); err != nil || string(got) != "through the old mapping" {
		t.Errorf("the old mapping's write, read by a new descriptor: %q %v", got, err)
	}
	if b2, err := os.ReadFile(b); err != nil || string(b2) != "beethrough the old descriptor" {
		t.Errorf("the old descriptor's write: %q %v", b2, err)
	}
	// A peer with the new keys reads what the old mapping wrote: the new
	// registration is of the same pages.
	addr, rkey := keysOf(t, a)
	// The old mapping's pages are the very pages the new daemon
	// registered (on rxe0 in the guest: the pages the NIC reaches).
	faultIn(m)
	requireSamePages(t, os.Getpid(), sliceAddr(m), now.PID, uintptr(addr), size/pageSize)
	c := dialPD(t, d.remotePeer(t), "/")
	rd := make([]byte, 23)
	if err := c.Read(rd, addr+100, rkey); err != nil || string(rd) != "through the old mapping" {
		t.Errorf("a peer's read with the new keys: %q %v", rd, err)
	}

	// A file the kernel holds only mapped, removed after the restart: its
	// buffer stays, charged, until the munmap.
	if err := os.Remove(only); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // a free would be under way
	if s := readStats(t, d.mnt); s.OpenUnlinked != 1 || s.ChargedBytes != s.StoreBytes {
		// Its pages may be gone: the mapping is not read.
		t.Errorf("a mapped file removed after %s: %d unlinked files held, %d bytes charged of %d in the store; want it held and charged",
			what, s.OpenUnlinked, s.ChargedBytes, s.StoreBytes)
	} else if string(mOnly[:4]) != "only" {
		t.Errorf("a mapped file removed after %s reads %q through its mapping", what, mOnly[:4])
	}
	munmap(mOnly)
	munmap(m)
	fb.Close()
	fa.Close()
	fa2.Close()
	dir.Close()
	waitStats(t, d, "all closed after "+what, func(s mrfsStats) bool {
		return s.OpenFiles == 0 && s.OpenUnlinked == 0 && s.ChargedBytes == s.StoreBytes
	})
	if code := d.stop(syscall.SIGTERM); code != 0 {
		t.Errorf("the daemon after %s exited %d; stderr:\n%s", what, code, d.stderr)
	}
}

// TestUpgradeWhileNamesDrop: upgrades while the daemon tells the kernel
// to drop the names of files made a second before (fs/forget.go) and a
// client looks names up in the same directory. The kernel drops a name
// under the directory's lock, which a lookup holds until the daemon
// answers it: an upgrade that held the lookups while a drop was under way
// never executed the new program (the exec waits for every thread, and
// that one for the lookup). Every upgrade finishes.
func TestUpgradeWhileNamesDrop(t *testing.T) {
	t.Parallel()
	// Each upgrade holds the requests a second (a big namespace's save
	// takes as long): lookups and drops meet the held gate.
	d := startDaemon(t, daemonConfig{Quiet: true, Env: []string{"MRFS_TEST_UPGRADE_HOLD=1s"}})
	var stop atomic.Bool
	var made atomic.Int64
	var wg sync.WaitGroup
	defer func() {
		stop.Store(true)
		wg.Wait()
	}()
	name := func(i int64) string { return d.path(strconv.FormatInt(i, 10)) }
	// Files made all along: their names drop a second later, all along.
	wg.Go(func() {
		for i := int64(0); !stop.Load(); i++ {
			fd, err := unix.Open(name(i), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			if err != nil {
				t.Errorf("create: %v", err)
				return
			}
			unix.Close(fd)
			made.Store(i + 1)
		}
	})
	// Lookups of names dropped already (the kernel asks the daemon).
	for w := range 2 {
		wg.Go(func() {
			for i := int64(w); !stop.Load(); i++ {
				if n := made.Load(); n > 0 {
					var st unix.Stat_t
					unix.Stat(name(i%n), &st)
				}
			}
		})
	}
	time.Sleep(1500 * time.Millisecond) // the drops are under way
	for r := range 8 {
		// A hang is an abort, not a test stuck in the kernel.
		hung := time.AfterFunc(20*time.Second*slowFactor(), d.abort)
		out, err := upgrade(t, d)
		hung.Stop()
		if err != nil || !strings.Contains(out, "upgraded in place") {
			t.Fatalf("upgrade %d while names drop: %v: %s", r+1, err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestKeeperRetriesFailedRestart: a daemon the keeper starts after a
// crash that fails before it takes the mount over (a test hook fails its
// adoption, once) is started again, as a crash is: the mount goes on with
// its files, one restart more.
func TestKeeperRetriesFailedRestart(t *testing.T) {
	t.Parallel()
	once := filepath.Join(t.TempDir(), "fail-once")
	d := startDaemon(t, daemonConfig{Keeper: true, Env: []string{"MRFS_TEST_ADOPT_FAIL=" + once}})
	data := patternBytes(64 << 10)
	if err := os.WriteFile(d.path("kept"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(once, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	killDaemon(t, d)
	if _, err := os.Stat(once); !os.IsNotExist(err) {
		t.Fatalf("no restarted daemon met the failure hook (%v): the test tests nothing", err)
	}
	if s := readStats(t, d.mnt); s.Restarts != 1 {
		t.Errorf("after a crash and a failed restart: %d restarts, want 1", s.Restarts)
	}
	if got, err := os.ReadFile(d.path("kept")); err != nil || !bytes.Equal(got, data) {
		t.Errorf("a file after a crash and a failed restart: %d bytes, %v", len(got), err)
	}
}

// TestUpgradeRefused: what a new program could not take over refuses the
// upgrade before anything is handed over, with the reason, and the mount
// serves on as it was: a removed file still open (the kernel holds a node
// the namespace no longer has), a pool; another user's request, even
// one who may write the mount's root.
func TestUpgradeRefused(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true"})
	keep := d.path("keep")
	if err := os.WriteFile(keep, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	gone, err := os.Create(d.path("gone"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(d.path("gone")); err != nil {
		t.Fatal(err)
	}
	// Only root and the mount's owner may replace its program, whoever
	// may write the root (default_permissions asks that first).
	sharedDir(t, d)
	if err := os.Chmod(d.mnt, 0o777); err != nil {
		t.Fatal(err)
	}
	script := `python3 -c 'import os, sys; os.setxattr(sys.argv[1], "user.mrfs.upgrade", b"")' "$1"`
	if out, err := asUser(65534, script, d.mnt); err == nil || !strings.Contains(out, "Operation not permitted") {
		t.Errorf("an upgrade asked by another user: %v %s, want EPERM", err, out)
	}
	out, err := upgrade(t, d)
	if err == nil || !strings.Contains(out, "removed file still open") {
		t.Errorf("upgrade with a removed file open: %v %s, want refused naming it", err, out)
	}
	gone.Close()
	makePool(t, d, "pool", "4KiB", 2)
	out, err = upgrade(t, d)
	if err == nil || !strings.Contains(out, "pool") {
		t.Errorf("upgrade with a pool: %v %s, want refused naming it", err, out)
	}
	if s := readStats(t, d.mnt); s.Restarts != 0 || s.UpgradeError == "" {
		t.Errorf("after refused upgrades: restarts %d, upgrade_error %q", s.Restarts, s.UpgradeError)
	}
	if b, err := os.ReadFile(keep); err != nil || string(b) != "kept" {
		t.Errorf("the mount after refused upgrades: %q %v", b, err)
	}
}

// TestUpgradeFallsBack: a new program that fails before it took the mount
// over gives it back to the program before, executed again in the same
// process: failing at its configuration (before it took anything), after
// it adopted the store (its metrics address taken), and after it
// restored the namespace (a test hook fails the adoption).
// Each time the old program serves on: same pid, same bytes, the open
// descriptor works, upgrade_error says why and `mrfs upgrade` fails
// naming it; then an upgrade to a working program goes through.
func TestUpgradeFallsBack(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	keep := d.path("keep")
	if err := os.WriteFile(keep, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	held, err := os.OpenFile(d.path("held"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	dir := t.TempDir()
	badMetrics := filepath.Join(dir, "metrics.toml")
	if err := os.WriteFile(badMetrics, []byte(daemonConfig{Metrics: fmt.Sprintf("listen = %q", busy.Addr())}.toml()), 0o644); err != nil {
		t.Fatal(err)
	}
	for i, c := range []struct{ name, env, config, why string }{
		{"config", "", filepath.Join(dir, "missing.toml"), "missing.toml"},
		{"metrics", "", badMetrics, "address already in use"},
		{"adoption", "MRFS_TEST_ADOPT_FAIL=1", d.cfgPath, "the adoption fails"},
	} {
		// The new program: mrfs, run with another configuration.
		prog := filepath.Join(dir, c.name+".sh")
		script := fmt.Sprintf("#!/bin/sh\n%s exec %s mount --config %s %s\n", c.env, mrfsBin, c.config, d.mnt)
		if err := os.WriteFile(prog, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		out, err := upgrade(t, d, "--binary", prog)
		if err == nil || !strings.Contains(out, "took the mount back") || !strings.Contains(out, c.why) {
			t.Fatalf("%s: upgrade to a failing program: %v %s, want it given back, saying %q", c.name, err, out, c.why)
		}
		s := readStats(t, d.mnt)
		if s.PID != d.pid() || s.Restarts != i+1 || !strings.Contains(s.UpgradeError, c.why) {
			t.Errorf("%s: after the fallback pid %d (want %d), restarts %d (want %d), upgrade_error %q", c.name, s.PID, d.pid(), s.Restarts, i+1, s.UpgradeError)
		}
		if b, err := os.ReadFile(keep); err != nil || string(b) != "kept" {
			t.Errorf("%s: a file after the fallback: %q %v", c.name, b, err)
		}
		if _, err := held.WriteAt([]byte(c.name), 0); err != nil {
			t.Errorf("%s: the descriptor held through the fallback: %v", c.name, err)
		}
		if b, err := os.ReadFile(d.path("held")); err != nil || !strings.HasPrefix(string(b), c.name) {
			t.Errorf("%s: what the held descriptor wrote: %q %v", c.name, b, err)
		}
	}
	if out, err := upgrade(t, d); err != nil {
		t.Fatalf("an upgrade after fallbacks: %v %s", err, out)
	}
	if s := readStats(t, d.mnt); s.Restarts != 4 || s.UpgradeError != "" {
		t.Errorf("after the upgrade that worked: restarts %d, upgrade_error %q", s.Restarts, s.UpgradeError)
	}
	if b, err := os.ReadFile(keep); err != nil || string(b) != "kept" {
		t.Errorf("a file after the upgrade: %q %v", b, err)
	}
}

// TestCrashResentNotAppliedTwice: a daemon under a keeper that dies after
// it applied a create (O_EXCL), a mkdir, an unlink and a rename, before
// it answered (a test hook kills it there): the kernel sends each again
// to the next daemon, which answers it from the namespace; the client
// sees each succeed (not EEXIST or ENOENT), once.
func TestCrashResentNotAppliedTwice(t *testing.T) {
	t.Parallel()
	d, trigger := startDying(t)
	if err := os.WriteFile(d.path("old"), []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(d.path("from"), []byte("from"), 0o600); err != nil {
		t.Fatal(err)
	}
	var f *os.File
	throughCrashes(t, d, trigger, []crashStep{
		{"create O_EXCL", func() (err error) {
			f, err = os.OpenFile(d.path("new"), os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o640)
			return err
		}},
		{"mkdir", func() error { return os.Mkdir(d.path("dir"), 0o750) }},
		{"unlink", func() error { return os.Remove(d.path("old")) }},
		{"rename", func() error { return os.Rename(d.path("from"), d.path("to")) }},
	})
	if f != nil {
		if _, err := f.WriteAt([]byte("new"), 0); err != nil {
			t.Errorf("write through the create's descriptor: %v", err)
		}
		f.Close()
	}
	if got, want := namesIn(t, d.mnt), []string{"dir", "new", "to"}; !slices.Equal(got, want) {
		t.Errorf("after the crashes the mount holds %v, want %v", got, want)
	}
	if b, err := os.ReadFile(d.path("new")); err != nil || string(b) != "new" {
		t.Errorf("the created file: %q %v", b, err)
	}
}

// TestCrashResentXattrNotAppliedTwice: as TestCrashResentNotAppliedTwice
// for the settable attributes: a set of a file's access (journaled with
// no request: sent again, it would register the file once more,
// generation one more), and `mrfs register` (a name made, journaled
// with its request: sent again, it would be EEXIST).
func TestCrashResentXattrNotAppliedTwice(t *testing.T) {
	t.Parallel()
	d, trigger := startDying(t)
	if err := os.WriteFile(d.path("f"), []byte("f"), 0o600); err != nil {
		t.Fatal(err)
	}
	src, data := shmSource(t, "resent", 4096, 0, 0o600)
	gen := descOf(t, d.path("f")).Generation
	throughCrashes(t, d, trigger, []crashStep{
		{"setxattr access", func() error {
			return unix.Setxattr(d.path("f"), xAccess, []byte("local_write,remote_read"), 0)
		}},
		{"setxattr register", func() error {
			req := fmt.Sprintf(`{"name": "reg", "source": %q}`, src)
			return unix.Setxattr(d.mnt, "user.mrfs.register", []byte(req), 0)
		}},
	})
	// Registered by the dead daemon, then anew by each restore.
	if a, g := mustXattr(t, d.path("f"), xAccess), descOf(t, d.path("f")).Generation; a != "local_write,remote_read" || g != gen+3 {
		t.Errorf("after the access set through a crash and a crash after: access %q, generation %d, want local_write,remote_read and %d", a, g, gen+3)
	}
	if got, want := namesIn(t, d.mnt), []string{"f", "reg"}; !slices.Equal(got, want) {
		t.Errorf("after the crashes the mount holds %v, want %v", got, want)
	}
	if b, err := os.ReadFile(d.path("reg")); err != nil || !bytes.Equal(b, data) {
		t.Errorf("the file registered in place: %d bytes, %v", len(b), err)
	}
}

// TestUpgradeResentNotAppliedTwice: an upgrade that executes its
// successor after the daemon applied a create (O_EXCL), a mkdir and a
// rename but before their replies went (a test hook holds each reply
// back for good, as a slow writer thread would): the kernel sends each
// again to the successor, which answers it from the namespace (the
// requests the program before handed over); the client sees each
// succeed, once. They are made in a directory of the root: a request
// held in the root would hold the root's lock, which mrfs upgrade's own
// setxattr of the root waits for. Not here: an unlink (its reply held
// keeps the removed file's node in the kernel: the upgrade is refused,
// EBUSY), and mrfs register (the drop of its name waits for its reply,
// and the upgrade for that drop: held for good, it would never end;
// TestCrashResentXattrNotAppliedTwice sends it again after a crash).
func TestUpgradeResentNotAppliedTwice(t *testing.T) {
	t.Parallel()
	hold := filepath.Join(t.TempDir(), "hold")
	d := startDaemon(t, daemonConfig{Env: []string{"MRFS_TEST_HOLD_REPLY=" + hold}})
	sub := d.path("sub")
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(sub, "from"), []byte("from"), 0o600); err != nil {
		t.Fatal(err)
	}
	var f *os.File
	steps := []crashStep{
		{"create O_EXCL", func() (err error) {
			f, err = os.OpenFile(filepath.Join(sub, "new"), os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o640)
			return err
		}},
		{"mkdir", func() error { return os.Mkdir(filepath.Join(sub, "dir"), 0o750) }},
		{"rename", func() error { return os.Rename(filepath.Join(sub, "from"), filepath.Join(sub, "to")) }},
	}
	for _, s := range steps {
		if err := os.WriteFile(hold, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- s.do() }()
		for deadline := time.Now().Add(10 * time.Second * slowFactor()); ; time.Sleep(5 * time.Millisecond) {
			if _, err := os.Stat(hold); err != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the daemon never held its reply", s.what)
			}
		}
		if out, err := upgrade(t, d); err != nil {
			t.Fatalf("mrfs upgrade with the reply of a %s held: %v: %s", s.what, err, out)
		}
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s through an upgrade after it was applied: %v", s.what, err)
			}
		case <-time.After(30 * time.Second * slowFactor()):
			t.Fatalf("%s: no answer 30 s after the upgrade", s.what)
		}
	}
	if f != nil {
		f.Close()
	}
	if got, want := namesIn(t, sub), []string{"dir", "new", "to"}; !slices.Equal(got, want) {
		t.Errorf("after the upgrades the directory holds %v, want %v", got, want)
	}
	if st := readStats(t, d.mnt); st.Restarts != len(steps) {
		t.Errorf("%d restarts, want %d", st.Restarts, len(steps))
	}
}

// startDying mounts under a keeper with the test hook that kills the
// daemon after a change, before its reply, once trigger exists.
func startDying(t *testing.T) (d *daemon, trigger string) {
	trigger = filepath.Join(t.TempDir(), "die")
	return startDaemon(t, daemonConfig{Keeper: true, Env: []string{"MRFS_TEST_DIE_AT_DONE=" + trigger}}), trigger
}

// crashStep is a request the daemon dies (or holds its reply) after
// applying.
type crashStep struct {
	what string
	do   func() error
}

// throughCrashes does each step with the hook armed: each must succeed,
// the daemon must have died after it, and another taken over. (At most
// four: the keeper gives up on a fifth death within 10 s of a start.)
func throughCrashes(t *testing.T, d *daemon, trigger string, steps []crashStep) {
	t.Helper()
	for i, s := range steps {
		if err := os.WriteFile(trigger, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := s.do(); err != nil {
			t.Errorf("%s through a crash after it was applied: %v", s.what, err)
		}
		if _, err := os.Stat(trigger); err == nil {
			t.Fatalf("%s: the daemon did not die after it", s.what)
		}
		if st := readStats(t, d.mnt); st.Restarts != i+1 {
			t.Errorf("after the %s: %d restarts, want %d", s.what, st.Restarts, i+1)
		}
	}
}

// namesIn is what dir lists, sorted.
func namesIn(t *testing.T, dir string) []string {
	t.Helper()
	names, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, n := range names {
		got = append(got, n.Name())
	}
	return got
}

// TestRestartKeepsInPlace: files registered in place (ln -s of a
// /dev/shm file) are kept through an upgrade and a crash under a keeper:
// the same inode, mode, owner, size and bytes, a new registration
// (generation one more) of the same source, which a mapping of the file
// from before and the source itself still share both ways, charged
// once. A file whose source was removed meanwhile, and one whose path
// is another file now, are not taken back (their names go, the rest of
// the mount stays).
func TestRestartKeepsInPlace(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Keeper: true})
	const size = 64 << 10
	src, data := shmSource(t, "keep", size, 0, 0o600)
	if err := os.Symlink(src, d.path("kept")); err != nil {
		t.Fatal(err)
	}
	fh, m := mapShared(t, d.path("kept"), size) // open through the restarts
	before := nodeFacts(t, d.path("kept"))
	if !bytes.Equal(m, data) {
		t.Fatal("the mapping of a file registered in place does not show its source")
	}
	charged := readStats(t, d.mnt).ChargedBytes
	for i, restart := range []struct {
		what string
		do   func()
	}{
		{"upgrade", func() {
			if out, err := upgrade(t, d); err != nil {
				t.Fatalf("mrfs upgrade: %v\n%s", err, out)
			}
		}},
		{"crash", func() { killDaemon(t, d) }},
	} {
		// Sources that cannot be taken back: one removed, one replaced,
		// one resized (its registration dropped for good: stale).
		gone, _ := shmSource(t, fmt.Sprintf("gone%d", i), size, 0, 0o600)
		moved, _ := shmSource(t, fmt.Sprintf("moved%d", i), size, 0, 0o600)
		resized, _ := shmSource(t, fmt.Sprintf("resized%d", i), size, 0, 0o600)
		for name, p := range map[string]string{"gone": gone, "moved": moved, "resized": resized} {
			if err := os.Symlink(p, d.path(name)); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Truncate(resized, 2*size); err != nil {
			t.Fatal(err)
		}
		if st := mustXattr(t, d.path("resized"), xState); !strings.Contains(st, "stale") {
			t.Fatalf("a file registered in place whose source was resized: state %q, want stale", st)
		}
		if err := os.Remove(gone); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(moved, moved+".old"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(moved + ".old") })
		if err := os.WriteFile(moved, make([]byte, size), 0o600); err != nil {
			t.Fatal(err)
		}
		desc := descOf(t, d.path("kept"))
		restart.do()
		if got := nodeFacts(t, d.path("kept")); got != before {
			t.Errorf("after the %s: %s, was %s", restart.what, got, before)
		}
		if got := descOf(t, d.path("kept")); got.Generation != desc.Generation+1 {
			t.Errorf("after the %s: generation %d, was %d", restart.what, got.Generation, desc.Generation)
		}
		for _, name := range []string{"gone", "moved", "resized"} {
			if _, err := os.Stat(d.path(name)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("after the %s, a file registered in place whose source is %s: %v, want it gone", restart.what, name, err)
			}
		}
		// The old mapping, the source and the mount are one memory.
		m[i] = 0xa5
		got := make([]byte, 1)
		if f, err := os.Open(src); err != nil {
			t.Fatal(err)
		} else if _, err := f.ReadAt(got, int64(i)); err != nil || got[0] != 0xa5 {
			t.Errorf("after the %s, a write through the mapping from before reads %x from the source (%v)", restart.what, got, err)
		} else {
			f.Close()
		}
		if f, err := os.OpenFile(src, os.O_RDWR, 0); err != nil {
			t.Fatal(err)
		} else {
			f.WriteAt([]byte{0x5a}, size-1-int64(i))
			f.Close()
		}
		if b, err := os.ReadFile(d.path("kept")); err != nil || b[size-1-i] != 0x5a || m[size-1-i] != 0x5a {
			t.Errorf("after the %s, a write to the source is not read through the mount and the mapping (%v)", restart.what, err)
		}
		if _, err := fh.WriteAt([]byte{0x3c}, size/2+int64(i)); err != nil || m[size/2+i] != 0x3c {
			t.Errorf("after the %s, a write through the descriptor from before: %v, the mapping reads %x", restart.what, err, m[size/2+i])
		}
		before = nodeFacts(t, d.path("kept"))
		if c := readStats(t, d.mnt).ChargedBytes; c != charged {
			t.Errorf("after the %s, %d bytes charged, was %d", restart.what, c, charged)
		}
	}
}

// TestCrashLeavesOutPool: a daemon under a keeper that dies with a pool
// (whose slots, memfds, die with it) is taken over without the pool: its
// names go, with a warning, the rest is kept, and the room the store had
// reserved for it is given back (a pool as big again fits the budget).
func TestCrashLeavesOutPool(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Keeper: true, Buffers: "max_pinned = \"64MiB\""})
	makePool(t, d, "pool", "1MiB", 40)
	if err := os.WriteFile(d.path("pool", "slot"), []byte("lost"), 0o600); err != nil {
		t.Fatal(err)
	}
	want := patternBytes(1 << 20)
	if err := os.WriteFile(d.path("kept"), want, 0o600); err != nil {
		t.Fatal(err)
	}
	killDaemon(t, d)
	if got, err := os.ReadFile(d.path("kept")); err != nil || !bytes.Equal(got, want) {
		t.Errorf("a file after the crash: %v (%d bytes)", err, len(got))
	}
	if _, err := os.Stat(d.path("pool")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the pool after the crash: %v, want it gone", err)
	}
	if !strings.Contains(d.stderr.String(), "left out of the mount taken over") {
		t.Errorf("no warning of the pool left out:\n%s", d.stderr)
	}
	if s := readStats(t, d.mnt); s.Restarts != 1 {
		t.Errorf("after the crash: %d restarts, want 1", s.Restarts)
	}
	makePool(t, d, "again", "1MiB", 40)
}

// TestCrashWhileNameDrops: a daemon under a keeper SIGKILLed while it
// tells the kernel to drop a name (FUSE_NOTIFY_INVAL_ENTRY) that waits
// for its directory's lock, which a LOOKUP waiting for that same daemon
// holds (a test hook holds the lookup): the daemon cannot end until the
// lookup is answered, and only the next daemon can answer it. The
// keeper starts the next one anyway, which answers, and the mount goes
// on.
func TestCrashWhileNameDrops(t *testing.T) {
	t.Parallel()
	trigger := filepath.Join(t.TempDir(), "hold")
	d := startDaemon(t, daemonConfig{Keeper: true, Env: []string{"MRFS_TEST_LOOKUP_HOLD=" + trigger}})
	if err := os.WriteFile(d.path("f"), []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	pid := readStats(t, d.mnt).PID
	if err := os.WriteFile(trigger, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	looked := make(chan error, 1)
	go func() { _, err := os.Stat(d.path("hold")); looked <- err }()
	// The daemon drops f's name a second after it made it, and waits.
	dropping := func() bool {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/wchan", pid))
		for _, w := range tasks {
			if b, _ := os.ReadFile(w); string(b) == "fuse_reverse_inval_entry" {
				return true
			}
		}
		return false
	}
	for deadline := time.Now().Add(10 * time.Second * slowFactor()); !dropping(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the daemon never waited to drop a name behind the held lookup")
		}
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	os.Remove(trigger) // the next daemon answers the lookup at once
	hung := time.AfterFunc(30*time.Second*slowFactor(), d.abort)
	defer hung.Stop()
	if err := <-looked; !errors.Is(err, os.ErrNotExist) && !errors.Is(err, syscall.EIO) {
		t.Errorf("the lookup held through the crash: %v, want ENOENT (or the one EIO of a crash)", err)
	}
	if s := readStats(t, d.mnt); s.PID == pid || s.Restarts != 1 {
		t.Errorf("after the crash: pid %d (was %d), %d restarts, want another daemon and 1", s.PID, pid, s.Restarts)
	}
	if b, err := os.ReadFile(d.path("f")); err != nil || string(b) != "kept" {
		t.Errorf("a file after the crash: %q %v", b, err)
	}
}
