package cli

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"

	"mrfs/buffer"
	"mrfs/internal/config"
	"mrfs/remote/server"
)

// rdmaRemote serves [remote] over rdma_cm on the rdma backend: it listens
// on cfg.Listen, resolves each peer's directory with resolve, and returns
// the listener: its address (the real port when cfg.Listen has port 0)
// and what stops it (closing every peer's queue pair). nil when the
// binary is built without it; internal/cli/remote_rdma.go (build tag
// rdma) sets it. A mount whose backend is rdma and whose remote.listen is
// set fails when it is nil rather than silently serving nothing.
var rdmaRemote func(cfg config.Remote, resolve func(dir string) (*buffer.Domain, error), log *slog.Logger) (rdmaListener, error)

// rdmaListener is a bound rdma_cm listener (rdmacm.Listener).
type rdmaListener interface {
	io.Closer
	Addr() netip.AddrPort
}

var errNoRDMARemote = errors.New("remote.listen is set but this binary has no rdma_cm transport for the rdma backend: rebuild with `go build -tags rdma ./cmd/mrfs`, or use the soft backend")

// remoteAccess is the [remote] transport of one mount. It is bound before
// the mount (so a busy port fails before anything is mounted, and port 0
// is known for the user.mrfs.remote xattr) and serves after it.
type remoteAccess struct {
	cfg     config.Remote
	backend string
	log     *slog.Logger
	ln      net.Listener // soft: bound by bindRemote
	where   atomic.Pointer[string]
	closer  io.Closer
	// resolver is the mount's directory lookup, set by start: the
	// rdma_cm listener is bound, and so may hear a peer, before it.
	resolver atomic.Pointer[func(dir string) (*buffer.Domain, error)]
}

// resolve is the rdma_cm listener's lookup: refused until mounted.
func (r *remoteAccess) resolve(dir string) (*buffer.Domain, error) {
	f := r.resolver.Load()
	if f == nil {
		return nil, fmt.Errorf("mrfs is still mounting: %w", syscall.EAGAIN)
	}
	return (*f)(dir)
}

// bindRemote prepares [remote] for backend; nil when remote.listen is off.
func bindRemote(cfg config.Remote, backend string, log *slog.Logger) (*remoteAccess, error) {
	if cfg.Listen == "" {
		return nil, nil
	}
	r := &remoteAccess{cfg: cfg, backend: backend, log: log}
	switch backend {
	case config.BackendSoft:
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("remote.listen %q: %w", cfg.Listen, err)
		}
		r.ln = ln
		// Shown from the mount on: a peer that connects before start
		// waits in the listen backlog, it is not refused.
		where := "tcp " + ln.Addr().String()
		r.where.Store(&where)
	case config.BackendRDMA:
		if rdmaRemote == nil {
			return nil, errNoRDMARemote
		}
		l, err := rdmaRemote(cfg, r.resolve, log)
		if err != nil {
			return nil, fmt.Errorf("remote access over rdma_cm on %s: %w", cfg.Listen, err)
		}
		r.closer = l
		where := "rdma_cm " + l.Addr().String()
		r.where.Store(&where)
	default:
		return nil, fmt.Errorf("remote access: unknown backend %q", backend)
	}
	return r, nil
}

// Where is user.mrfs.remote's transport and address; "" while off.
func (r *remoteAccess) Where() string {
	if r == nil {
		return ""
	}
	if w := r.where.Load(); w != nil {
		return *w
	}
	return ""
}

// start serves peers; resolve maps a hello's directory to its PD. A nil
// r (remote access off) does nothing.
func (r *remoteAccess) start(resolve func(dir string) (*buffer.Domain, error)) error {
	if r == nil {
		return nil
	}
	switch r.backend {
	case config.BackendSoft:
		s := server.New(r.ln, server.Options{
			AllowFrom:  r.cfg.AllowFrom,
			MaxConns:   r.cfg.MaxConnections,
			MaxMessage: uint32(r.cfg.MaxMessageSize),
			Timeout:    r.cfg.Timeout,
			Log:        r.log,
		})
		s.Start(resolve)
		r.closer = s
	default:
		r.resolver.Store(&resolve)
	}
	r.log.Info("remote access on", "transport", r.Where(), "allow_from", r.cfg.AllowFrom,
		"max_connections", r.cfg.MaxConnections, "max_message_size", r.cfg.MaxMessageSize.String())
	return nil
}

// Close stops accepting and ends every peer's connection (before the
// PDs go). A transport never started only gives its port back.
func (r *remoteAccess) Close() error {
	if r == nil {
		return nil
	}
	r.where.Store(nil)
	if r.closer != nil {
		if err := r.closer.Close(); err != nil {
			return fmt.Errorf("stop remote access: %w", err)
		}
		return nil
	}
	if r.ln != nil {
		r.ln.Close()
	}
	return nil
}
