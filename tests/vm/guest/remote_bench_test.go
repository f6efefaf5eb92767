//go:build rdma

package guest

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"mrfs/remote/rdmacm"
)

// TestRemoteRDMABenchmark times one-sided RDMA WRITE and READ over an
// rdma_cm connection to mrfs on rxe0: this test process is the peer, the
// daemon's QP the responder (in the kernel: rxe answers without the
// daemon). One operation in flight at a time: latency is the median of
// single operations, throughput the bytes over the total time. Under TCG
// only the relative figures mean something. It runs when MRFS_VM_BENCH=1.
func TestRemoteRDMABenchmark(t *testing.T) {
	requireGuest(t)
	if os.Getenv("MRFS_VM_BENCH") != "1" {
		t.Skip("rdma_cm benchmark: set MRFS_VM_BENCH=1 (tests/vm/run --bench)")
	}
	d := remoteMount(t)
	defer func() {
		if err := d.stop(t); err != nil {
			t.Errorf("mrfs exited with %v after SIGINT", err)
		}
	}()
	const size = 1 << 20
	f := filepath.Join(d.dir, "bench")
	iovaS, rkeyS := buffer(t, f, size, "local_write,remote_write,remote_read")
	iova, _ := strconv.ParseUint(iovaS, 0, 64)
	rkey64, _ := strconv.ParseUint(rkeyS, 0, 32)
	rkey := uint32(rkey64)

	c, err := rdmacm.Dial(d.peer, "/", rdmacm.DialOptions{BufSize: size, Token: d.token(t, "/")})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	payload := bytes.Repeat([]byte{0xa5}, size)
	dst := make([]byte, size)
	t.Logf("rdmacm-bench: | op | size | ops | median latency | throughput |")
	for _, sz := range []int{4 << 10, 1 << 20} {
		ops := 2000
		if sz >= 1<<20 {
			ops = 100
		}
		for _, op := range []string{"WRITE", "READ"} {
			lat := make([]time.Duration, 0, ops)
			start := time.Now()
			for i := 0; i < ops; i++ {
				t0 := time.Now()
				var err error
				if op == "WRITE" {
					err = c.Write(iova, rkey, payload[:sz])
				} else {
					err = c.Read(dst[:sz], iova, rkey)
				}
				if err != nil {
					t.Fatalf("%s %d: %v", op, sz, err)
				}
				lat = append(lat, time.Since(t0))
			}
			total := time.Since(start)
			mbs := float64(sz) * float64(ops) / total.Seconds() / (1 << 20)
			t.Logf("rdmacm-bench: | RDMA %s | %s | %d | %s | %.1f MiB/s |", op, sizeName(sz), ops, fmtDur(median(lat)), mbs)
		}
	}
	// What the last WRITE put there is what the file shows.
	got, err := os.ReadFile(f)
	if err != nil || !bytes.Equal(got, payload) {
		t.Errorf("the file does not hold the benchmark's writes (err %v)", err)
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}
