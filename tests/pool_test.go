package tests

import (
	"bytes"
	"encoding/json"
	"errors"
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

const xPool = "user.mrfs.pool"

// makePool runs `mrfs pool DIR --slot SIZE --slots N` and returns DIR.
func makePool(t *testing.T, d *daemon, name, slot string, slots int, extra ...string) string {
	t.Helper()
	dir := d.path(name)
	args := append([]string{"pool", dir, "--slot", slot, "--slots", strconv.Itoa(slots)}, extra...)
	out := mustRun(t, mrfsBin, args...)
	if !strings.Contains(out, "slot="+slot+",slots="+strconv.Itoa(slots)+",used=0") {
		t.Fatalf("mrfs pool printed %q", out)
	}
	return dir
}

// A pool's files through the mount: each takes a slot of the chunk's one
// registration (its keys, its own address), has the slot's size, and
// the shell's ways of writing a file work on it; each rule of DESIGN
// "Pools" holds with the errno it names.
func TestPoolLifecycle(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	const slot = 64 << 10
	p := makePool(t, d, "pool", "64KiB", 8)
	if got := mustXattr(t, p, xPool); got != "slot=64KiB,slots=8,used=0,chunks=1" {
		t.Fatalf("%s = %q", xPool, got)
	}
	var addrs []uint64
	var rkey uint32
	for i := range 3 {
		f := filepath.Join(p, fmt.Sprint("f", i))
		if err := os.WriteFile(f, []byte("hello"), 0o600); err != nil {
			t.Fatal(err)
		}
		requireRegistered(t, f, slot)
		a, k := keysOf(t, f)
		if i > 0 && (k != rkey || a != addrs[i-1]+slot) {
			t.Errorf("pool file %d: addr %#x rkey %#x; want the chunk's rkey %#x at the next slot %#x", i, a, k, rkey, addrs[i-1]+slot)
		}
		addrs, rkey = append(addrs, a), k
		var desc struct {
			Regions []struct{ Length string }
			Pool    *struct {
				Dir      string
				Slot     int
				SlotSize string `json:"slot_size"`
			}
		}
		if err := json.Unmarshal([]byte(mustXattr(t, f, xDesc)), &desc); err != nil {
			t.Fatal(err)
		}
		if desc.Pool == nil || desc.Pool.Dir != "/pool" || desc.Pool.Slot != i || desc.Pool.SlotSize != strconv.Itoa(slot) ||
			len(desc.Regions) != 1 || desc.Regions[0].Length != strconv.Itoa(8*slot) {
			t.Errorf("desc of pool file %d: %+v (pool %+v)", i, desc, desc.Pool)
		}
	}
	if got := mustXattr(t, p, xPool); got != "slot=64KiB,slots=8,used=3,chunks=1" {
		t.Errorf("%s with 3 files = %q", xPool, got)
	}
	f0 := filepath.Join(p, "f0")
	got, err := os.ReadFile(f0)
	if err != nil || len(got) != slot || string(got[:5]) != "hello" || !bytes.Equal(got[5:], make([]byte, slot-5)) {
		t.Errorf("read %s: %d bytes (%v), want hello then zeroes to %d", f0, len(got), err, slot)
	}
	// echo >, cp, dd: O_TRUNC zeroes the slot, the size stays.
	mustRun(t, "bash", "-c", "echo hi > "+f0)
	got, _ = os.ReadFile(f0)
	if len(got) != slot || string(got[:3]) != "hi\n" || got[3] != 0 || got[4] != 0 {
		t.Errorf("after echo hi >: %d bytes, %q", len(got), got[:6])
	}
	mustRun(t, "cp", "/etc/hostname", filepath.Join(p, "f1"))
	mustRun(t, "dd", "if=/dev/zero", "of="+filepath.Join(p, "f2"), "bs=4k", "count=16", "conv=notrunc", "status=none")
	// The size is the slot's, always.
	wantErrno(t, os.Truncate(f0, 0), unix.EINVAL, "truncate a pool file to 0")
	wantErrno(t, os.Truncate(f0, 2*slot), unix.EINVAL, "truncate a pool file past its slot")
	if err := os.Truncate(f0, slot); err != nil {
		t.Errorf("truncate a pool file to its own size: %v", err)
	}
	// A write past the slot's end fails at that call.
	fh, err := os.OpenFile(f0, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fh.WriteAt([]byte("x"), slot); !errors.Is(err, unix.EFBIG) && !errors.Is(err, unix.EPERM) {
		t.Errorf("a write at the slot's end: %v, want EFBIG or EPERM", err)
	}
	wantErrno(t, unix.Fallocate(int(fh.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, 4096), unix.EPERM, "punch a hole in a pool file")
	fh.Close()
	if fi, _ := os.Stat(f0); fi.Size() != slot {
		t.Errorf("after the refused writes the file is %d bytes, want %d", fi.Size(), slot)
	}
	// Access is the pool's; setting it names default_access.
	err = setxattr(f0, xAccess, "local_write,remote_read")
	wantErrno(t, err, unix.EPERM, "set access on a pool file")
	if _, ok := d.waitLog(regexp.MustCompile(`pool file.*user.mrfs.default_access`), 5*time.Second); !ok {
		t.Errorf("the log does not say to set the pool's default_access:\n%s", tail(d.stderr.String(), 20))
	}
	mustSetxattr(t, p, xDefAcc, "local_write,remote_read")
	if _, k := keysOf(t, f0); k == rkey || mustXattr(t, f0, xAccess) != "local_write,remote_read" {
		t.Errorf("after the pool's default_access: rkey %#x (was %#x), access %q", k, rkey, mustXattr(t, f0, xAccess))
	}
	// No directories in a pool; nothing moves into or out of one.
	wantErrno(t, os.Mkdir(filepath.Join(p, "sub"), 0o755), unix.EPERM, "mkdir in a pool")
	wantErrno(t, os.Rename(f0, d.path("out")), unix.EXDEV, "rename out of a pool")
	if err := os.WriteFile(d.path("in"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, os.Rename(d.path("in"), filepath.Join(p, "in")), unix.EXDEV, "rename into a pool")
	if err := os.Mkdir(d.path("dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, os.Rename(d.path("dir"), filepath.Join(p, "dir")), unix.EXDEV, "rename a directory into a pool")
	if err := os.Rename(f0, filepath.Join(p, "g0")); err != nil {
		t.Errorf("rename within a pool: %v", err)
	}
	wantErrno(t, os.Remove(p), unix.ENOTEMPTY, "rmdir of a pool with files")
	// A full pool is ENOSPC, and says which.
	for i := 3; i < 8; i++ {
		if err := os.WriteFile(filepath.Join(p, fmt.Sprint("f", i)), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	_, err = os.Create(filepath.Join(p, "f8"))
	wantErrno(t, err, unix.ENOSPC, "a ninth file in a pool of 8")
	if _, ok := d.waitLog(regexp.MustCompile(`all its 8 slots`), 5*time.Second); !ok {
		t.Errorf("the log does not name the full pool:\n%s", tail(d.stderr.String(), 20))
	}
	// More slots: a chunk more; fewer: EBUSY while its slots are used.
	mustSetxattr(t, p, xPool, "slots=12")
	if got := mustXattr(t, p, xPool); got != "slot=64KiB,slots=12,used=8,chunks=2" {
		t.Errorf("after raising: %q", got)
	}
	if err := os.WriteFile(filepath.Join(p, "f8"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, setxattr(p, xPool, "slots=8"), unix.EBUSY, "lowering over a used slot")
	os.Remove(filepath.Join(p, "f8"))
	mustSetxattr(t, p, xPool, "slots=8")
	// rm -r deregisters it all.
	mustRun(t, "rm", "-r", p)
	if s := readStats(t, d.mnt); s.RegisteredBytes != 1 || s.Buffers != 1 {
		t.Errorf("after rm -r of the pool: %+v, want only the file outside it", s)
	}
}

// Unlink gives the slot back zeroed; a slot still open is not given
// until its last close, and its writer's bytes never reach the next file.
func TestPoolZeroingOnReuse(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	const slot = 16 << 10
	p := makePool(t, d, "pool", "16KiB", 1)
	f := filepath.Join(p, "a")
	secret := bytes.Repeat([]byte("secret!"), 1000)
	if err := os.WriteFile(f, secret, 0o600); err != nil {
		t.Fatal(err)
	}
	fh, m := mapShared(t, f, slot)
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	// Still mapped and open: the pool of one slot is full.
	_, err := os.Create(filepath.Join(p, "b"))
	wantErrno(t, err, unix.ENOSPC, "a file while the only slot is held open")
	copy(m, "written after the unlink")
	munmap(m)
	fh.Close()
	// The kernel sends the RELEASE after close returns.
	deadline := time.Now().Add(10 * time.Second * slowFactor())
	for {
		if err = os.WriteFile(filepath.Join(p, "b"), nil, 0o600); err == nil {
			break
		}
		if !errors.Is(err, unix.ENOSPC) || time.Now().After(deadline) {
			t.Fatalf("a file after the last close of the unlinked one: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got, err := os.ReadFile(filepath.Join(p, "b"))
	if err != nil || len(got) != slot || !bytes.Equal(got, make([]byte, slot)) {
		t.Fatalf("the next file in the slot: %d bytes (%v), not all zero", len(got), err)
	}
}

// A pool file's mapping is the slot's registered pages (the PFN proof),
// and a write past the slot's end through a zero-copy open lands
// nowhere: the memfd's seal refuses it at that call.
func TestPoolZeroCopy(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	const slot = 64 << 10
	p := makePool(t, d, "pool", "64KiB", 4)
	for _, name := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(p, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	f := filepath.Join(p, "b")
	fh, m := mapShared(t, f, slot)
	for i := 0; i < slot; i += pageSize {
		m[i] = 1
	}
	requireSamePages(t, os.Getpid(), sliceAddr(m), d.pid(), uintptr(parseHex(t, mustXattr(t, f, xAddr))), slot/pageSize)
	if _, err := fh.WriteAt(make([]byte, 3*pageSize), int64(slot-pageSize)); err == nil {
		if fi, _ := fh.Stat(); fi.Size() != slot {
			t.Fatalf("a write across the slot's end grew the file to %d", fi.Size())
		}
	}
	_, err := fh.WriteAt([]byte("x"), int64(slot+pageSize))
	if !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EFBIG) {
		t.Errorf("a write past the slot's end through a zero-copy open: %v, want EPERM (the seal) or EFBIG", err)
	}
	if fi, _ := fh.Stat(); fi.Size() != slot {
		t.Errorf("the file is %d bytes after writes past its end, want %d", fi.Size(), slot)
	}
	wantErrno(t, fh.Truncate(2*slot), unix.EINVAL, "ftruncate of a pool file")
}

// A pool is admitted whole against the budget and its maker's quota.
func TestPoolAdmission(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"4MiB\"\nmax_pinned_per_user = \"2MiB\""})
	dir := d.path("big")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, setxattr(dir, xPool, "slot=1MiB,slots=3"), unix.EDQUOT, "a pool past the quota")
	if err := setxattr(dir, xPool, "slot=1MiB,slots=2"); err != nil {
		t.Fatalf("a pool within the quota: %v", err)
	}
	if s := readStats(t, d.mnt); s.ChargedBytes != 2<<20 || s.RegisteredBytes != 2<<20 {
		t.Errorf("a pool of 2 MiB: %+v", s)
	}
	f := d.path("x")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, os.Truncate(f, 4096), unix.EDQUOT, "a buffer past the quota the pool fills")
	mustRun(t, "rm", "-r", dir)
	if err := os.Truncate(f, 1<<20); err != nil {
		t.Errorf("after the pool went, the quota is free again: %v", err)
	}
}

// poolWorker is what each user runs against its pool in
// TestPoolsSharedMount: files created, checked to read as zeroes (no
// byte of a slot's last file), filled with the user's mark, closed and
// removed, as fast as it can; every refusal is printed and fails it.
const poolWorker = `
import os, sys
pool, mark, n = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
for i in range(n):
    p = os.path.join(pool, "w%d-%d" % (os.getpid(), i))
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
    data = os.pread(fd, os.fstat(fd).st_size, 0)
    if data.strip(b"\0"):
        sys.exit("LEAK: a new file read %r" % data.strip(b"\0")[:16])
    os.pwrite(fd, mark * 4096, 0)
    os.close(fd)
    os.unlink(p)
`

// poolHostile is a user trying the pool rules against its own pool and
// another's: every attempt must fail with the errno named, and nothing it
// does may change what anyone is charged.
const poolHostile = `
import ctypes, errno, os, sys
own, other = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
def punch(fd):
    if libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(4096)) != 0:  # PUNCH_HOLE|KEEP_SIZE
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
def refused(what, want, f):
    try:
        f()
    except OSError as e:
        if e.errno not in want:
            sys.exit("%s: %s, want %s" % (what, e, [errno.errorcode[w] for w in want]))
        return
    sys.exit("%s: allowed" % what)
p = os.path.join(own, "h")
fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
end = os.fstat(fd).st_size
for _ in range(100):
    refused("grow its pool past its quota", {errno.EDQUOT}, lambda: os.setxattr(own, "user.mrfs.pool", b"slots=16"))
    refused("punch a hole in a pool file", {errno.EPERM}, lambda: punch(fd))
    refused("truncate a pool file", {errno.EINVAL}, lambda: os.ftruncate(fd, 1))
    refused("write past the slot", {errno.EPERM, errno.EFBIG}, lambda: os.pwrite(fd, b"x", end + 4096))
    refused("set a pool file's access", {errno.EPERM}, lambda: os.setxattr(p, "user.mrfs.access", b"local_write,remote_write"))
    refused("create in another's pool", {errno.EACCES}, lambda: os.open(os.path.join(other, "x"), os.O_CREAT | os.O_RDWR, 0o600))
    refused("resize another's pool", {errno.EACCES}, lambda: os.setxattr(other, "user.mrfs.pool", b"slots=1"))
os.close(fd)
os.unlink(p)
`

// Pools on a shared mount: each user's pool is charged to it, within its
// quota and the budget, and holds against the others. Two users churn
// files in their own pools from two processes each while a third,
// hostile, tries every rule against its pool and theirs; meanwhile what
// each is charged never moves from its pools' size, nothing passes the
// budget, no new file reads a byte of an old one, and after rm -r
// nothing is left.
func TestPoolsSharedMount(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: "max_pinned = \"8MiB\"\nmax_pinned_per_user = \"3MiB\"", Mount: "allow_other = true\numask = \"022\""})
	shared := d.path("shared")
	if err := os.Mkdir(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o777); err != nil {
		t.Fatal(err)
	}
	for p := filepath.Dir(d.mnt); p != filepath.Dir(p) && strings.HasPrefix(p, os.TempDir()+"/"); p = filepath.Dir(p) {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	as := func(uid int, script string, args ...string) *exec.Cmd {
		return exec.Command("setpriv", append([]string{fmt.Sprintf("--reuid=%d", uid), fmt.Sprintf("--regid=%d", uid), "--clear-groups", "/usr/bin/python3", "-c", script}, args...)...)
	}
	mkpool := func(uid int, name, spec string) (string, error) {
		dir := filepath.Join(shared, name)
		out, err := as(uid, "import os, sys; os.mkdir(sys.argv[1], 0o755); os.setxattr(sys.argv[1], 'user.mrfs.pool', sys.argv[2].encode())", dir, spec).CombinedOutput()
		if err != nil {
			return dir, fmt.Errorf("%v: %s", err, out)
		}
		return dir, nil
	}
	if _, err := mkpool(2003, "toobig", "slot=1MiB,slots=4"); err == nil || !strings.Contains(err.Error(), "Disk quota exceeded") {
		t.Fatalf("uid 2003's pool of 4 MiB past its 3 MiB: %v, want EDQUOT", err)
	}
	const slot = 256 << 10
	pools := map[int]string{}
	for _, uid := range []int{2001, 2002, 2003} {
		dir, err := mkpool(uid, fmt.Sprint("p", uid), "slot=256KiB,slots=8")
		if err != nil {
			t.Fatalf("uid %d's pool of 2 MiB: %v", uid, err)
		}
		pools[uid] = dir
	}
	if _, err := mkpool(0, "root", "slot=1MiB,slots=3"); err == nil || !strings.Contains(err.Error(), "No space left") {
		t.Fatalf("root's pool of 3 MiB past the budget (6 of 8 MiB held): %v, want ENOSPC", err)
	}
	want := int64(3 * 8 * slot)
	check := func(when string) {
		s := readStats(t, d.mnt)
		if s.ChargedBytes != want || s.RegisteredBytes != want || s.Regions != 3 {
			t.Errorf("%s: charged %d, registered %d in %d regions; want the pools' %d in their 3 chunks", when, s.ChargedBytes, s.RegisteredBytes, s.Regions, want)
		}
		for _, uid := range []string{"2001", "2002", "2003"} {
			if c := s.Users[uid].ChargedBytes; c != 8*slot {
				t.Errorf("%s: uid %s charged %d, want its pool's %d", when, uid, c, 8*slot)
			}
		}
	}
	check("before")
	var cmds []*exec.Cmd
	for _, uid := range []int{2001, 2001, 2002, 2002} {
		cmds = append(cmds, as(uid, poolWorker, pools[uid], fmt.Sprint(uid%10), fmt.Sprint(300/int(slowFactor()))))
	}
	cmds = append(cmds, as(2003, poolHostile, pools[2003], pools[2001]))
	outs := make([]*bytes.Buffer, len(cmds))
	for i, c := range cmds {
		outs[i] = &bytes.Buffer{}
		c.Stdout, c.Stderr = outs[i], outs[i]
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan struct{})
	go func() {
		for _, c := range cmds {
			c.Wait()
		}
		close(done)
	}()
	for sampled := false; ; sampled = true {
		select {
		case <-done:
			if !sampled {
				t.Log("the users were done before the first sample")
			}
		case <-time.After(20 * time.Millisecond):
			check("while the users work")
			continue
		}
		break
	}
	for i, c := range cmds {
		if !c.ProcessState.Success() {
			t.Errorf("%s: %v\n%s", c.Args[1], c.ProcessState, outs[i])
		}
	}
	check("after")
	for _, dir := range pools {
		mustRun(t, "rm", "-r", dir)
	}
	if s := readStats(t, d.mnt); s.ChargedBytes != 0 || s.RegisteredBytes != 0 || s.Buffers != 0 {
		t.Errorf("after rm -r of the pools: %+v", s)
	}
}

// A peer's WRITE into one pool file, with the chunk's key at the slot's
// address, is seen through that file's mapping and in none of its
// neighbours; `mrfs remote --desc` of a pool file reaches its slot and
// refuses a range past it, though the chunk's region goes on.
func TestPoolRemote(t *testing.T) {
	t.Parallel()
	d, peer := startRemoteConf(t, backend.listen())
	const slot = 64 << 10
	p := makePool(t, d, "pool", "64KiB", 4, "--access", "local_write,remote_read,remote_write")
	var files []string
	for _, name := range []string{"a", "b", "c"} {
		f := filepath.Join(p, name)
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	_, m := mapShared(t, files[1], slot)
	addr, rkey := keysOf(t, files[1])
	c := dialPD(t, peer, "/pool")
	msg := []byte("from a peer, into slot 1")
	if err := c.Write(addr+slot-uint64(len(msg)), rkey, msg); err != nil {
		t.Fatalf("WRITE into the pool file: %v", err)
	}
	if got := m[slot-len(msg):]; !bytes.Equal(got, msg) {
		t.Errorf("the pool file's mapping shows %q, want the peer's %q", got, msg)
	}
	for _, f := range []string{files[0], files[2]} {
		if got, _ := os.ReadFile(f); !bytes.Equal(got, make([]byte, slot)) {
			t.Errorf("%s, a neighbour of the written slot, is not all zero", f)
		}
	}
	desc := filepath.Join(t.TempDir(), "desc")
	if err := os.WriteFile(desc, []byte(mustXattr(t, files[2], xDesc)), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, err := sh(t, fmt.Sprintf("printf 'via desc' | %s --desc @%s --offset 100", remoteCLI(d, "write")+"/pool", desc))
	if err != nil {
		t.Fatalf("mrfs remote write --desc of a pool file: %v\n%s%s", err, out, errOut)
	}
	if got, _ := os.ReadFile(files[2]); string(got[100:108]) != "via desc" {
		t.Errorf("after a write through the desc, %s reads %q at 100", files[2], got[100:108])
	}
	_, errOut, err = sh(t, fmt.Sprintf("printf 'too far' | %s --desc @%s --offset %d", remoteCLI(d, "write")+"/pool", desc, slot-3))
	if exitCode(err) == 0 || !strings.Contains(errOut, "no region") {
		t.Errorf("a write through a pool file's desc past its end: %v %q, want refused", err, errOut)
	}
	// The slot after c's, given to a new file, holds none of it.
	if err := os.WriteFile(filepath.Join(p, "d"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(p, "d")); !bytes.Equal(got, make([]byte, slot)) {
		t.Errorf("the slot after the pool file's was written through its desc")
	}
}

// /metrics counts each pool's slots used and free, by its PD.
func TestPoolMetrics(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Metrics: `listen = "127.0.0.1:0"`})
	url := metricsURL(t, d)
	p := makePool(t, d, "pool", "4KiB", 4)
	if err := os.WriteFile(filepath.Join(p, "a"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	pd := mustXattr(t, p, xPD)
	m := scrape(t, url)
	for state, want := range map[string]float64{"used": 1, "free": 3} {
		name := `mrfs_pool_slots{pd="` + pd + `",state="` + state + `"}`
		if got, ok := m[name]; !ok || got != want {
			t.Errorf("%s = %v (present %v), want %v", name, got, ok, want)
		}
	}
}

// A pool file with remote access is published as any buffer, at its
// slot's address with the chunk's region and its pool; a peer that finds
// it by name writes into that slot and, past its end, nowhere.
func TestPoolPublish(t *testing.T) {
	e := startEtcd(t)
	host, _ := os.Hostname()
	name := host + "/pools"
	prefix := "/mrfs-test/" + name
	d := startDaemon(t, daemonConfig{Remote: backend.listen(),
		Publish: fmt.Sprintf("endpoints = [%q]\nprefix = \"/mrfs-test\"\nlease = \"30s\"\nname = \"pools\"", e.url)})
	const slot = 64 << 10
	p := makePool(t, d, "pool", "64KiB", 4, "--access", "local_write,remote_read,remote_write")
	for _, name := range []string{"a", "b", "c"} {
		if err := os.WriteFile(filepath.Join(p, name), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	b := filepath.Join(p, "b")
	e.waitKeys(prefix, 5*time.Second, "/pool/a", "/pool/b", "/pool/c")
	// A file made now, after the publisher's first walk: its create alone
	// says so (a slot's keys come without a registration).
	if err := os.WriteFile(filepath.Join(p, "d"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	got := e.waitKeys(prefix, time.Second*slowFactor(), "/pool/a", "/pool/b", "/pool/c", "/pool/d")
	v := got[prefix+"/pool/b"]
	addr, _ := keysOf(t, b)
	pool, _ := v["pool"].(map[string]any)
	if v["addr"] != fmt.Sprintf("%#x", addr) || v["pd_path"] != "/pool" || pool == nil || fmt.Sprint(pool["slot"]) != "1" {
		t.Errorf("published /pool/b: addr %v pd_path %v pool %v; want addr %#x in /pool, slot 1", v["addr"], v["pd_path"], v["pool"], addr)
	}
	tok := mustXattr(t, p, xToken)
	etcd := fmt.Sprintf("--endpoints %s --prefix /mrfs-test", e.url)
	mustSh(t, fmt.Sprintf("printf 'by name' | MRFS_TOKEN=%s mrfs remote write --name '%s/pool/b' --offset 100 %s", tok, name, etcd))
	if data, _ := os.ReadFile(b); string(data[100:107]) != "by name" {
		t.Errorf("the write by name did not land in the slot: %q", data[100:107])
	}
	if _, errOut, err := sh(t, fmt.Sprintf("printf 'past' | MRFS_TOKEN=%s mrfs remote write --name '%s/pool/b' --offset %d %s", tok, name, slot-2, etcd)); exitCode(err) == 0 {
		t.Errorf("a write by name past the pool file's end: %v %q, want refused", err, errOut)
	}
	for _, f := range []string{filepath.Join(p, "a"), filepath.Join(p, "c")} {
		if data, _ := os.ReadFile(f); !bytes.Equal(data, make([]byte, slot)) {
			t.Errorf("%s, a neighbour of the slot written by name, is not all zero", f)
		}
	}
	// Unlinked, its key is gone when rm returns (no deregistration says
	// so: the tree does).
	if err := os.Remove(b); err != nil {
		t.Fatal(err)
	}
	if now, err := e.published(prefix); err != nil {
		t.Fatal(err)
	} else if now[prefix+"/pool/b"] != nil || now[prefix+"/pool/a"] == nil {
		t.Errorf("after rm of pool/b: b published %v, a published %v; want only a", now[prefix+"/pool/b"] != nil, now[prefix+"/pool/a"] != nil)
	}
}

// Another user who may write a pool's directory cannot grow it on its
// maker's quota: only the maker (or root) changes its slots.
func TestPoolSlotsOnlyByMaker(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Mount: "allow_other = true"})
	sharedDir(t, d)
	p := makePool(t, d, "shared/pool", "4KiB", 2)
	// Not sticky: there the kernel itself lets only the owner set the
	// directory's attributes.
	if err := unix.Chmod(p, 0o777); err != nil {
		t.Fatal(err)
	}
	out, err := asUser(1000, `setfattr -n user.mrfs.pool -v slots=60 "$1"`, p)
	if err == nil || !strings.Contains(out, "Operation not permitted") {
		t.Errorf("uid 1000 growing root's pool: %v %q, want Operation not permitted", err, out)
	}
	if got := mustXattr(t, p, xPool); got != "slot=4KiB,slots=2,used=0,chunks=1" {
		t.Errorf("after uid 1000's try: %q", got)
	}
	mustSetxattr(t, p, xPool, "slots=4")
}
