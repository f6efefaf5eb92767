//go:build rdma

// Package guest holds the tests that tests/vm/run runs inside its qemu
// guest, on a Soft-RoCE device (rxe0) and the kernel's own view of it
// (`rdma resource show`). They need root, a real RDMA device and a kernel
// that mrfs may load modules into, so outside the guest they skip: the
// guest's /init sets MRFS_VM_GUEST=1, nothing else does.
package guest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const device = "rxe0"

// requireGuest skips outside the tests/vm guest and fails inside it when
// the harness did not set up rxe0, so a broken harness is never a skip.
func requireGuest(t testing.TB) {
	t.Helper()
	if os.Getenv("MRFS_VM_GUEST") != "1" {
		t.Skip("runs only inside the tests/vm qemu guest (MRFS_VM_GUEST=1, Soft-RoCE rxe0): use `bash tests/vm/run`")
	}
	if _, err := os.Stat("/sys/class/infiniband/" + device); err != nil {
		t.Fatalf("MRFS_VM_GUEST=1 but no %s: the guest's /init did not create the rxe link: %v", device, err)
	}
}

// mrfsBin is the daemon under test, built with -tags rdma; the guest's
// second stage (tests/vm/guest-init) names it.
func mrfsBin() string { return os.Getenv("MRFS_BIN") }

// resEntry is one line of `rdma -j resource show mr|pd`.
type resEntry map[string]any

// num reads a numeric field. iproute2 prints keys as hex strings
// ("0x6c3" or "6c3" depending on its version) and counts as JSON numbers.
func (e resEntry) num(key string) (uint64, bool) {
	switch v := e[key].(type) {
	case float64:
		return uint64(v), true
	case string:
		s := strings.TrimPrefix(strings.ToLower(v), "0x")
		n, err := strconv.ParseUint(s, 16, 64)
		return n, err == nil
	}
	return 0, false
}

// rdmaRes returns the kernel's resource-tracking entries of one kind
// ("mr" or "pd") on rxe0. Keys are only reported to CAP_NET_ADMIN, which
// the guest's root has.
func rdmaRes(t testing.TB, kind string) []resEntry {
	t.Helper()
	return rdmaResOn(t, kind, device)
}

// rdmaResOn is rdmaRes on the named device.
func rdmaResOn(t testing.TB, kind, dev string) []resEntry {
	t.Helper()
	out, err := exec.Command("rdma", "-j", "resource", "show", kind, "dev", dev).Output()
	if err != nil {
		t.Fatalf("rdma -j resource show %s: %v", kind, errText(err))
	}
	out = bytes.TrimSpace(out)
	var all []resEntry
	if len(out) > 0 {
		if err := json.Unmarshal(out, &all); err != nil {
			t.Fatalf("rdma -j resource show %s: bad JSON %q: %v", kind, out, err)
		}
	}
	return all
}

// snapshot remembers which objects existed before the daemon started.
// The guest runs one test at a time and nothing else there uses RDMA, so
// what appears afterwards is the daemon's. (The kernel's pid field cannot
// be used alone: it is the thread that made the object, and it is left out
// once that thread has exited.)
type snapshot map[string]bool

func ids(t testing.TB, kind string) snapshot {
	t.Helper()
	s := snapshot{}
	for _, e := range rdmaRes(t, kind) {
		s[e.id(kind)] = true
	}
	return s
}

// id names an object: its restrack number (mrn, pdn) on its device.
func (e resEntry) id(kind string) string {
	n, _ := e.num(kind + "n")
	return fmt.Sprintf("%v/%d", e["ifname"], n)
}

// newSince returns the entries of kind that are not in before. Those that
// carry a pid must carry one of the daemon's threads.
func newSince(t testing.TB, kind string, before snapshot, pid int) []resEntry {
	t.Helper()
	var tids map[uint64]bool
	var fresh []resEntry
	for _, e := range rdmaRes(t, kind) {
		if before[e.id(kind)] {
			continue
		}
		fresh = append(fresh, e)
		p, ok := e.num("pid")
		if !ok {
			continue
		}
		if tids == nil {
			tids = threadIDs(pid)
		}
		if !tids[p] {
			t.Errorf("new %s %v belongs to pid %d, not to the daemon (pid %d)", kind, e, p, pid)
		}
	}
	return fresh
}

// threadIDs lists a live process's thread ids (its pid among them); empty
// once it has exited.
func threadIDs(pid int) map[uint64]bool {
	tids := map[uint64]bool{}
	dirs, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, d := range dirs {
		if n, err := strconv.ParseUint(d.Name(), 10, 64); err == nil {
			tids[n] = true
		}
	}
	return tids
}

func errText(err error) string {
	if ee, ok := err.(*exec.ExitError); ok && len(ee.Stderr) > 0 {
		return fmt.Sprintf("%v: %s", err, bytes.TrimSpace(ee.Stderr))
	}
	return err.Error()
}

func getxattr(t testing.TB, path, name string) string {
	t.Helper()
	buf := make([]byte, 4096)
	n, err := unix.Getxattr(path, name, buf)
	if err != nil {
		t.Fatalf("getxattr %s %s: %v", path, name, err)
	}
	return string(buf[:n])
}

func xattrNum(t testing.TB, path, name string) uint64 {
	t.Helper()
	v := getxattr(t, path, name)
	n, err := strconv.ParseUint(v, 0, 64)
	if err != nil {
		t.Fatalf("%s of %s is %q, not a number", name, path, v)
	}
	return n
}

// daemon is a running `mrfs mount`.
type daemon struct {
	cmd  *exec.Cmd
	dir  string
	log  *syncBuffer
	done chan error
}

// syncBuffer is a bytes.Buffer that a process writes to while a test
// reads it.
type syncBuffer struct {
	mu sync.Mutex // guards: b
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// zeroCopy says whether the guest's kernel has FUSE passthrough
// (tests/vm/run sets MRFS_VM_ZERO_COPY=1 for 6.12, 0 for 6.1).
func zeroCopy() bool { return os.Getenv("MRFS_VM_ZERO_COPY") == "1" }

// mount starts mrfs on rxe0 with the rdma backend, zero copy on where the
// kernel has FUSE passthrough (6.12); on 6.1 it is off (direct I/O, no
// mmap): registration, which most of these tests look at, is the same
// either way.
func mount(t testing.TB) *daemon { t.Helper(); return mountConf(t, "") }

// mountConf is mount with more config.toml tables appended.
func mountConf(t testing.TB, extra string) *daemon {
	t.Helper()
	return mountZeroCopy(t, zeroCopy(), extra)
}

// mountZeroCopy is mountConf with mount.zero_copy as given.
func mountZeroCopy(t testing.TB, zc bool, extra string) *daemon {
	t.Helper()
	return mountVerbs(t, fmt.Sprintf("device = %q", device), zc, extra)
}

// mountVerbs is mountZeroCopy with the [verbs] table's lines beside its
// backend given (its first device must be rxe0).
func mountVerbs(t testing.TB, verbs string, zc bool, extra string) *daemon {
	t.Helper()
	tmp := t.TempDir()
	cfg := filepath.Join(tmp, "config.toml")
	conf := fmt.Sprintf("[verbs]\nbackend = \"rdma\"\n%s\n\n[mount]\nzero_copy = %v\n\n%s", verbs, zc, extra)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(tmp, "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	d := &daemon{dir: dir, log: new(syncBuffer), done: make(chan error, 1)}
	d.cmd = exec.Command(mrfsBin(), "mount", "--config", cfg, dir)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", mrfsBin(), err)
	}
	go func() { d.done <- d.cmd.Wait() }()
	t.Cleanup(func() {
		if d.cmd.ProcessState == nil {
			d.cmd.Process.Kill()
			<-d.done
			unix.Unmount(dir, unix.MNT_DETACH)
		}
		t.Logf("mrfs log:\n%s", d.log)
	})
	// The mount is up when the root answers mrfs's own xattr.
	deadline := time.Now().Add(30 * time.Second)
	for {
		buf := make([]byte, 64)
		if n, err := unix.Getxattr(dir, "user.mrfs.device", buf); err == nil {
			if got := string(buf[:n]); got != device {
				t.Fatalf("mounted on device %q, want %q", got, device)
			}
			return d
		}
		select {
		case err := <-d.done:
			d.done <- err
			t.Fatalf("mrfs mount exited before mounting: %v\n%s", err, d.log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("mrfs did not mount within 30s\n%s", d.log)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop sends SIGINT (the documented teardown) and returns the exit error.
func (d *daemon) stop(t testing.TB) error {
	t.Helper()
	if err := d.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatalf("SIGINT the daemon: %v", err)
	}
	select {
	case err := <-d.done:
		return err
	case <-time.After(60 * time.Second):
		t.Fatalf("mrfs did not exit within 60s of SIGINT\n%s", d.log)
	}
	return nil
}

// createSized makes an empty file, then sizes it with truncate(2), as
// `truncate -s` does.
func createSized(t testing.TB, path string, size int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, size); err != nil {
		t.Fatalf("truncate -s %d %s: %v", size, path, err)
	}
}

// byLKey returns the entries whose lkey is key. Lookups go by lkey: rxe
// gives a region without remote access rkey 0, so rkeys need not differ.
func byLKey(entries []resEntry, key uint64) []resEntry {
	var hits []resEntry
	for _, e := range entries {
		if k, ok := e.num("lkey"); ok && k == key {
			hits = append(hits, e)
		}
	}
	return hits
}

// checkMR asserts that the kernel lists exactly one region of the daemon
// with the keys and length that the file's xattrs show, and no other.
func checkMR(t *testing.T, mrs []resEntry, file string) (lkey, rkey uint64) {
	t.Helper()
	lkey = xattrNum(t, file, "user.mrfs.lkey")
	rkey = xattrNum(t, file, "user.mrfs.rkey")
	length := xattrNum(t, file, "user.mrfs.length")
	hits := byLKey(mrs, lkey)
	if len(hits) != 1 {
		t.Fatalf("lkey %#x of %s: %d regions of mrfs in `rdma resource show mr`, want 1; mrfs's regions: %v", lkey, file, len(hits), mrs)
	}
	t.Logf("%s: xattrs lkey %#x rkey %#x length %d; kernel: %v", filepath.Base(file), lkey, rkey, length, hits[0])
	if k, ok := hits[0].num("rkey"); !ok || k != rkey {
		t.Errorf("kernel rkey %v, user.mrfs.rkey %#x", hits[0]["rkey"], rkey)
	}
	if n, ok := hits[0].num("mrlen"); !ok || n != length {
		t.Errorf("kernel mrlen %v, user.mrfs.length %d", hits[0]["mrlen"], length)
	}
	if len(mrs) != 1 {
		t.Errorf("mrfs holds %d regions for one buffer: %v", len(mrs), mrs)
	}
	return lkey, rkey
}

// TestKernelSeesMrfsRegistrations checks mrfs's xattrs against the kernel's
// resource tracking on a real device, through one buffer's whole life:
// register, re-register on an access change, unlink, unmount.
func TestKernelSeesMrfsRegistrations(t *testing.T) {
	requireGuest(t)
	mrsBefore, pdsBefore := ids(t, "mr"), ids(t, "pd")
	d := mount(t)
	pid := d.cmd.Process.Pid

	if pds := newSince(t, "pd", pdsBefore, pid); len(pds) != 1 {
		t.Fatalf("the kernel lists %d new PDs after mount, want 1 (the root directory): %v", len(pds), pds)
	} else {
		t.Logf("root PD: %v", pds[0])
	}

	f := filepath.Join(d.dir, "rx")
	const size = 4 << 20
	createSized(t, f, size)
	if st := getxattr(t, f, "user.mrfs.state"); st != "registered" {
		t.Fatalf("user.mrfs.state = %q after truncate -s 4M", st)
	}
	if dev := getxattr(t, f, "user.mrfs.device"); dev != device {
		t.Fatalf("user.mrfs.device = %q, want %s", dev, device)
	}
	if n := xattrNum(t, f, "user.mrfs.length"); n != size {
		t.Fatalf("user.mrfs.length = %d, want %d", n, size)
	}
	lkey, rkey := checkMR(t, newSince(t, "mr", mrsBefore, pid), f)

	// rxe has no rereg_mr: the access change registers anew, then
	// deregisters the old region.
	if err := unix.Setxattr(f, "user.mrfs.access", []byte("local_write,remote_write"), 0); err != nil {
		t.Fatalf("setxattr user.mrfs.access local_write,remote_write: %v", err)
	}
	if a := getxattr(t, f, "user.mrfs.access"); a != "local_write,remote_write" {
		t.Fatalf("user.mrfs.access = %q after the change", a)
	}
	mrs := newSince(t, "mr", mrsBefore, pid)
	if old := byLKey(mrs, lkey); len(old) != 0 {
		t.Errorf("the old region (lkey %#x) is still registered after the access change: %v", lkey, old)
	}
	lkey2, rkey2 := checkMR(t, mrs, f)
	if rkey2 == 0 || lkey2 == lkey {
		t.Errorf("after the access change lkey %#x -> %#x, rkey %#x -> %#x: want a new region with a remote key", lkey, lkey2, rkey, rkey2)
	}

	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	if left := newSince(t, "mr", mrsBefore, pid); len(left) != 0 {
		t.Errorf("regions of mrfs left after rm: %v", left)
	}

	// Leave buffers registered, one in a second PD, so that teardown has
	// something to undo.
	createSized(t, filepath.Join(d.dir, "kept"), 1<<20)
	if err := os.Mkdir(filepath.Join(d.dir, "tenant"), 0o755); err != nil {
		t.Fatalf("mkdir (a new PD): %v", err)
	}
	createSized(t, filepath.Join(d.dir, "tenant", "kept"), 64<<10)
	if n := len(newSince(t, "mr", mrsBefore, pid)); n != 2 {
		t.Errorf("mrfs holds %d regions for two buffers", n)
	}
	if n := len(newSince(t, "pd", pdsBefore, pid)); n != 2 {
		t.Errorf("mrfs holds %d PDs for two directories", n)
	}

	if err := d.stop(t); err != nil {
		t.Errorf("mrfs exited with %v after SIGINT, want status 0", err)
	}
	// The daemon has exited, so the kernel would have released anything it
	// leaked: its own account of the teardown is what shows that mrfs
	// deregistered and deallocated before it exited.
	if log := d.log.String(); !strings.Contains(log, "teardown complete") ||
		!strings.Contains(log, "deregistered_regions=2") || !strings.Contains(log, "deallocated_pds=2") {
		t.Errorf("mrfs did not report a teardown of 2 buffers and 2 PDs")
	}
	if left := newSince(t, "mr", mrsBefore, pid); len(left) != 0 {
		t.Errorf("regions left after unmount: %v", left)
	}
	if left := newSince(t, "pd", pdsBefore, pid); len(left) != 0 {
		t.Errorf("PDs left after unmount: %v", left)
	}
	mounts, _ := os.ReadFile("/proc/self/mounts")
	if bytes.Contains(mounts, []byte(" "+d.dir+" ")) {
		t.Errorf("%s still mounted after the daemon exited", d.dir)
	}
}
