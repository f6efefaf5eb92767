package gcpace

import (
	"log/slog"
	"runtime"
	"runtime/debug"
	"testing"
	"time"
)

func TestPercent(t *testing.T) {
	const mb = 1 << 20
	for _, c := range []struct {
		live, headroom uint64
		want           int
	}{
		{0, 64 * mb, 100},
		{64 * mb, 64 * mb, 100},          // up to the headroom: the runtime's default
		{128 * mb, 64 * mb, 50},          // twice the headroom: half
		{150 * mb, 64 * mb, 42},          // 64 MiB over 150 MiB
		{1024 * mb, 64 * mb, MinPercent}, // a million buffers: never below the floor
	} {
		if got := Percent(c.live, c.headroom); got != c.want {
			t.Errorf("Percent(%d MiB live, %d MiB) = %d, want %d", c.live/mb, c.headroom/mb, got, c.want)
		}
	}
}

// TestStartPaces: with 128 MiB live, Start brings GOGC down to give 64 MiB
// of headroom, and a GOGC in the environment is left alone.
func TestStartPaces(t *testing.T) {
	live := make([][]byte, 128)
	for i := range live {
		live[i] = make([]byte, 1<<20)
	}
	runtime.GC()
	log := slog.New(slog.DiscardHandler)
	current := func() int { p := debug.SetGCPercent(100); debug.SetGCPercent(p); return p }
	defer debug.SetGCPercent(current())

	t.Run("GOGC set", func(t *testing.T) {
		t.Setenv("GOGC", "100")
		stop := Start(Headroom, log)
		time.Sleep(2500 * time.Millisecond)
		stop()
		if p := current(); p != 100 {
			t.Errorf("GOGC is %d with GOGC=100 in the environment, want it left at 100", p)
		}
	})
	stop := Start(Headroom, log)
	defer stop()
	deadline := time.Now().Add(10 * time.Second)
	for current() == 100 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if p, want := current(), 50; p < want-5 || p > want+5 {
		t.Errorf("GOGC is %d with 128 MiB live, want about %d (64 MiB of headroom)", p, want)
	}
	runtime.KeepAlive(live)
}
