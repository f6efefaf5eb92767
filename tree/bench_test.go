package tree_test

import (
	"encoding/json"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/store"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// BenchmarkHeapPerBuffer: the Go heap one registered 4 KiB buffer holds
// in the namespace and below it (tree, buffer, store, the soft device),
// without FUSE: live bytes and objects per buffer after a GC, for 50,000
// buffers in the private tmpfs store (as a mount has them). The
// daemon's resident memory per buffer adds go-fuse's inode, fs's node
// and the garbage collector's headroom (BenchmarkPinning/perbuffer).
func BenchmarkHeapPerBuffer(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("the private tmpfs store needs CAP_SYS_ADMIN: run as root")
	}
	const n = 50000
	for b.Loop() {
		dev, err := soft.New(soft.Options{}).Open("")
		if err != nil {
			b.Fatal(err)
		}
		st, err := store.NewTmpfs(store.TmpfsOptions{Size: 2 * n * 4096, Files: 2 * n, Huge: "never"})
		if err != nil {
			b.Fatal(err)
		}
		mgr := buffer.NewManager(dev, buffer.Options{Store: st, MaxBuffers: 2 * n, Allowed: verbs.LocalWrite}, nil)
		tr, err := tree.New(mgr, tree.Options{DefaultSize: 4096, DefaultAccess: verbs.LocalWrite}, verbs.LocalWrite, tree.Owner{}, 0o755)
		if err != nil {
			b.Fatal(err)
		}
		var m0, m1 runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m0)
		for i := range n {
			if _, err := tr.Root().Create(0, "f"+strconv.Itoa(i), tree.Owner{}, 0o600, nil); err != nil {
				b.Fatal(err)
			}
		}
		runtime.GC()
		runtime.ReadMemStats(&m1)
		b.ReportMetric(float64(m1.HeapAlloc-m0.HeapAlloc)/n, "heap-B/buffer")
		b.ReportMetric(float64(m1.HeapObjects-m0.HeapObjects)/n, "objects/buffer")
		runtime.KeepAlive(tr)
		if _, err := mgr.Close(); err != nil {
			b.Fatal(err)
		}
		st.Close()
		dev.Close()
	}
}

// BenchmarkRestart: a namespace of n registered 4 KiB buffers in the
// private tmpfs store handed from one manager to the next (DESIGN,
// Restart), without FUSE: State saved and encoded, the registrations
// left, the store adopted, the state decoded and restored (every file
// registered anew). The baseline, in the same run, is making the same
// namespace from nothing (create-s); restart-s/create-s is the ratio.
// The pages are touched once before either side is timed (the first
// touch of memory here costs several times the next).
func BenchmarkRestart(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("the private tmpfs store needs CAP_SYS_ADMIN: run as root")
	}
	for _, n := range []int{10000, 100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			if n > 60000 {
				// A registered buffer is a mapping: past the default 65,530.
				// Put back after.
				const mapCount = "/proc/sys/vm/max_map_count"
				old, err := os.ReadFile(mapCount)
				if err != nil {
					b.Fatal(err)
				}
				if err := os.WriteFile(mapCount, []byte("262144"), 0o644); err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { os.WriteFile(mapCount, old, 0o644) })
			}
			opt := store.TmpfsOptions{Size: 2 * uint64(n) * 4096, Files: 2 * uint64(n), Huge: "never"}
			bopt := buffer.Options{MaxBuffers: 2 * n, Allowed: verbs.LocalWrite}
			topt := tree.Options{DefaultSize: 4096, DefaultAccess: verbs.LocalWrite}
			start := func(st store.Store) (*buffer.Manager, func()) {
				dev, err := soft.New(soft.Options{MaxMR: 4 * n}).Open("")
				if err != nil {
					b.Fatal(err)
				}
				o := bopt
				o.Store = st
				mgr := buffer.NewManager(dev, o, nil)
				return mgr, func() { mgr.Close(); st.Close(); dev.Close() }
			}
			for b.Loop() {
				b.StopTimer()
				// Untimed: the pages touched once (see above).
				st, err := store.NewTmpfs(opt)
				if err != nil {
					b.Fatal(err)
				}
				mgr, end := start(st)
				tr, err := tree.New(mgr, topt, verbs.LocalWrite, tree.Owner{}, 0o755)
				if err != nil {
					b.Fatal(err)
				}
				for i := range n {
					if _, err := tr.Root().Create(0, "f"+strconv.Itoa(i), tree.Owner{}, 0o600, nil); err != nil {
						b.Fatal(err)
					}
				}
				end()

				st, err = store.NewTmpfs(opt)
				if err != nil {
					b.Fatal(err)
				}
				mgr, end = start(st)
				t0 := time.Now()
				tr, err = tree.New(mgr, topt, verbs.LocalWrite, tree.Owner{}, 0o755)
				if err != nil {
					b.Fatal(err)
				}
				for i := range n {
					if _, err := tr.Root().Create(0, "f"+strconv.Itoa(i), tree.Owner{}, 0o600, nil); err != nil {
						b.Fatal(err)
					}
				}
				create := time.Since(t0)

				t0 = time.Now()
				state, err := tr.State()
				if err != nil {
					b.Fatal(err)
				}
				js, err := json.Marshal(state)
				if err != nil {
					b.Fatal(err)
				}
				fd, err := st.(store.Lasting).Handover()
				if err != nil {
					b.Fatal(err)
				}
				if _, err := mgr.Leave(); err != nil {
					b.Fatal(err)
				}
				end()
				st2, err := store.AdoptTmpfs(fd, opt)
				if err != nil {
					b.Fatal(err)
				}
				mgr2, end2 := start(st2)
				var back tree.State
				if err := json.Unmarshal(js, &back); err != nil {
					b.Fatal(err)
				}
				if _, err := tree.Restore(mgr2, topt, back); err != nil {
					b.Fatal(err)
				}
				restart := time.Since(t0)
				if got := mgr2.Stats().Buffers; got != n {
					b.Fatalf("restored %d buffers, want %d", got, n)
				}
				end2()
				b.ReportMetric(create.Seconds(), "create-s")
				b.ReportMetric(restart.Seconds(), "restart-s")
				b.ReportMetric(restart.Seconds()/create.Seconds(), "restart/create")
				b.ReportMetric(float64(len(js))/float64(n), "state-B/buffer")
				b.StartTimer()
			}
		})
	}
}
