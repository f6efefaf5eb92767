// Package gcpace bounds the daemon's garbage-collector headroom in bytes.
//
// The Go runtime lets the heap grow by GOGC percent of what is live before
// it collects: with the default of 100 a daemon that holds a million
// buffers keeps as much memory again as headroom. mrfs's heap is mostly
// long-lived buffer records: Start keeps the headroom at 64 MiB while that
// is at least 40% of the live heap (160 MiB), and at 40% past that,
// setting the percentage from the live heap once a second. The floor
// bounds the collector's work: each byte allocated costs at most 2.5
// bytes marked. (With 64 MiB over a million buffers creating them ran at
// half its first pace; with a quarter, at 0.5 to 0.7 of it; with 40%, at
// 0.88 of the first tenth's over the last tenth, for 830 to 880 B of the
// daemon's memory per buffer; 50% bought nothing measurable:
// docs/BENCHMARKS.md.)
package gcpace

import (
	"log/slog"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"time"
)

// Headroom is what the heap may grow past its live bytes between
// collections, once the live heap is past Headroom itself (below it, the
// runtime's default of 100% applies).
const Headroom = 64 << 20

// MinPercent keeps collections from running back to back on a huge heap.
const MinPercent = 40

// Percent is the GOGC that gives headroom bytes over live bytes, within
// [MinPercent, 100].
func Percent(live, headroom uint64) int {
	if live <= headroom {
		return 100
	}
	return max(MinPercent, int(headroom*100/live))
}

const liveMetric = "/gc/heap/live:bytes"

// Start paces the collector for headroom bytes until stop is called. A
// GOGC set in the environment is the user's choice and is left alone.
func Start(headroom uint64, log *slog.Logger) (stop func()) {
	if v, ok := os.LookupEnv("GOGC"); ok {
		log.Debug("gc: GOGC is set; not pacing the collector", "GOGC", v)
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		sample := []metrics.Sample{{Name: liveMetric}}
		last := 100
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			metrics.Read(sample)
			if sample[0].Value.Kind() != metrics.KindUint64 {
				return // a runtime without the metric: keep its default
			}
			if p := Percent(sample[0].Value.Uint64(), headroom); p != last {
				debug.SetGCPercent(p)
				last = p
			}
		}
	}()
	return func() { close(done) }
}
