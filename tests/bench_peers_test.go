package tests

// Benchmarks of mrfs's metadata path against two other FUSE filesystems,
// each over its own tmpfs, measured in one run (issue 10; results in
// docs/BENCHMARKS.md): go-fuse's example/loopback and libfuse's
// passthrough_hp. scripts/bench-peers builds the peers and runs this:
//
//	MRFS_PEER_LOOPBACK=... MRFS_PEER_HP=... go test -run '^$' -bench Peers ./tests
//
//   - the cycle create + ftruncate(size) + close + unlink, at 4 KiB and
//     1 MiB, in alternating rounds against each peer (mrfs registers what
//     it creates; the peers only make tmpfs files);
//   - FUSE requests per cycle, counted by the kernel's trace event;
//   - `ls -l` of a directory of 10,000 files, mrfs against loopback, and
//     `mrfs status` of the same directory against its `ls -l`.

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// peer is a running peer filesystem over its own tmpfs.
type peer struct {
	name string
	mnt  string
	cmd  *exec.Cmd
	out  *syncBuffer // its stdout and stderr
}

// startPeer mounts bin over a fresh tmpfs, with args built from the
// source and mount point.
func startPeer(b *testing.B, name, bin string, args func(src, mnt string) []string) *peer {
	b.Helper()
	dir := b.TempDir()
	src, mnt := filepath.Join(dir, "src"), filepath.Join(dir, "mnt")
	for _, p := range []string{src, mnt} {
		if err := os.Mkdir(p, 0o755); err != nil {
			b.Fatal(err)
		}
	}
	if err := unix.Mount("tmpfs", src, "tmpfs", 0, "size=4g"); err != nil {
		b.Fatalf("tmpfs for %s: %v", name, err)
	}
	p := &peer{name: name, mnt: mnt, out: &syncBuffer{}}
	p.cmd = exec.Command(bin, args(src, mnt)...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		b.Fatalf("start %s: %v", name, err)
	}
	b.Cleanup(func() {
		exec.Command("umount", mnt).Run()
		p.cmd.Process.Kill()
		p.cmd.Wait()
		exec.Command("umount", "-l", mnt).Run()
		unix.Unmount(src, 0)
	})
	deadline := time.Now().Add(10 * time.Second)
	for !isMounted(mnt) {
		if time.Now().After(deadline) {
			b.Fatalf("%s did not mount:\n%s", name, p.out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return p
}

// cycles runs n cycles in dir: create, ftruncate to size (unless 0), a
// write of data at offset 0 (unless empty), close, unlink. Raw syscalls:
// os.File would add a poller registration attempt and finalizers.
func cycles(b *testing.B, dir string, n int, size int64, data []byte, seq *int) {
	for range n {
		*seq++
		p := dir + "/c" + strconv.Itoa(*seq)
		fd, err := unix.Open(p, unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
		if err != nil {
			b.Fatalf("create %s: %v", p, err)
		}
		if size > 0 {
			if err := unix.Ftruncate(fd, size); err != nil {
				b.Fatalf("ftruncate %s: %v", p, err)
			}
		}
		if len(data) > 0 {
			if _, err := unix.Pwrite(fd, data, 0); err != nil {
				b.Fatalf("write %s: %v", p, err)
			}
		}
		if err := unix.Close(fd); err != nil {
			b.Fatalf("close %s: %v", p, err)
		}
		if err := unix.Unlink(p); err != nil {
			b.Fatalf("unlink %s: %v", p, err)
		}
	}
}

// tracing is where tracefs is mounted; its fuse_request_send event (Linux
// 6.14 and later) names every request the kernel sends to any FUSE
// daemon, so all three filesystems are counted the same way, by the
// kernel rather than by their own logs.
const tracing = "/sys/kernel/tracing"

var traceRequest = regexp.MustCompile(`fuse_request_send: connection [0-9]+ req [0-9]+ opcode [0-9]+ \((?:FUSE_)?([A-Z_0-9]+)\)`)

// requestsPerCycle runs 20 cycles in dir with the kernel's FUSE request
// trace on for dir's connection, and returns the requests per cycle and
// their names. FORGETs go on their own queue, past the event: each cycle
// sends one (the unlinked file's), added here.
func requestsPerCycle(b *testing.B, dir string, size int64, data []byte) (float64, string) {
	event := filepath.Join(tracing, "events/fuse/fuse_request_send")
	if _, err := os.Stat(event); errors.Is(err, os.ErrNotExist) {
		if err := unix.Mount("nodev", tracing, "tracefs", 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
			b.Fatalf("mount tracefs: %v", err)
		}
	}
	if _, err := os.Stat(event); err != nil {
		b.Skipf("this kernel has no fuse_request_send trace event (Linux 6.14 and later): %v", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		b.Fatal(err)
	}
	write := func(file, value string) {
		if err := os.WriteFile(filepath.Join(tracing, file), []byte(value), 0); err != nil {
			b.Fatalf("tracefs %s: %v", file, err)
		}
	}
	var seq int
	cycles(b, dir, 5, size, data, &seq) // warm: the first cycle looks the directory up
	write("trace", "")
	write("events/fuse/fuse_request_send/filter", fmt.Sprintf("connection == %d", unix.Minor(st.Dev)))
	write("events/fuse/fuse_request_send/enable", "1")
	const n = 20
	cycles(b, dir, n, size, data, &seq)
	write("events/fuse/fuse_request_send/enable", "0")
	write("events/fuse/fuse_request_send/filter", "0")
	trace, err := os.ReadFile(filepath.Join(tracing, "trace"))
	if err != nil {
		b.Fatal(err)
	}
	counts := map[string]int{"FORGET": n}
	total := n
	for _, m := range traceRequest.FindAllStringSubmatch(string(trace), -1) {
		counts[m[1]]++
		total++
	}
	var parts []string
	for op, c := range counts {
		parts = append(parts, op+" "+strconv.FormatFloat(float64(c)/n, 'f', -1, 64))
	}
	slices.Sort(parts)
	return float64(total) / n, strings.Join(parts, ", ")
}

func BenchmarkPeers(b *testing.B) {
	lb, hb := os.Getenv("MRFS_PEER_LOOPBACK"), os.Getenv("MRFS_PEER_HP")
	if lb == "" || hb == "" {
		b.Skip("the peers are built by scripts/bench-peers (MRFS_PEER_LOOPBACK, MRFS_PEER_HP)")
	}
	benchResults.Lock()
	benchResults.order, benchResults.last = nil, map[*testing.B]benchResult{}
	benchResults.Unlock()
	loopbackArgs := func(src, mnt string) []string { return []string{"-directmount", "-q", mnt, src} }
	hpArgs := func(src, mnt string) []string { return []string{"--foreground", src, mnt} }

	b.Run("requests", func(b *testing.B) {
		d := startDaemon(b, daemonConfig{Quiet: true})
		lo := startPeer(b, "loopback", lb, loopbackArgs)
		hp := startPeer(b, "passthrough_hp", hb, hpArgs)
		for _, c := range []struct{ name, dir string }{
			{"mrfs", d.mnt}, {"go-fuse loopback", lo.mnt}, {"passthrough_hp", hp.mnt},
		} {
			n, ops := requestsPerCycle(b, c.dir, 4096, nil)
			b.Logf("peers-bench: | requests per create+ftruncate(4 KiB)+close+unlink | %s | %.1f | %s |", c.name, n, ops)
		}
	})

	b.Run("create", func(b *testing.B) {
		d := startDaemon(b, daemonConfig{Quiet: true, Hang: 30 * time.Minute})
		lo := startPeer(b, "loopback", lb, loopbackArgs)
		hp := startPeer(b, "passthrough_hp", hb, hpArgs)
		for _, size := range []int64{4 << 10, 1 << 20} {
			for _, p := range []*peer{lo, hp} {
				var ms, ps int
				const batch = 200
				mrfs := func(b *testing.B) { cycles(b, d.mnt, batch, size, nil, &ms) }
				other := func(b *testing.B) { cycles(b, p.mnt, batch, size, nil, &ps) }
				b.Run(sizeLabel(size)+"-vs-"+p.name, func(b *testing.B) {
					tp, tm := alternate(b, other, mrfs)
					report(b, benchResult{pair: "create " + sizeLabel(size), unit: "ops/s", baseName: p.name, name: "mrfs",
						goal: goal{minRatio: 1}}, batch, tp, tm)
				})
			}
		}
	})

	// A file in a pool of 1 MiB slots against a file the peers make on
	// tmpfs, both written 4 KiB (issue 20): a registered 1 MiB buffer
	// ready in the time a plain FUSE filesystem makes a file.
	b.Run("pool", func(b *testing.B) {
		d := startDaemon(b, daemonConfig{Quiet: true, Hang: 30 * time.Minute})
		pool := d.path("pool")
		if out, err := exec.Command(mrfsBin, "pool", pool, "--slot", "1MiB", "--slots", "16").CombinedOutput(); err != nil {
			b.Fatalf("mrfs pool: %v: %s", err, out)
		}
		lo := startPeer(b, "loopback", lb, loopbackArgs)
		hp := startPeer(b, "passthrough_hp", hb, hpArgs)
		data := make([]byte, 4096)
		for _, c := range []struct{ name, dir string }{
			{"mrfs pool", pool}, {"go-fuse loopback", lo.mnt}, {"passthrough_hp", hp.mnt},
		} {
			n, ops := requestsPerCycle(b, c.dir, 0, data)
			b.Logf("peers-bench: | requests per create+write(4 KiB)+close+unlink | %s | %.1f | %s |", c.name, n, ops)
		}
		for _, p := range []*peer{lo, hp} {
			var ms, ps int
			const batch = 200
			mrfs := func(b *testing.B) { cycles(b, pool, batch, 0, data, &ms) }
			other := func(b *testing.B) { cycles(b, p.mnt, batch, 0, data, &ps) }
			b.Run("1MiB-slot-vs-"+p.name, func(b *testing.B) {
				tp, tm := alternate(b, other, mrfs)
				report(b, benchResult{pair: "create+write 4 KiB, pool", unit: "ops/s", baseName: p.name, name: "mrfs",
					goal: goal{minRatio: 1}}, batch, tp, tm)
			})
		}
	})

	b.Run("ls", func(b *testing.B) {
		d := startDaemon(b, daemonConfig{Quiet: true, Buffers: "max_buffers = 20000", Hang: 30 * time.Minute})
		lo := startPeer(b, "loopback", lb, loopbackArgs)
		const n = 10000
		for _, dir := range []string{d.path("many"), filepath.Join(lo.mnt, "many")} {
			if err := os.Mkdir(dir, 0o700); err != nil {
				b.Fatal(err)
			}
			for i := range n {
				fd, err := unix.Open(filepath.Join(dir, strconv.Itoa(i)), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
				if err == nil {
					err = unix.Ftruncate(fd, 4096)
					unix.Close(fd)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
		}
		ls := func(dir string) func(*testing.B) {
			return func(b *testing.B) {
				cmd := exec.Command("ls", "-l", dir)
				var out bytes.Buffer
				cmd.Stdout = &out
				if err := cmd.Run(); err != nil {
					b.Fatal(err)
				}
				if lines := bytes.Count(out.Bytes(), []byte("\n")); lines != n+1 {
					b.Fatalf("ls -l %s: %d lines", dir, lines)
				}
			}
		}
		status := func(b *testing.B) {
			out, err := exec.Command(mrfsBin, "status", d.mnt).Output()
			if err != nil {
				b.Fatal(err)
			}
			if lines := bytes.Count(out, []byte("\n")); lines < n {
				b.Fatalf("mrfs status: %d lines", lines)
			}
		}
		b.Run("ls-vs-loopback", func(b *testing.B) {
			tl, tm := alternate(b, ls(filepath.Join(lo.mnt, "many")), ls(d.path("many")))
			report(b, benchResult{pair: "ls -l 10k", unit: "ops/s", baseName: "loopback", name: "mrfs",
				goal: goal{minRatio: 1 / 1.2}}, 1, tl, tm)
		})
		b.Run("status-vs-ls", func(b *testing.B) {
			tl, ts := alternate(b, ls(d.path("many")), status)
			report(b, benchResult{pair: "status 10k", unit: "ops/s", baseName: "ls-l", name: "status",
				goal: goal{minRatio: 1 / 1.5}}, 1, tl, ts)
		})
	})
	printSummary()
}

func sizeLabel(n int64) string {
	if n >= 1<<30 && n%(1<<30) == 0 {
		return strconv.FormatInt(n>>30, 10) + "GiB"
	}
	if n >= 1<<20 {
		return strconv.FormatInt(n>>20, 10) + "MiB"
	}
	return strconv.FormatInt(n>>10, 10) + "KiB"
}
