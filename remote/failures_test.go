package remote

import (
	"bytes"
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A source that fails FailLimit times within the window is refused for
// FailBlock, with one warn line a minute naming it; other sources are
// not; once the block ends it is admitted again.
func TestGateRefusesASourceThatKeepsFailing(t *testing.T) {
	var log bytes.Buffer
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MaxConns: 8,
		FailLimit: 3, FailBlock: 300 * time.Millisecond}, slog.New(slog.NewTextHandler(&log, nil)))
	bad, good := netip.MustParseAddr("10.0.0.9"), netip.MustParseAddr("10.0.0.10")
	admit := func(peer netip.Addr) error {
		release, err := g.Admit(peer)
		if err == nil {
			release()
		}
		return err
	}
	for i := range 2 {
		g.Failed(bad, "token")
		if err := admit(bad); err != nil {
			t.Fatalf("after %d failures: %v", i+1, err)
		}
	}
	g.Failed(bad, "token")
	blocked := time.Now()
	for range 3 {
		if err := admit(bad); !errors.Is(err, syscall.EACCES) {
			t.Fatalf("after 3 failures: %v, want EACCES", err)
		}
	}
	if err := admit(good); err != nil {
		t.Errorf("another source: %v", err)
	}
	if n := strings.Count(log.String(), "level=WARN"); n != 1 || !strings.Contains(log.String(), "peer=10.0.0.9") {
		t.Errorf("want one warn line naming 10.0.0.9, got:\n%s", log.String())
	}
	time.Sleep(time.Until(blocked.Add(300 * time.Millisecond)))
	if err := admit(bad); err != nil {
		t.Errorf("after the block: %v", err)
	}
}

// Failures older than the window do not add up.
func TestFailuresWindow(t *testing.T) {
	f := newFailures(Policy{FailLimit: 3, FailWindow: time.Minute})
	a := netip.MustParseAddr("10.0.0.1")
	t0 := time.Now()
	f.failed(a, t0)
	f.failed(a, t0.Add(30*time.Second))
	if refused, _ := f.failed(a, t0.Add(61*time.Second)); refused {
		t.Error("refused for failures spread over more than the window")
	}
	if refused, _ := f.failed(a, t0.Add(62*time.Second)); !refused {
		t.Error("not refused for 3 failures within the window")
	}
}
