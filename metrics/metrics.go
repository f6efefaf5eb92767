// Package metrics serves mrfs's Prometheus metrics ([metrics] listen):
// what buffer.Manager holds (buffers, registered and pinned bytes, also
// per uid, the backing store, open files, the limits) read at every
// scrape, and what happens (registrations, deregistrations, their
// latency, limit hits by limit, remote connections and completions by
// status) counted as it happens. It implements buffer.Events and
// gate.Events for that.
package metrics

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"mrfs/buffer"
	"mrfs/remote/gate"
	"mrfs/verbs"
)

// Metrics is one mount's metrics.
type Metrics struct {
	reg *prometheus.Registry

	registrations   prometheus.Counter
	deregistrations prometheus.Counter
	regSeconds      prometheus.Histogram
	limitHits       *prometheus.CounterVec
	connections     prometheus.Gauge
	admitted        prometheus.Counter
	refused         *prometheus.CounterVec
	completions     *prometheus.CounterVec
}

var (
	_ buffer.Events = (*Metrics)(nil)
	_ gate.Events   = (*Metrics)(nil)
)

// New makes the metrics; Watch adds a manager's state, Serve serves them.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		registrations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mrfs_registrations_total", Help: "Memory regions registered."}),
		deregistrations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mrfs_deregistrations_total", Help: "Memory regions deregistered."}),
		regSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mrfs_registration_seconds", Help: "Time to register one memory region (pinning included).",
			Buckets: prometheus.ExponentialBuckets(10e-6, 4, 12), // 10 us to about 42 s
		}),
		limitHits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mrfs_limit_hits_total", Help: "Calls refused by a limit, by limit."}, []string{"limit"}),
		connections: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mrfs_remote_connections", Help: "Remote peers connected now."}),
		admitted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mrfs_remote_connections_total", Help: "Remote peers admitted."}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mrfs_remote_refused_total", Help: "Remote peers refused, by reason."}, []string{"reason"}),
		completions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mrfs_remote_completions_total", Help: "One-sided operations of remote peers by work completion status (soft transport; over rdma_cm the NIC completes them)."}, []string{"status"}),
	}
	m.reg.MustRegister(m.registrations, m.deregistrations, m.regSeconds, m.limitHits,
		m.connections, m.admitted, m.refused, m.completions,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registered is buffer.Events.
func (m *Metrics) Registered(n uint64, took time.Duration) {
	m.registrations.Inc()
	m.regSeconds.Observe(took.Seconds())
}

// Deregistered is buffer.Events.
func (m *Metrics) Deregistered(n uint64) { m.deregistrations.Inc() }

// Changed is buffer.Events: what changed is counted above.
func (m *Metrics) Changed(*buffer.Buffer) {}

// LimitHit is buffer.Events.
func (m *Metrics) LimitHit(limit string) { m.limitHits.WithLabelValues(limit).Inc() }

// Admitted is gate.Events.
func (m *Metrics) Admitted() {
	m.admitted.Inc()
	m.connections.Inc()
}

// Released is gate.Events.
func (m *Metrics) Released() { m.connections.Dec() }

// Refused is gate.Events.
func (m *Metrics) Refused(reason string) { m.refused.WithLabelValues(reason).Inc() }

// Completed is gate.Events.
func (m *Metrics) Completed(st verbs.WCStatus) { m.completions.WithLabelValues(st.String()).Inc() }

// Watch reports mgr's state at every scrape.
func (m *Metrics) Watch(mgr *buffer.Manager) { m.reg.MustRegister(&state{mgr: mgr}) }

// Serve listens on addr and serves /metrics until the returned server is
// closed. Binding happens now, so that a busy address fails the mount
// before anything is mounted.
func (m *Metrics) Serve(addr string, log *slog.Logger) (*http.Server, net.Addr, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("metrics.listen %q: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", "err", err)
		}
	}()
	log.Info("metrics on", "url", "http://"+ln.Addr().String()+"/metrics")
	return srv, ln.Addr(), nil
}

// state is a collector of a manager's totals, read at scrape time.
type state struct{ mgr *buffer.Manager }

var (
	descBuffers     = prometheus.NewDesc("mrfs_buffers", "Buffers (files) of the mount.", nil, nil)
	descPDs         = prometheus.NewDesc("mrfs_pds", "Protection domains (directories) of the mount.", nil, nil)
	descRegistered  = prometheus.NewDesc("mrfs_registered_bytes", "Bytes registered.", nil, nil)
	descPinned      = prometheus.NewDesc("mrfs_pinned_bytes", "Bytes pinned: the registered bytes in whole pages.", nil, nil)
	descUserBuffers = prometheus.NewDesc("mrfs_user_buffers", "Buffers owned by a uid.", []string{"uid"}, nil)
	descUserPinned  = prometheus.NewDesc("mrfs_user_pinned_bytes", "Bytes pinned for the buffers a uid owns.", []string{"uid"}, nil)
	descStore       = prometheus.NewDesc("mrfs_store_bytes", "Bytes of memory the backing store's files hold.", []string{"store"}, nil)
	descOpen        = prometheus.NewDesc("mrfs_open_files", "Clients' open descriptors of buffers.", nil, nil)
	descCharged     = prometheus.NewDesc("mrfs_charged_bytes", "Store memory charged to owners: what max_pinned bounds.", nil, nil)
	descUserCharged = prometheus.NewDesc("mrfs_user_charged_bytes", "Store memory charged to a uid: what max_pinned_per_user bounds.", []string{"uid"}, nil)
	descUnlinked    = prometheus.NewDesc("mrfs_open_unlinked_files", "Files unlinked while clients still hold them open: their memory is charged until released.", nil, nil)
	descMappings    = prometheus.NewDesc("mrfs_mappings", "The daemon's memory mappings (each registered buffer is one), against vm.max_map_count.", nil, nil)
	descPoolSlots   = prometheus.NewDesc("mrfs_pool_slots", "Slots of a pool (by its PD number), used by files or free.", []string{"pd", "state"}, nil)
	descLimit       = prometheus.NewDesc("mrfs_limit", "Configured limits (0: none): bytes for max_pinned and max_pinned_per_user, counts for max_buffers, open_files and max_map_count.", []string{"limit"}, nil)
)

func (s *state) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descBuffers, descPDs, descRegistered, descPinned, descUserBuffers, descUserPinned, descStore, descOpen, descLimit,
		descCharged, descUserCharged, descUnlinked, descMappings, descPoolSlots} {
		ch <- d
	}
}

func (s *state) Collect(ch chan<- prometheus.Metric) {
	st := s.mgr.Stats()
	opt := s.mgr.Options()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(descBuffers, float64(st.Buffers))
	gauge(descPDs, float64(st.PDs))
	gauge(descRegistered, float64(st.RegisteredBytes))
	gauge(descPinned, float64(st.PinnedBytes))
	for uid, u := range st.Users {
		id := strconv.FormatUint(uint64(uid), 10)
		gauge(descUserBuffers, float64(u.Buffers), id)
		gauge(descUserPinned, float64(u.PinnedBytes), id)
		gauge(descUserCharged, float64(u.Charged), id)
	}
	gauge(descCharged, float64(st.ChargedBytes))
	gauge(descUnlinked, float64(st.Orphans))
	gauge(descMappings, float64(st.Maps))
	gauge(descStore, float64(st.StoreUsed), st.Store)
	gauge(descOpen, float64(st.OpenFds))
	for pd, p := range s.mgr.Pools() {
		in := p.Info()
		id := strconv.FormatUint(uint64(pd), 10)
		gauge(descPoolSlots, float64(in.Used), id, "used")
		gauge(descPoolSlots, float64(in.Slots-in.Used), id, "free")
	}
	gauge(descLimit, float64(opt.MaxPinned), "max_pinned")
	gauge(descLimit, float64(opt.MaxPinnedPerUser), "max_pinned_per_user")
	gauge(descLimit, float64(opt.MaxBuffers), "max_buffers")
	gauge(descLimit, float64(st.MaxOpenFds), "open_files")
	gauge(descLimit, float64(st.MaxMaps), "max_map_count")
}
