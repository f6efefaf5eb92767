package tests

// How fast a big buffer is ready (issue 12): the time from ftruncate to
// its return, registered, on mrfs (huge pages and parallel population,
// its defaults) against testdata/regbench.c, a program that does it by
// hand (memfd, ftruncate, mmap, mlock, as the soft backend registers):
// single-threaded on 4 KiB pages, single-threaded on a huge-page tmpfs,
// and with two threads populating a huge-page tmpfs before one mlock, the
// best this machine allows. Each pair alternates rounds (AB, BA, ...);
// the ratios are medians of the per-round ratios.
//
//	go test -run '^$' -bench BigBuffer -benchtime 5x ./tests
//
// Everything runs in a memory cgroup of its own (the buffer is 8 GiB, or
// MRFS_BENCH_BIG_SIZE bytes).

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func BenchmarkBigBuffer(b *testing.B) {
	size := uint64(8 << 30)
	if s := os.Getenv("MRFS_BENCH_BIG_SIZE"); s != "" {
		n, err := strconv.ParseUint(s, 0, 64)
		if err != nil {
			b.Fatalf("MRFS_BENCH_BIG_SIZE=%q: %v", s, err)
		}
		size = n
	}
	benchResults.Lock()
	benchResults.order, benchResults.last = nil, map[*testing.B]benchResult{}
	benchResults.Unlock()

	wrap := memCgroup(b, size+2<<30)
	d := startDaemon(b, daemonConfig{Quiet: true, Wrapper: wrap, Hang: 30 * time.Minute,
		Buffers: fmt.Sprintf("max_pinned = %d", size+1<<30)})
	prog := filepath.Join(b.TempDir(), "regbench")
	if out, err := exec.Command("cc", "-Wall", "-O2", "-pthread", "-o", prog, "testdata/regbench.c").CombinedOutput(); err != nil {
		b.Fatalf("cc testdata/regbench.c: %v\n%s", err, out)
	}
	huge := b.TempDir()
	if err := unix.Mount("tmpfs", huge, "tmpfs", 0, fmt.Sprintf("size=%d,huge=always", size+1<<30)); err != nil {
		b.Fatalf("a huge-page tmpfs: %v", err)
	}
	b.Cleanup(func() { unix.Unmount(huge, unix.MNT_DETACH) })

	f := d.path("big")
	fh, err := os.OpenFile(f, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	defer fh.Close()
	mrfs := func() time.Duration {
		start := time.Now()
		if err := unix.Ftruncate(int(fh.Fd()), int64(size)); err != nil {
			b.Fatalf("ftruncate on mrfs: %v", err)
		}
		took := time.Since(start)
		if st := mustXattr(b, f, xState); st != "registered" {
			b.Fatalf("after ftruncate: %s", st)
		}
		if err := unix.Ftruncate(int(fh.Fd()), 0); err != nil {
			b.Fatal(err)
		}
		return took
	}
	byHand := func(threads int, file string) func() time.Duration {
		return func() time.Duration {
			args := append(append([]string{}, wrap[1:]...), prog, strconv.FormatUint(size, 10), strconv.Itoa(threads))
			if file != "" {
				args = append(args, file)
			}
			out, err := exec.Command(wrap[0], args...).Output()
			if err != nil {
				b.Fatalf("regbench %d threads %s: %v", threads, file, err)
			}
			s, err := strconv.ParseFloat(strings.TrimSpace(string(out)), 64)
			if err != nil {
				b.Fatalf("regbench printed %q", out)
			}
			return time.Duration(s * float64(time.Second))
		}
	}
	// This VM hands freed memory back to its host (free page reporting),
	// and the first touch of such memory costs several times more than
	// the guest's own work. Each timed side therefore runs right after
	// an untimed touch of as much memory (freed pages are reported only
	// after a delay), so every side gets memory the host has backed.
	warm := byHand(2, filepath.Join(huge, "warm"))
	timed := func(f func() time.Duration) time.Duration {
		warm()
		return f()
	}
	label := "ready " + sizeLabel(int64(size))
	for _, side := range []struct {
		name string
		run  func() time.Duration
		goal goal
	}{
		{"4KiB-1thread", byHand(1, ""), goal{minRatio: 5}},
		{"huge-1thread", byHand(1, filepath.Join(huge, "f")), goal{}},
		{"huge-2threads", byHand(2, filepath.Join(huge, "f")), goal{minRatio: 1 / 1.2}},
	} {
		b.Run("vs-"+side.name, func(b *testing.B) {
			var tBase, tMrfs []time.Duration
			for i := range b.N {
				if i%2 == 0 {
					tBase, tMrfs = append(tBase, timed(side.run)), append(tMrfs, timed(mrfs))
				} else {
					tMrfs, tBase = append(tMrfs, timed(mrfs)), append(tBase, timed(side.run))
				}
			}
			report(b, benchResult{pair: label, unit: "GB/s", baseName: side.name, name: "mrfs", goal: side.goal}, float64(size), tBase, tMrfs)
		})
	}
	printSummary()
}
