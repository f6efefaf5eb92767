//go:build rdma

package guest

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestTwoDevicesBenchmark is issue 22's two benchmarks on rxe0 and rxe1
// (under TCG only the ratios mean something):
//
//   - the ready time of a 1 GiB buffer (truncate -s) on a mount of both
//     devices against a mount of rxe0 alone, in alternating rounds (goal
//     <= 1.3x: the pages are populated once, the second registration
//     pins pages already there);
//   - RDMA WRITEs of 1 MiB by two peers at once, one through each
//     device, against one peer through rxe0: the throughput of both
//     together over that of one.
//
// It runs when MRFS_VM_BENCH=1.
func TestTwoDevicesBenchmark(t *testing.T) {
	requireGuest(t)
	if os.Getenv("MRFS_VM_BENCH") != "1" {
		t.Skip("two-device benchmark: set MRFS_VM_BENCH=1 (tests/vm/run --bench)")
	}
	addRxe1(t)
	one := mount(t)
	two := twoDeviceMount(t, "")
	const size, rounds = 1 << 30, 3
	ready := func(dir string) time.Duration {
		f := filepath.Join(dir, "r")
		createSized(t, f, 0)
		start := time.Now()
		if err := os.Truncate(f, size); err != nil { // retries EINTR, unlike unix.Truncate
			t.Fatal(err)
		}
		took := time.Since(start)
		if err := os.Remove(f); err != nil {
			t.Fatal(err)
		}
		return took
	}
	var t1, t2 []time.Duration
	var ratios []float64
	for i := range rounds {
		var x, y time.Duration
		if i%2 == 0 {
			x, y = ready(one.dir), ready(two.dir)
		} else {
			y, x = ready(two.dir), ready(one.dir)
		}
		t1, t2 = append(t1, x), append(t2, y)
		ratios = append(ratios, float64(y)/float64(x))
	}
	slices.Sort(ratios)
	t.Logf("devices-bench: | ready time of 1 GiB | rxe0 %s | rxe0 and rxe1 %s | ratio (median of %d rounds) %.2fx |",
		fmtDur(median(t1)), fmtDur(median(t2)), rounds, ratios[len(ratios)/2])

	// Two buffers of 1 MiB, each written by a peer of its own.
	const msg, ops = 1 << 20, 100
	// Each peer is a process of its own (startServingPeer), so that
	// this one never holds a context of rxe1 (deleteRxe1).
	type target struct {
		peer *servingPeer
		addr uint64
		rkey uint32
	}
	var targets []target
	for _, c := range []struct{ ip, dev string }{{addr0, device}, {addr1, device2}} {
		f := filepath.Join(two.dir, "w"+c.dev)
		createSized(t, f, msg)
		if err := unix.Setxattr(f, "user.mrfs.access", []byte("local_write,remote_write"), 0); err != nil {
			t.Fatal(err)
		}
		via := *two
		via.peer = c.ip + two.peer[len(addr0):]
		targets = append(targets, target{startServingPeer(t, &via, "/", "MRFS_PEER_BUFSIZE="+strconv.Itoa(msg)),
			mustHex(t, getxattr(t, f, "user.mrfs.addr")), uint32(deviceKeys(t, f)[c.dev][1])})
	}
	run := func(ts []target) float64 {
		start := time.Now()
		for _, tg := range ts {
			fmt.Fprintf(tg.peer.in, "fill %#x %#x %d %d\n", tg.addr, tg.rkey, msg, ops)
		}
		for _, tg := range ts {
			if got := tg.peer.line(t); got != "ok" {
				t.Fatalf("%d WRITEs of 1 MiB by a peer: %s", ops, got)
			}
		}
		return float64(len(ts)*ops*msg) / time.Since(start).Seconds() / (1 << 20)
	}
	var r1, r2 []float64
	for i := range rounds {
		if i%2 == 0 {
			r1, r2 = append(r1, run(targets[:1])), append(r2, run(targets))
		} else {
			r2, r1 = append(r2, run(targets)), append(r1, run(targets[:1]))
		}
	}
	slices.Sort(r1)
	slices.Sort(r2)
	t.Logf("devices-bench: | RDMA WRITE 1 MiB | one peer through rxe0 %.1f MiB/s | two peers, one through each device %.1f MiB/s | ratio %.2fx |",
		r1[len(r1)/2], r2[len(r2)/2], r2[len(r2)/2]/r1[len(r1)/2])
}
