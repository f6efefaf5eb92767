package tests

import (
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"
)

// BenchmarkStatDuringRegistration: the latency of stat and ls of another
// directory while a 1 GiB registration runs (slowed per chunk by the test
// hook so that it lasts seconds) and an rm of that buffer waits for it,
// against the same calls at rest on the same mount. Two registrations, as
// in TestNoStallDuringRegistration: a truncate, and the flush at the close
// of a zero-copy write past the end (where the rm reaches the daemon).
// Issue 19's goal: under 100 ms, where an unlink held the namespace for
// the whole registration. Reported: the median and worst latencies during
// the registration, and the ratio of the worst to the worst at rest.
//
//	go test -run '^$' -bench StatDuringRegistration -benchtime 3x ./tests
func BenchmarkStatDuringRegistration(b *testing.B) {
	for _, way := range []string{"truncate", "flush"} {
		b.Run(way, func(b *testing.B) { statDuringRegistration(b, way) })
	}
}

func statDuringRegistration(b *testing.B, way string) {
	d := startDaemon(b, daemonConfig{Quiet: true, Buffers: "populate_threshold = \"16MiB\"", Env: []string{"MRFS_TEST_CHUNK_DELAY=100ms"}, Hang: 10 * time.Minute})
	for _, dir := range []string{"a", "b"} {
		if err := os.Mkdir(d.path(dir), 0o755); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 100 {
		makeBuffer(b, d.path("b", strconv.Itoa(i)), 4096)
	}
	// one is a stat of a name not there (a LOOKUP) and an ls of b.
	one := func(i int) time.Duration {
		start := time.Now()
		os.Stat(d.path("b", "new"+strconv.Itoa(i)))
		if ents, err := os.ReadDir(d.path("b")); err != nil || len(ents) != 100 {
			b.Fatalf("ls: %d, %v", len(ents), err)
		}
		return time.Since(start)
	}
	var rest, during []time.Duration
	b.ResetTimer()
	for round := range b.N {
		for i := range 50 {
			rest = append(rest, one(round*1000+i))
		}
		big := d.path("a", "big")
		makeBuffer(b, big, 0)
		grown, _ := growBig(b, big, 1<<30, way)
		waitRegistering(b, big, 1<<30, grown)
		removed := started(b, exec.Command("rm", big))
		time.Sleep(100 * time.Millisecond)
		for i := 0; ; i++ {
			select {
			case <-removed:
			default:
				during = append(during, one(round*1000+500+i))
				time.Sleep(10 * time.Millisecond)
				continue
			}
			break
		}
		<-grown
	}
	b.StopTimer()
	slices.Sort(rest)
	slices.Sort(during)
	if len(during) == 0 {
		b.Fatal("no call ran during a registration")
	}
	b.ReportMetric(float64(during[len(during)/2].Microseconds())/1000, "ms-median-during")
	b.ReportMetric(float64(during[len(during)-1].Microseconds())/1000, "ms-max-during")
	b.ReportMetric(float64(rest[len(rest)-1].Microseconds())/1000, "ms-max-at-rest")
	b.ReportMetric(float64(during[len(during)-1])/float64(rest[len(rest)-1]), "ratio-max")
	b.Logf("%d calls during registrations: median %v, max %v; at rest: median %v, max %v",
		len(during), during[len(during)/2], during[len(during)-1], rest[len(rest)/2], rest[len(rest)-1])
}
