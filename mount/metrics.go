package mount

import (
	"log/slog"
	"net/http"

	"mrfs/buffer"
	"mrfs/internal/config"
	"mrfs/metrics"
	"mrfs/remote/gate"
)

// mountMetrics is [metrics] of one mount; a nil one (metrics.listen
// empty) does nothing.
type mountMetrics struct {
	m   *metrics.Metrics
	srv *http.Server
}

// startMetrics binds metrics.listen, before the mount, so that a busy
// address fails before anything is mounted.
func startMetrics(cfg config.Metrics, log *slog.Logger) (*mountMetrics, error) {
	if cfg.Listen == "" {
		return nil, nil
	}
	m := metrics.New()
	srv, _, err := m.Serve(cfg.Listen, log)
	if err != nil {
		return nil, err
	}
	return &mountMetrics{m: m, srv: srv}, nil
}

func (x *mountMetrics) bufferEvents() buffer.Events {
	if x == nil {
		return nil
	}
	return x.m
}

func (x *mountMetrics) remoteEvents() gate.Events {
	if x == nil {
		return nil
	}
	return x.m
}

func (x *mountMetrics) watch(mgr *buffer.Manager) {
	if x != nil {
		x.m.Watch(mgr)
	}
}

// Close stops serving.
func (x *mountMetrics) Close() {
	if x != nil {
		x.srv.Close()
	}
}
