//go:build rdma

package guest

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPoolOnRxe: a pool of 10,000 slots is one region on rxe0, as the
// kernel lists it, however many files take its slots; every file shows
// the chunk's keys at its own slot's address; rm -r leaves no region.
func TestPoolOnRxe(t *testing.T) {
	requireGuest(t)
	mrsBefore := ids(t, "mr")
	d := mount(t)
	pid := d.cmd.Process.Pid
	const slots, slot = 10000, 4096
	pool := filepath.Join(d.dir, "pool")
	if out, err := exec.Command(mrfsBin(), "pool", pool, "--slot", "4KiB", "--slots", strconv.Itoa(slots)).CombinedOutput(); err != nil {
		t.Fatalf("mrfs pool: %v\n%s", err, out)
	}
	for i := range slots {
		fd, err := unix.Open(filepath.Join(pool, strconv.Itoa(i)), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			t.Fatalf("pool file %d: %v", i, err)
		}
		unix.Close(fd)
	}
	mrs := newSince(t, "mr", mrsBefore, pid)
	if len(mrs) != 1 {
		t.Fatalf("%d pool files: %d regions of mrfs in `rdma resource show mr`, want the chunk's 1: %v", slots, len(mrs), mrs)
	}
	if n, ok := mrs[0].num("mrlen"); !ok || n != slots*slot {
		t.Errorf("the chunk's region: mrlen %v, want %d", mrs[0]["mrlen"], slots*slot)
	}
	first := filepath.Join(pool, "0")
	base := xattrNum(t, first, "user.mrfs.addr")
	for _, i := range []int{0, 1, slots / 2, slots - 1} {
		f := filepath.Join(pool, strconv.Itoa(i))
		if k := xattrNum(t, f, "user.mrfs.lkey"); k != xattrNum(t, first, "user.mrfs.lkey") || len(byLKey(mrs, k)) != 1 {
			t.Errorf("%s: lkey %#x is not the chunk's", f, k)
		}
		if a := xattrNum(t, f, "user.mrfs.addr"); a != base+uint64(i)*slot {
			t.Errorf("%s: addr %#x, want slot %d's %#x", f, a, i, base+uint64(i)*slot)
		}
	}
	if err := os.RemoveAll(pool); err != nil {
		t.Fatal(err)
	}
	if left := newSince(t, "mr", mrsBefore, pid); len(left) != 0 {
		t.Errorf("regions of mrfs left after rm -r of the pool: %v", left)
	}
}
