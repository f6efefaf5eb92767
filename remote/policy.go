package remote

import (
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"mrfs/buffer"
	"mrfs/verbs"
)

// Policy is [remote]: who may connect, and what a connection may do.
// Every transport applies it through a Gate.
type Policy struct {
	// AllowFrom are the networks peers may connect from; empty admits
	// nobody.
	AllowFrom []netip.Prefix
	// MaxConns bounds the connections at once (at least 1).
	MaxConns int
	// MaxMessage is the largest READ or WRITE, and Timeout bounds a hello,
	// a started frame and each reply. The soft transport enforces both;
	// over rdma_cm the NIC's own limits apply.
	MaxMessage uint32
	Timeout    time.Duration
	// Events hears of admissions and completions (metrics); nil: none.
	Events Events
	// FailLimit failures of one source network within FailWindow get it
	// refused for FailBlock (failures.go); 0: 10, a minute, a minute. A
	// negative FailLimit turns the rule off. A source network is an
	// address cut to FailPrefixV4 or FailPrefixV6 bits (0: 24 and 64).
	FailLimit                  int
	FailWindow, FailBlock      time.Duration
	FailPrefixV4, FailPrefixV6 int
}

// Events are what the transports report as it happens. Implementations
// must be safe for concurrent use and must not block.
type Events interface {
	// Admitted: a connection got a slot; Released: it gave it back.
	Admitted()
	Released()
	// Refused: a connection was refused, by reason ("allow_from",
	// "max_connections", "shutdown").
	Refused(reason string)
	// Completed: an operation completed with st. Only the soft transport
	// sees completions; over rdma_cm the NIC completes them.
	Completed(st verbs.WCStatus)
}

type noEvents struct{}

func (noEvents) Admitted()                {}
func (noEvents) Released()                {}
func (noEvents) Refused(string)           {}
func (noEvents) Completed(verbs.WCStatus) {}

// Allows reports whether a peer at addr is in AllowFrom.
func (p Policy) Allows(addr netip.Addr) bool {
	addr = addr.Unmap()
	for _, n := range p.AllowFrom {
		if n.Contains(addr) {
			return true
		}
	}
	return false
}

// Gate admits connections to one listener by its Policy and counts them.
type Gate struct {
	p     Policy
	log   *PeerLog
	ev    Events
	fails *failures

	mu     sync.Mutex // guards: conns, closed
	conns  int
	closed bool
}

// NewGate applies p; refusals are logged to log (rate-limited, PeerLog).
func NewGate(p Policy, log *slog.Logger) *Gate {
	ev := p.Events
	if ev == nil {
		ev = noEvents{}
	}
	return &Gate{p: p, log: NewPeerLog(log), ev: ev, fails: newFailures(p)}
}

// Events is where the gate's transport reports (never nil).
func (g *Gate) Events() Events { return g.ev }

// Policy is the gate's policy.
func (g *Gate) Policy() Policy { return g.p }

// Log is the gate's rate-limited log of peer-caused events.
func (g *Gate) Log() *PeerLog { return g.log }

// Admit decides whether a new connection from peer may proceed, in the
// order every transport applies: allow_from (EACCES), shutting down
// (ESHUTDOWN), max_connections (EBUSY). It is called before anything of the
// peer's is read or allocated. On success the connection holds a slot
// until it calls release (once); the error wraps the errno to tell the
// peer.
func (g *Gate) Admit(peer netip.Addr) (release func(), err error) {
	if !g.p.Allows(peer) {
		g.ev.Refused("allow_from")
		g.log.Event("allow_from", "remote: peer not in allow_from; refused", "peer", peer.String())
		return nil, fmt.Errorf("peer %s is not in remote.allow_from: %w", peer, syscall.EACCES)
	}
	if v := g.fails.refused(peer, time.Now()); v.refused {
		g.ev.Refused("failures")
		g.warn(v, peer, "")
		if v.full {
			return nil, fmt.Errorf("peer %s: too many failing networks to count %s too; refused for a while: %w", peer, v.net, syscall.EACCES)
		}
		return nil, fmt.Errorf("peer %s: too many failed attempts from %s; refused for a while: %w", peer, v.net, syscall.EACCES)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.closed:
		g.ev.Refused("shutdown")
		return nil, fmt.Errorf("mrfs is shutting down: %w", syscall.ESHUTDOWN)
	case g.conns >= g.p.MaxConns:
		g.ev.Refused("max_connections")
		g.log.Event("max_connections", "remote: max_connections reached; peer refused", "peer", peer.String(), "max_connections", g.p.MaxConns)
		return nil, fmt.Errorf("too many connections (max_connections = %d): %w", g.p.MaxConns, syscall.EBUSY)
	}
	g.conns++
	g.ev.Admitted()
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			g.conns--
			g.mu.Unlock()
			g.ev.Released()
		})
	}, nil
}

// Failed counts a failure of peer's source network (why: "token",
// "access", "directory", "hello", "hello_timeout", "pending"); one that
// keeps failing is refused for a while (failures.go).
func (g *Gate) Failed(peer netip.Addr, why string) {
	v := g.fails.failed(peer, time.Now())
	g.warn(v, peer, why)
	if !v.refused {
		g.log.Event("failed_"+why, "remote: a peer's attempt failed", "peer", peer.String(), "why", why)
	}
}

// warn says at warn that a source network is refused, when v says to
// (once a minute per network, or per full table).
func (g *Gate) warn(v verdict, peer netip.Addr, why string) {
	if !v.warn {
		return
	}
	args := []any{"peer", peer.String(), "network", v.net.String()}
	if why != "" {
		args = append(args, "last", why)
	}
	if v.full {
		g.log.log.Warn("remote: too many failing networks to remember; refusing networks the table has no room for", args...)
		return
	}
	g.log.log.Warn("remote: refusing a source whose attempts keep failing", args...)
}

// Resolve finds the PD of the directory peer names with resolve. A
// directory that is not there (ENOENT, ENOTDIR, what the peer is told)
// counts as a failure of the peer's source: names are probed no faster
// than tokens are guessed. The error wraps the errno to tell the peer.
func (g *Gate) Resolve(peer netip.Addr, resolve Resolver, dir string) (*buffer.Domain, error) {
	dom, err := resolve(dir)
	if err == nil {
		return dom, nil
	}
	if e := Errno(err, syscall.ENOENT); e == syscall.ENOENT || e == syscall.ENOTDIR {
		g.Failed(peer, "directory")
	}
	return nil, fmt.Errorf("directory %q: %w", dir, err)
}

// CheckToken admits peer to dom only with dom's token: otherwise the
// peer is refused with EACCES, before any queue pair exists, and the
// failure counts against its source.
func (g *Gate) CheckToken(peer netip.Addr, dir string, dom *buffer.Domain, token [buffer.TokenSize]byte) error {
	if dom.TokenIs(token) {
		return nil
	}
	g.ev.Refused("token")
	g.Failed(peer, "token")
	return fmt.Errorf("wrong token for %q (user.mrfs.token of the directory): %w", dir, syscall.EACCES)
}

// Conns is the number of admitted connections not yet released.
func (g *Gate) Conns() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.conns
}

// Close refuses every later Admit (ESHUTDOWN).
func (g *Gate) Close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// PeerLog logs events a peer can cause at will (a refusal, a failed
// hello, a protocol error): the first of a kind within a minute at Info,
// the rest at Debug, so that a flood of sockets cannot flood the log.
type PeerLog struct {
	log *slog.Logger

	mu     sync.Mutex           // guards: logged
	logged map[string]time.Time // when a kind was last logged at Info
}

// peerLogEvery bounds how often one kind of event is logged at Info.
const peerLogEvery = time.Minute

// NewPeerLog logs to log; nil discards.
func NewPeerLog(log *slog.Logger) *PeerLog {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &PeerLog{log: log, logged: map[string]time.Time{}}
}

// Event logs msg under kind, rate-limited.
func (l *PeerLog) Event(kind, msg string, args ...any) { l.EventTo(l.log, kind, msg, args...) }

// EventTo is Event on another logger (one carrying the peer's fields),
// rate-limited with the same kinds.
func (l *PeerLog) EventTo(log *slog.Logger, kind, msg string, args ...any) {
	now := time.Now()
	l.mu.Lock()
	last, seen := l.logged[kind]
	info := !seen || now.Sub(last) >= peerLogEvery
	if info {
		l.logged[kind] = now
	}
	l.mu.Unlock()
	if info {
		log.Info(msg, args...)
	} else {
		log.Debug(msg, args...)
	}
}
