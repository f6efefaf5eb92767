package mount

import (
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"mrfs/buffer"
	"mrfs/desc"
	"mrfs/internal/config"
	"mrfs/publish"
	"mrfs/tree"
)

// publishing is the mount's [publish]: it passes the buffers' events on
// to the metrics and tells the publisher which buffer (Changed) or which
// node of the tree (changed: tree.Options.Changed) changed. Until the
// publisher starts, and without [publish], it only passes the events on.
type publishing struct {
	next buffer.Events // the metrics', or nil
	p    atomic.Pointer[publish.Publisher]
}

var _ buffer.Events = (*publishing)(nil)

func (e *publishing) Registered(n uint64, took time.Duration) {
	if e.next != nil {
		e.next.Registered(n, took)
	}
}

func (e *publishing) Deregistered(n uint64) {
	if e.next != nil {
		e.next.Deregistered(n)
	}
}

func (e *publishing) Changed(b *buffer.Buffer) {
	if e.next != nil {
		e.next.Changed(b)
	}
	if p := e.p.Load(); p != nil {
		p.ChangedBuffer(b)
	}
}

func (e *publishing) LimitHit(limit string) {
	if e.next != nil {
		e.next.LimitHit(limit)
	}
}

// changed is tree.Options.Changed.
func (e *publishing) changed(n tree.Node) {
	if p := e.p.Load(); p != nil {
		p.Changed(n)
	}
}

// start starts publishing tr to etcd when [publish] has endpoints.
func (e *publishing) start(cfg config.Publish, tr *tree.Tree, mountpoint string, where func() publish.Where, log *slog.Logger) error {
	if len(cfg.Endpoints) == 0 {
		return nil
	}
	host, err := os.Hostname()
	if err != nil {
		return err
	}
	name := cfg.Name
	if name == "" {
		name = strings.Trim(mountpoint, "/")
	}
	mgr := tr.Manager()
	p, err := publish.Start(publish.Options{
		Endpoints: cfg.Endpoints, Prefix: cfg.Prefix, Lease: cfg.Lease, Host: host, Mount: name,
		Listen: where, Tree: tr, Log: log, Delay: testDelay(log, publishDelayEnv, "each publication pass waits before it writes"),
		Describe: func(b *buffer.Buffer) (desc.Desc, buffer.Info, bool) { return desc.Buffer(mgr, b, "") },
	})
	if err != nil {
		return err
	}
	e.p.Store(p)
	log.Info("publishing to etcd", "endpoints", cfg.Endpoints, "prefix", cfg.Prefix, "host", host, "name", name, "lease", cfg.Lease)
	return nil
}

// close stops publishing: the lease is revoked, every key goes.
func (e *publishing) close() error {
	if p := e.p.Swap(nil); p != nil {
		return p.Close()
	}
	return nil
}
