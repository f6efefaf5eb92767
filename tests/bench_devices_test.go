package tests

import (
	"os"
	"slices"
	"testing"
	"time"
)

// BenchmarkTwoDevices: issue 22's ready time of a 1 GiB buffer
// registered on two soft devices against one (goal <= 1.3x: the pages
// are populated once; the second registration pins pages already
// there). Alternating rounds on two mounts, each round's 1 GiB removed
// before the next; the median of the ratios. The guest measures the same
// on rxe0 and rxe1 (tests/vm, TestTwoDevicesBenchmark).
//
// Run: go test -run '^$' -bench TwoDevices -benchtime 1x ./tests (as root).
func BenchmarkTwoDevices(b *testing.B) {
	one := startDaemon(b, daemonConfig{Quiet: true, Verbs: "soft_devices = 2"})
	two := startDaemon(b, daemonConfig{Quiet: true, Verbs: "soft_devices = 2\ndevices = [\"soft0\", \"soft1\"]"})
	const size, rounds = 1 << 30, 7
	ready := func(d *daemon) time.Duration {
		f := d.path("r")
		makeBuffer(b, f, 0)
		start := time.Now()
		if err := os.Truncate(f, size); err != nil { // retries EINTR, unlike unix.Truncate
			b.Fatal(err)
		}
		took := time.Since(start)
		if err := os.Remove(f); err != nil {
			b.Fatal(err)
		}
		return took
	}
	// The first touch of memory this VM gave back is slower: once each,
	// untimed.
	ready(one)
	ready(two)
	var t1, t2 []time.Duration
	var ratios []float64
	for i := range rounds {
		var x, y time.Duration
		if i%2 == 0 {
			x, y = ready(one), ready(two)
		} else {
			y, x = ready(two), ready(one)
		}
		t1, t2 = append(t1, x), append(t2, y)
		ratios = append(ratios, float64(y)/float64(x))
	}
	slices.Sort(ratios)
	b.Logf("devices-bench: | ready time of 1 GiB | one soft device %v | two %v | ratio (median of %d rounds) %.2fx |",
		medianDur(t1), medianDur(t2), rounds, ratios[len(ratios)/2])
}
