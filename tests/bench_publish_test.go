package tests

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"
)

// BenchmarkPublish: publication keeping up with changes (issue 21). One
// mount publishes a pool's files (remote_read) to a real etcd; a driver
// renames files at a steady 1,000 a second (each a delete and a put in
// etcd, which the rename waits for) from 32 threads while a watch on
// etcd sees the new keys arrive. Measured with
// 1,000 files published, then with 100,000 (the pool grown in place),
// in the same run: how long a change takes to be visible in etcd (from
// the rename's start to the watch event: p50, p99, max), the changes a
// second achieved, and the daemon's CPU (cores) over each phase; the
// ratios of 100,000 to 1,000 say whether publication slows with size.
func BenchmarkPublish(b *testing.B) {
	raiseMapCount(b)
	e := startEtcd(b)
	d := startDaemon(b, daemonConfig{Quiet: true, Buffers: "max_buffers = 250000", Remote: backend.listen(),
		Publish: fmt.Sprintf("endpoints = [%q]\nprefix = \"/bench\"\nlease = \"10s\"\nname = \"m\"", e.url), Hang: 30 * time.Minute})
	host, _ := os.Hostname()
	prefix := "/bench/" + host + "/m/pool/"
	pool := d.path("pool")
	const small, large = 1000, 100000
	if out, err := exec.Command(mrfsBin, "pool", pool, "--slot", "4KiB", "--slots", strconv.Itoa(small), "--access", "local_write,remote_read").CombinedOutput(); err != nil {
		b.Fatalf("mrfs pool: %v: %s", err, out)
	}
	c := e.client()
	defer c.Close()
	create := func(from, to int, side string) {
		for i := from; i < to; i++ {
			fd, err := unix.Open(filepath.Join(pool, side+strconv.Itoa(i)), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			if err != nil {
				b.Fatalf("create %d: %v", i, err)
			}
			unix.Close(fd)
		}
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			r, err := c.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
			cancel()
			if err == nil && r.Count == int64(to) {
				return
			}
			if time.Now().After(deadline) {
				b.Fatalf("%v keys published (%v), want %d", r, err, to)
			}
		}
	}
	type result struct {
		p50, p99, max time.Duration
		rate, cores   float64
	}
	round := 0 // odd rounds rename f* to g*, even ones back
	run := func(n int) result {
		const perSecond = 1000
		changes := min(n, 5000)
		round++
		from, to := "f", "g"
		if round%2 == 0 {
			from, to = "g", "f"
		}
		var mu sync.Mutex
		started := map[string]time.Time{}
		var lat []time.Duration
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		w := c.Watch(ctx, prefix+to, clientv3.WithPrefix())
		seen := make(chan struct{})
		go func() {
			defer close(seen)
			for r := range w {
				now := time.Now()
				mu.Lock()
				for _, ev := range r.Events {
					if s, ok := started[string(ev.Kv.Key)]; ok && ev.Type == clientv3.EventTypePut {
						lat = append(lat, now.Sub(s))
						delete(started, string(ev.Kv.Key))
					}
				}
				done := len(lat) == changes
				mu.Unlock()
				if done {
					return
				}
			}
		}()
		time.Sleep(200 * time.Millisecond) // the watch is in place
		cpu0 := procCPU(b, d.pid())
		t0 := time.Now()
		jobs := make(chan int, changes)
		var wg sync.WaitGroup
		// Callers wait for their rename's delete to be in etcd: as many
		// as a busy mount has at once keep the pace.
		for range 32 {
			wg.Go(func() {
				for i := range jobs {
					mu.Lock()
					started[prefix+to+strconv.Itoa(i)] = time.Now()
					mu.Unlock()
					if err := os.Rename(filepath.Join(pool, from+strconv.Itoa(i)), filepath.Join(pool, to+strconv.Itoa(i))); err != nil {
						b.Errorf("rename %d: %v", i, err)
					}
				}
			})
		}
		// Every nth file of the n published, at a steady pace; the rest
		// of the files are renamed untimed afterwards, so that the next
		// round finds every name on the same side.
		stride := n / changes
		tick := time.NewTicker(time.Second / perSecond)
		for k := range changes {
			<-tick.C
			jobs <- k * stride
		}
		tick.Stop()
		close(jobs)
		wg.Wait()
		select {
		case <-seen:
		case <-time.After(30 * time.Second):
			mu.Lock()
			b.Errorf("%d of %d renames were not seen in etcd within 30 s", changes-len(lat), changes)
			mu.Unlock()
		}
		wall := time.Since(t0)
		cores := (procCPU(b, d.pid()) - cpu0).Seconds() / wall.Seconds()
		for i := range n {
			if i%stride != 0 || i/stride >= changes {
				os.Rename(filepath.Join(pool, from+strconv.Itoa(i)), filepath.Join(pool, to+strconv.Itoa(i)))
			}
		}
		mu.Lock()
		defer mu.Unlock()
		slices.Sort(lat)
		if len(lat) == 0 {
			b.Fatal("no change seen")
		}
		return result{p50: lat[len(lat)/2], p99: lat[len(lat)*99/100], max: lat[len(lat)-1],
			rate: float64(changes) / wall.Seconds(), cores: cores}
	}
	create(0, small, "f")
	rs := run(small)
	if out, err := exec.Command("setfattr", "-n", xPool, "-v", "slots="+strconv.Itoa(large), pool).CombinedOutput(); err != nil {
		b.Fatalf("grow the pool: %v: %s", err, out)
	}
	create(small, large, "g") // where the first round left the others
	rl := run(large)
	for _, r := range []struct {
		n int
		result
	}{{small, rs}, {large, rl}} {
		b.Logf("publish-bench: | %d published | 1,000 renames/s asked, %.0f/s done | visible in etcd p50 %v, p99 %v, max %v | daemon CPU %.2f cores |",
			r.n, r.rate, r.p50.Round(time.Microsecond), r.p99.Round(time.Microsecond), r.max.Round(time.Microsecond), r.cores)
	}
	b.Logf("publish-bench: | ratio 100,000 / 1,000 | p99 %.2f | daemon CPU %.2f |", rl.p99.Seconds()/rs.p99.Seconds(), rl.cores/rs.cores)
	timedTeardown(b, d, 5*time.Minute)
}

// procCPU is the CPU time (user and system) process pid has used.
func procCPU(b *testing.B, pid int) time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command's closing parenthesis: utime and stime are
	// the 12th and 13th of them, in clock ticks (100 a second).
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}
