package tests

// Benchmarks of what issue 9 changed (docs/BENCHMARKS.md records them):
//
//   - registration time of 64 MiB and 1 GiB buffers on a store with
//     transparent huge pages (buffers.huge_pages = "within_size", the
//     default) against one without (never), in alternating rounds on two
//     mounts;
//   - the daemon's memory per buffer at 10,000 and 100,000 registered
//     4 KiB buffers, beyond the buffers' own pages;
//   - `ls -l` of a directory of 100,000 buffers.
//
// Run: go test -run '^$' -bench Pinning -benchtime 1x ./tests (as root).

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func BenchmarkPinning(b *testing.B) {
	b.Run("huge", benchHuge)
	b.Run("perbuffer", benchPerBuffer)
	b.Run("pool100k", benchPool100k)
}

// benchHuge registers a fresh buffer of each size on both mounts, in
// alternating order, and reports the median ratio of never/within_size.
func benchHuge(b *testing.B) {
	base := startDaemon(b, daemonConfig{Quiet: true, Buffers: `huge_pages = "never"`})
	huge := startDaemon(b, daemonConfig{Quiet: true, Buffers: `huge_pages = "within_size"`})
	for _, c := range []struct {
		size   int64
		rounds int
	}{{64 << 20, 15}, {1 << 30, 5}} {
		var tb, th []time.Duration
		var ratios []float64
		reg := func(d *daemon) time.Duration {
			f := d.path("r")
			makeBuffer(b, f, 0)
			start := time.Now()
			if err := unix.Truncate(f, c.size); err != nil {
				b.Fatal(err)
			}
			took := time.Since(start)
			if err := os.Remove(f); err != nil {
				b.Fatal(err)
			}
			return took
		}
		for i := range c.rounds {
			var x, y time.Duration
			if i%2 == 0 {
				x = reg(base)
				y = reg(huge)
			} else {
				y = reg(huge)
				x = reg(base)
			}
			tb, th = append(tb, x), append(th, y)
			ratios = append(ratios, float64(x)/float64(y))
		}
		slices.Sort(ratios)
		b.Logf("pinning-bench: | register %s | 4 KiB pages (never) %v | huge pages (within_size) %v | ratio (median of %d rounds) %.1fx |",
			sizeName(c.size), medianDur(tb), medianDur(th), c.rounds, ratios[len(ratios)/2])
	}
}

// benchPerBuffer fills one mount with 4 KiB buffers and reports the
// daemon's anonymous memory (Go heap and stacks) and its whole resident
// set beyond the buffers' own pages, per buffer, and the time of ls -l.
func benchPerBuffer(b *testing.B) {
	raiseMapCount(b)
	d := startDaemon(b, daemonConfig{Quiet: true, Buffers: "max_buffers = 200000", Hang: 30 * time.Minute})
	dir := d.path("many")
	if err := os.Mkdir(dir, 0o700); err != nil {
		b.Fatal(err)
	}
	kb := func(key string) int64 { return procStatusKB(b, d.pid(), key) }
	anon0, rss0 := kb("RssAnon"), kb("VmRSS")
	made := 0
	for _, n := range []int{10000, 100000} {
		start := time.Now()
		for ; made < n; made++ {
			f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(made)), os.O_CREATE|os.O_RDWR, 0o600)
			if err == nil {
				err = f.Truncate(4096)
				f.Close()
			}
			if err != nil {
				b.Fatalf("buffer %d: %v", made, err)
			}
		}
		took := time.Since(start)
		anon, rss := kb("RssAnon"), kb("VmRSS")
		perAnon := float64(anon-anon0) * 1024 / float64(n)
		perRSS := float64(rss-rss0)*1024/float64(n) - 4096
		b.Logf("pinning-bench: | %d buffers | anonymous memory %.0f B per buffer | resident set beyond the 4 KiB page %.0f B per buffer | fds %d | made in %v |",
			n, perAnon, perRSS, fdCount(b, d.pid()), took.Round(time.Millisecond))
	}
	var times []time.Duration
	for range 5 {
		start := time.Now()
		cmd := exec.Command("ls", "-l", dir)
		cmd.Stdout = nil
		if err := cmd.Run(); err != nil {
			b.Fatal(err)
		}
		times = append(times, time.Since(start))
	}
	b.Logf("pinning-bench: | ls -l of %d buffers | median of 5: %v |", made, medianDur(times))
	if code := d.stop(syscall.SIGINT); code != 0 {
		b.Errorf("exit %d", code)
	}
}

// raiseMapCount raises vm.max_map_count for the benchmark and puts it
// back after: 100,000 registered buffers, or pool slots, are 100,000
// mappings, past the default 65530 (where the daemon names that limit).
func raiseMapCount(b *testing.B) { raiseMapCountTo(b, 262144) }

// raiseMapCountTo raises vm.max_map_count to n for the benchmark and puts
// it back after.
func raiseMapCountTo(b *testing.B, n int) {
	const mapCount = "/proc/sys/vm/max_map_count"
	old, err := os.ReadFile(mapCount)
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(mapCount, []byte(strconv.Itoa(n)), 0o644); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.WriteFile(mapCount, old, 0o644) })
}

// benchPool100k makes 100,000 files of 4 KiB in a pool and 100,000
// standalone buffers of 4 KiB, side by side in one mount, and reports the
// regions each holds and the time each took.
func benchPool100k(b *testing.B) {
	raiseMapCount(b)
	d := startDaemon(b, daemonConfig{Quiet: true, Buffers: "max_buffers = 250000", Hang: 30 * time.Minute})
	const n = 100000
	pool, plain := d.path("pool"), d.path("plain")
	regions := func() int64 { return benchStats(b, d).Regions }
	r0 := regions()
	if out, err := exec.Command(mrfsBin, "pool", pool, "--slot", "4KiB", "--slots", strconv.Itoa(n)).CombinedOutput(); err != nil {
		b.Fatalf("mrfs pool: %v: %s", err, out)
	}
	if err := os.Mkdir(plain, 0o700); err != nil {
		b.Fatal(err)
	}
	fill := func(dir string, size int64) time.Duration {
		start := time.Now()
		for i := range n {
			fd, err := unix.Open(filepath.Join(dir, strconv.Itoa(i)), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			if err == nil && size > 0 {
				err = unix.Ftruncate(fd, size)
			}
			if err != nil {
				b.Fatalf("%s/%d: %v", dir, i, err)
			}
			unix.Close(fd)
		}
		return time.Since(start)
	}
	tp := fill(pool, 0)
	rp := regions() - r0
	tb := fill(plain, 4096)
	rb := regions() - r0 - rp
	b.Logf("pinning-bench: | %d files of 4 KiB | pool: %d regions, made in %v | standalone buffers: %d regions, made in %v | time ratio %.2f |",
		n, rp, tp.Round(time.Millisecond), rb, tb.Round(time.Millisecond), tb.Seconds()/tp.Seconds())
	// Teardown of both, timed: longer than the harness's stop allows.
	if took, ok := timedTeardown(b, d, 5*time.Minute); ok {
		b.Logf("pinning-bench: | teardown of %d pool files and %d buffers | %v | exit %d |", n, n, took.Round(time.Millisecond), d.cmd.ProcessState.ExitCode())
	}
}

// timedTeardown stops d with SIGINT and times its teardown, which for a
// benchmark's many buffers takes longer than the harness's stop allows;
// past limit it fails the benchmark and kills d (ok false).
func timedTeardown(b *testing.B, d *daemon, limit time.Duration) (took time.Duration, ok bool) {
	d.stoppedByTest = true
	start := time.Now()
	d.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-d.done:
		return time.Since(start), true
	case <-time.After(limit):
		b.Errorf("no teardown within %v", limit)
		d.kill()
		return 0, false
	}
}

func medianDur(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

func sizeName(n int64) string {
	if n >= 1<<30 {
		return fmt.Sprintf("%d GiB", n>>30)
	}
	return fmt.Sprintf("%d MiB", n>>20)
}
