package mount

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync/atomic"

	"mrfs/internal/config"
	"mrfs/publish"
	"mrfs/remote/gate"
	"mrfs/remote/server"
)

// rdmaListener is a bound rdma_cm listener (rdmacm.Listener).
type rdmaListener interface {
	io.Closer
	Addr() netip.AddrPort
	Reach() map[string]netip.AddrPort
	CloseDevice(name string) int
}

// listenFunc binds the rdma_cm listener: listenRDMA, or a fake in tests.
type listenFunc func(addr string, p gate.Policy, resolve gate.Resolver, log *slog.Logger) (rdmaListener, error)

// remoteAccess is the [remote] transport of one mount. It is bound and
// serving before the mount (so a busy port fails before anything is
// mounted, and port 0 is known for the user.mrfs.remote xattr); until
// the mount's tree is given to Serve, peers are refused with EAGAIN.
type remoteAccess struct {
	cfg     config.Remote
	log     *slog.Logger
	pending gate.Pending
	where   atomic.Pointer[string]
	closer  io.Closer
	rdma    rdmaListener // the rdma_cm listener, or nil
}

// policy is [remote] as the transports apply it, reporting to ev.
func policy(cfg config.Remote, ev gate.Events) gate.Policy {
	return gate.Policy{
		AllowFrom:    cfg.AllowFrom,
		MaxConns:     cfg.MaxConnections,
		FailLimit:    failLimit(cfg.MaxFailures),
		FailPrefixV4: cfg.FailurePrefixV4,
		FailPrefixV6: cfg.FailurePrefixV6,
		MaxMessage:   uint32(cfg.MaxMessageSize),
		Timeout:      cfg.Timeout,
		Events:       ev,
	}
}

// bindRemote binds [remote] for backend, reporting to ev (nil: nowhere);
// nil when remote.listen is off.
func bindRemote(cfg config.Remote, backend string, ev gate.Events, log *slog.Logger) (*remoteAccess, error) {
	return bindRemoteWith(cfg, backend, ev, log, listenRDMA)
}

func bindRemoteWith(cfg config.Remote, backend string, ev gate.Events, log *slog.Logger, listen listenFunc) (*remoteAccess, error) {
	if cfg.Listen == "" {
		return nil, nil
	}
	r := &remoteAccess{cfg: cfg, log: log}
	var where string
	switch backend {
	case config.BackendSoft:
		ln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("remote.listen %q: %w", cfg.Listen, err)
		}
		r.closer = server.Serve(ln, policy(cfg, ev), r.pending.Resolve, log)
		where = "tcp " + ln.Addr().String()
	case config.BackendRDMA:
		l, err := listen(cfg.Listen, policy(cfg, ev), r.pending.Resolve, log)
		if err != nil {
			return nil, fmt.Errorf("remote access over rdma_cm on %s: %w", cfg.Listen, err)
		}
		r.closer, r.rdma = l, l
		where = "rdma_cm " + l.Addr().String()
	default:
		return nil, fmt.Errorf("remote access: unknown backend %q", backend)
	}
	r.where.Store(&where)
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

// Published is where peers connect, as etcd says it: user.mrfs.remote's
// transport and address, except that an rdma_cm listener bound to the
// unspecified address (every device) gives the address of primary (the
// first device), which a peer can reach; and where each device is
// reached, for desc's devices.
func (r *remoteAccess) Published(primary string) publish.Where {
	w := publish.Where{Listen: r.Where()}
	if r == nil || r.rdma == nil || w.Listen == "" {
		return w
	}
	reach := r.rdma.Reach()
	w.Devices = make(map[string]string, len(reach))
	for dev, ap := range reach {
		w.Devices[dev] = "rdma_cm " + ap.String()
	}
	if ap, ok := reach[primary]; ok && r.rdma.Addr().Addr().IsUnspecified() {
		w.Listen = "rdma_cm " + ap.String()
	}
	return w
}

// CloseDevice closes the rdma_cm connections that came through the
// named device, and returns how many.
func (r *remoteAccess) CloseDevice(name string) int {
	if r == nil || r.rdma == nil {
		return 0
	}
	return r.rdma.CloseDevice(name)
}

// Serve lets peers in: resolve maps the directory a peer names to its
// PD. A nil r (remote access off) does nothing.
func (r *remoteAccess) Serve(resolve gate.Resolver) {
	if r == nil {
		return
	}
	r.pending.Set(resolve)
	r.log.Info("remote access on", "transport", r.Where(), "allow_from", r.cfg.AllowFrom,
		"max_connections", r.cfg.MaxConnections, "max_message_size", r.cfg.MaxMessageSize.String())
}

// Close stops accepting and ends every peer's connection (before the
// PDs go).
func (r *remoteAccess) Close() error {
	if r == nil {
		return nil
	}
	r.where.Store(nil)
	if err := r.closer.Close(); err != nil {
		return fmt.Errorf("stop remote access: %w", err)
	}
	return nil
}

// remoteSockets is how many sockets peers may make the daemon hold: the
// accepted connections and those still saying hello.
func remoteSockets(cfg config.Remote) int { return cfg.MaxConnections + gate.DefaultMaxPending }

// failLimit is remote.max_failures as the gate takes it: 0 turns the
// rule off.
func failLimit(maxFailures int) int {
	if maxFailures == 0 {
		return -1
	}
	return maxFailures
}
