package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkRestartMounted: issue 31's restart time. One mount under a keeper
// on soft with n registered 4 KiB buffers in 100 directories (n: 10,000
// and 100,000), every one of them held by the kernel (each was created
// through the mount), restarted three times by `mrfs upgrade` and three
// times by a SIGKILL of the daemon, in turns. Timed: an upgrade from
// `mrfs upgrade`'s start to its return; a crash from the kill to the
// first answer of the new daemon (the stats xattr with its pid). The
// baseline, in the same run: making the n buffers (two threads, open,
// ftruncate, close). A client's stat loop through it all reports the
// longest a stat waited. After them, every buffer is there and
// registered once (a restart that lost or leaked one fails here).
func BenchmarkRestartMounted(b *testing.B) {
	for _, n := range []int{10000, 100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			for b.Loop() {
				benchRestart(b, n)
			}
		})
	}
}

func benchRestart(b *testing.B, n int) {
	const dirs = 100
	// The daemon maps each buffer once; a restart's new daemon maps them
	// all again while the old mappings go with the old process or exec.
	raiseMapCountTo(b, 2*n+65536)
	d := startDaemon(b, daemonConfig{Quiet: true, Keeper: true, Buffers: fmt.Sprintf("max_buffers = %d", n+1000),
		Hang: 30 * time.Minute})
	for i := range dirs {
		if err := os.Mkdir(d.path("d"+strconv.Itoa(i)), 0o755); err != nil {
			b.Fatal(err)
		}
	}
	file := func(i int) string {
		return filepath.Join(d.mnt, "d"+strconv.Itoa(i%dirs), strconv.Itoa(i))
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 2 {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n || b.Failed() {
					return
				}
				fd, err := unix.Open(file(i), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
				if err == nil {
					err = unix.Ftruncate(fd, 4096)
					unix.Close(fd)
				}
				if err != nil {
					b.Errorf("buffer %d: %v", i, err)
				}
			}
		})
	}
	wg.Wait()
	made := time.Since(start)
	if b.Failed() {
		return
	}

	// The client's loop: stat of a file, and the longest wait.
	var stop atomic.Bool
	var longest atomic.Int64
	var loopErr error
	var loop sync.WaitGroup
	loop.Go(func() {
		for i := 0; !stop.Load(); i++ {
			var st unix.Stat_t
			t0 := time.Now()
			err := unix.Stat(file(i%n), &st)
			if took := int64(time.Since(t0)); took > longest.Load() {
				longest.Store(took)
			}
			// A kill can fail the one request being copied to the
			// daemon (EIO; TestCrashUnderKeeper).
			if err != nil && err != syscall.EIO && loopErr == nil {
				loopErr = fmt.Errorf("stat %s: %w", file(i%n), err)
			}
		}
	})

	// stats waits for the mount's answer; a kill may fail one with EIO.
	stats := func() mrfsStats {
		for {
			raw, err := getxattr(d.mnt, xStats)
			if err == syscall.EIO {
				continue
			}
			if err != nil {
				b.Fatalf("getxattr %s: %v", xStats, err)
			}
			var s mrfsStats
			if err := json.Unmarshal([]byte(raw), &s); err != nil {
				b.Fatal(err)
			}
			return s
		}
	}
	var upgrades, crashes []time.Duration
	for range 3 {
		t0 := time.Now()
		out, err := exec.Command(mrfsBin, "upgrade", "--timeout", "10m", d.mnt).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "upgraded in place") {
			b.Fatalf("mrfs upgrade: %v: %s\n%s", err, out, tail(d.stderr.String(), 40))
		}
		upgrades = append(upgrades, time.Since(t0))

		before := stats().PID
		t0 = time.Now()
		if err := syscall.Kill(before, syscall.SIGKILL); err != nil {
			b.Fatal(err)
		}
		for stats().PID == before {
		}
		crashes = append(crashes, time.Since(t0))
	}
	stop.Store(true)
	loop.Wait()
	if loopErr != nil {
		b.Error(loopErr)
	}
	if s := stats(); s.Restarts != 6 || s.Buffers != int64(n) || s.Regions != int64(n) || s.ChargedBytes != int64(n)*4096 {
		b.Fatalf("after 6 restarts of %d buffers: restarts %d, buffers %d, regions %d, charged %d B",
			n, s.Restarts, s.Buffers, s.Regions, s.ChargedBytes)
	}
	up, cr := medianDur(upgrades), medianDur(crashes)
	b.ReportMetric(made.Seconds(), "create-s")
	b.ReportMetric(up.Seconds(), "upgrade-s")
	b.ReportMetric(cr.Seconds(), "crash-s")
	b.ReportMetric(time.Duration(longest.Load()).Seconds(), "longest-stat-s")
	b.Logf("restart-bench: | %d | create %v | upgrade %v (median of %v) | crash %v (median of %v) | upgrade/create %.2f | crash/create %.2f | longest stat %v |",
		n, made.Round(time.Millisecond), up.Round(time.Millisecond), roundAll(upgrades), cr.Round(time.Millisecond), roundAll(crashes),
		up.Seconds()/made.Seconds(), cr.Seconds()/made.Seconds(), time.Duration(longest.Load()).Round(time.Millisecond))
}

func roundAll(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}
