package cli

import (
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"mrfs/buffer"
	"mrfs/fs"
	"mrfs/internal/config"
	"mrfs/publish"
	"mrfs/tree"
)

// publishing is the mount's [publish]: it hears of registrations and
// deregistrations (passing them on to the metrics) and tells the
// publisher, which then reconciles at once (an access removed, a file
// removed: its key goes). Until the publisher starts, and without
// [publish], it only passes them on.
type publishing struct {
	next buffer.Events // the metrics', or nil
	p    atomic.Pointer[publish.Publisher]
}

var _ buffer.Events = (*publishing)(nil)

func (e *publishing) Registered(n uint64, took time.Duration) {
	if e.next != nil {
		e.next.Registered(n, took)
	}
	e.poke()
}

func (e *publishing) Deregistered(n uint64) {
	if e.next != nil {
		e.next.Deregistered(n)
	}
	e.poke()
}

func (e *publishing) Slot(taken bool) {
	if e.next != nil {
		e.next.Slot(taken)
	}
	e.poke()
}

func (e *publishing) LimitHit(limit string) {
	if e.next != nil {
		e.next.LimitHit(limit)
	}
}

func (e *publishing) poke() {
	if p := e.p.Load(); p != nil {
		p.Poke()
	}
}

// start starts publishing tr to etcd when [publish] has endpoints.
func (e *publishing) start(cfg config.Publish, tr *tree.Tree, where func() string, log *slog.Logger) error {
	if len(cfg.Endpoints) == 0 {
		return nil
	}
	host, err := os.Hostname()
	if err != nil {
		return err
	}
	mgr := tr.Manager()
	p, err := publish.Start(publish.Options{
		Endpoints: cfg.Endpoints, Prefix: cfg.Prefix, Lease: cfg.Lease, Host: host,
		Listen: where, Tree: tr, Log: log,
		Describe: func(b *buffer.Buffer) ([]byte, buffer.Info, bool) { return fs.Desc(mgr, b) },
	})
	if err != nil {
		return err
	}
	e.p.Store(p)
	log.Info("publishing to etcd", "endpoints", cfg.Endpoints, "prefix", cfg.Prefix, "host", host, "lease", cfg.Lease)
	return nil
}

// close stops publishing: the lease is revoked, every key goes.
func (e *publishing) close() error {
	if p := e.p.Swap(nil); p != nil {
		return p.Close()
	}
	return nil
}
