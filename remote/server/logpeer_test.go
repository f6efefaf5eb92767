package server

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

// A peer can cause refusals as fast as it opens sockets: only the first
// of a kind within peerLogEvery is logged at Info.
func TestLogPeerRateLimited(t *testing.T) {
	var out bytes.Buffer
	log := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s := &Server{}
	for range 100 {
		s.logPeer(log, "allow_from", "refused")
	}
	s.logPeer(log, "hello", "hello failed")
	text := out.String()
	if n := strings.Count(text, "level=INFO msg=refused"); n != 1 {
		t.Errorf("%d refusals at Info, want 1", n)
	}
	if n := strings.Count(text, "level=DEBUG msg=refused"); n != 99 {
		t.Errorf("%d refusals at Debug, want 99", n)
	}
	if !strings.Contains(text, "level=INFO msg=\"hello failed\"") {
		t.Error("another kind is not rate-limited by the first")
	}
}
