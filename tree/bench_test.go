package tree_test

import (
	"os"
	"runtime"
	"strconv"
	"testing"

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
			if _, err := tr.Root().Create("f"+strconv.Itoa(i), tree.Owner{}, 0o600, nil); err != nil {
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
