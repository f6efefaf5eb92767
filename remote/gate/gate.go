// Package gate is what every remote listener enforces, in one place so
// that the transports cannot disagree: the admission policy ([remote]:
// Policy, applied by a Gate: allowed networks, connections, the hello
// phase, PD tokens), the rule against guessing (failures.go), the
// directory lookup (Resolver, Pending) and the peers' log lines
// (PeerLog). remote/server (soft) and remote/rdmacm (rdma_cm) apply it;
// package remote holds what a peer uses.
package gate

import (
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"mrfs/buffer"
	"mrfs/remote"
	"mrfs/verbs"
)

// Resolver maps the directory a peer names, relative to the mount's root
// ("/" is the root), to its protection domain (tree.Tree.Domain). Errors
// wrap an errno (ENOENT, ENOTDIR) that is reported to the peer.
type Resolver func(dir string) (*buffer.Domain, error)

// Pending is the Resolver of a transport bound before the mount exists
// (so that a busy port fails before anything is mounted): until Set, it
// refuses every peer with EAGAIN.
type Pending struct {
	r atomic.Pointer[Resolver]
}

// Set makes p answer with r from now on.
func (p *Pending) Set(r Resolver) { p.r.Store(&r) }

// Resolve is p as a Resolver.
func (p *Pending) Resolve(dir string) (*buffer.Domain, error) {
	r := p.r.Load()
	if r == nil {
		return nil, fmt.Errorf("mrfs is still mounting: %w", syscall.EAGAIN)
	}
	return (*r)(dir)
}

// Policy is [remote]: who may connect, and what a connection may do.
// Every transport applies it through a Gate.
type Policy struct {
	// AllowFrom are the networks peers may connect from; empty admits
	// nobody.
	AllowFrom []netip.Prefix
	// MaxConns bounds the connections at once whose hello and token were
	// accepted (at least 1).
	MaxConns int
	// MaxPending bounds the connections still saying hello (0: 128): past
	// it the oldest of those whose hello has not arrived is closed to make
	// room for the newest, which counts as a failure of its source. Apart
	// from max_connections, so that sockets that never say hello cannot
	// keep peers that do out.
	MaxPending int
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

// DefaultMaxPending is Policy.MaxPending's default: twice
// max_connections' default, so that a burst of peers connecting at once
// is not taken for idle sockets, and small enough that what pending
// connections hold (a socket, a goroutine and at most a hello-sized frame
// each) stays about 2 MiB.
const DefaultMaxPending = 128

// Gate admits connections to one listener by its Policy and counts them,
// in two phases, in the order every transport applies:
//
//  1. at connect, before anything of the peer's is read (Admit):
//     allow_from (EACCES), a source network refused after repeated
//     failures (EACCES), shutting down (ESHUTDOWN), every max_connections
//     slot held by an accepted connection (EBUSY); the connection then
//     holds a pending place, and if there are MaxPending already one is
//     closed to make room (Admit says which);
//  2. after the hello names a directory (ENOENT, ENOTDIR: Resolve) and
//     presents its token (EACCES: CheckToken), the connection takes a
//     max_connections slot (Admission.Accept: EBUSY if they filled
//     meanwhile, ESHUTDOWN).
type Gate struct {
	p          Policy
	log        *PeerLog
	ev         Events
	fails      *failures
	maxPending int

	mu      sync.Mutex // guards: conns, closed, pending and every Admission's state and heard
	conns   int
	closed  bool
	pending []*Admission // oldest first
}

// Peer is where a connection comes from. For one from this machine
// (loopback, or the host's own address) the transport gives the uid that
// owns the peer's socket where it can learn it (HasUID): the rule against
// guessing counts such a peer by its uid (failures.go), since every local
// user shares 127.0.0.0/8.
type Peer struct {
	Addr   netip.Addr
	UID    uint32
	HasUID bool
}

// String is the peer for a message: its address, and its uid if known.
func (p Peer) String() string {
	if p.HasUID {
		return fmt.Sprintf("%s (uid %d)", p.Addr, p.UID)
	}
	return p.Addr.String()
}

// args is the peer for a log line: peer=ADDR, and uid=N if known.
func (p Peer) args() []any {
	if p.HasUID {
		return []any{"peer", p.Addr.String(), "uid", p.UID}
	}
	return []any{"peer", p.Addr.String()}
}

// Admission is a connection admitted at connect (Gate.Admit) whose hello
// has not been accepted yet: it holds a pending place, not a
// max_connections slot, until Accept or Done.
type Admission struct {
	g     *Gate
	peer  Peer
	conn  PendingConn // nil: nothing to close
	state admissionState
	heard bool // the transport read its hello (Heard)
}

// Peer is who the admitted connection comes from.
func (a *Admission) Peer() Peer { return a.peer }

// PendingConn is what the gate needs of a connection still saying
// hello, to make room for a newer one.
type PendingConn interface {
	// HelloWaiting reports whether the connection's first frame has
	// arrived whole and waits to be read: its transport is about to
	// serve it. It is called with the gate's lock held and must not
	// block.
	HelloWaiting() bool
	// Close ends the connection; a hello read in progress fails.
	Close() error
}

type admissionState int

const (
	admPending  admissionState = iota
	admEvicted                 // closed to make room for a newer one
	admAccepted                // holds a max_connections slot
	admDone                    // left without one
)

// NewGate applies p; refusals are logged to log (rate-limited, PeerLog).
func NewGate(p Policy, log *slog.Logger) *Gate {
	ev := p.Events
	if ev == nil {
		ev = noEvents{}
	}
	n := p.MaxPending
	if n <= 0 {
		n = DefaultMaxPending
	}
	return &Gate{p: p, log: NewPeerLog(log), ev: ev, fails: newFailures(p), maxPending: n}
}

// Events is where the gate's transport reports (never nil).
func (g *Gate) Events() Events { return g.ev }

// Policy is the gate's policy.
func (g *Gate) Policy() Policy { return g.p }

// Log is the gate's rate-limited log of peer-caused events.
func (g *Gate) Log() *PeerLog { return g.log }

// Admit is the first phase (see Gate): whether a new connection from
// peer may say its hello. It is called before anything of the peer's is
// read or allocated. On success the connection holds a pending place
// until Accept or Done. With MaxPending places taken already, one
// connection is closed to make room, a failure of its source: the
// oldest of those whose hello has neither arrived whole nor been read
// (idle sockets, trickled hellos), else the oldest. Preferring those
// keeps a flood of new connections from closing a peer's hello that
// only waits for the CPU. conn (nil: nothing to close) is the new
// connection. The error wraps the errno to tell the peer.
func (g *Gate) Admit(peer Peer, conn PendingConn) (*Admission, error) {
	if !g.p.Allows(peer.Addr) {
		g.ev.Refused("allow_from")
		g.log.Event("allow_from", "remote: peer not in allow_from; refused", peer.args()...)
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
	if err := g.fullLocked(peer); err != nil {
		g.mu.Unlock()
		return nil, err
	}
	var victim *Admission
	if len(g.pending) >= g.maxPending {
		victim = g.pending[0]
		for _, p := range g.pending {
			if !p.heard && (p.conn == nil || !p.conn.HelloWaiting()) {
				victim = p
				break
			}
		}
		g.leaveLocked(victim)
		victim.state = admEvicted
	}
	a := &Admission{g: g, peer: peer, conn: conn}
	g.pending = append(g.pending, a)
	g.mu.Unlock()
	if victim != nil {
		g.Failed(victim.peer, "pending")
		if victim.conn != nil {
			victim.conn.Close()
		}
	}
	return a, nil
}

// fullLocked refuses a connection when the gate is closed or every slot
// is taken.
func (g *Gate) fullLocked(peer Peer) error {
	switch {
	case g.closed:
		g.ev.Refused("shutdown")
		return fmt.Errorf("mrfs is shutting down: %w", syscall.ESHUTDOWN)
	case g.conns >= g.p.MaxConns:
		g.ev.Refused("max_connections")
		g.log.Event("max_connections", "remote: max_connections reached; peer refused", append(peer.args(), "max_connections", g.p.MaxConns)...)
		return fmt.Errorf("too many connections (max_connections = %d): %w", g.p.MaxConns, syscall.EBUSY)
	}
	return nil
}

// Accept is the second phase (see Gate), once the connection's hello and
// token are accepted: it leaves its pending place for a max_connections
// slot, which it holds until it calls release (once). The error wraps
// the errno to tell the peer: EBUSY when the slots filled while it said
// hello, or when it was closed to make room; ESHUTDOWN.
func (a *Admission) Accept() (release func(), err error) {
	g := a.g
	g.mu.Lock()
	defer g.mu.Unlock()
	switch a.state {
	case admEvicted:
		return nil, fmt.Errorf("closed to make room for newer connections (more than %d saying hello at once): %w", g.maxPending, syscall.EBUSY)
	case admAccepted, admDone:
		return nil, fmt.Errorf("admission of %s already used: %w", a.peer, syscall.EINVAL)
	}
	g.leaveLocked(a)
	if err := g.fullLocked(a.peer); err != nil {
		return nil, err
	}
	a.state = admAccepted
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

// Heard says the transport read the connection's hello: the gate then
// closes it to make room only if every pending connection is as far.
func (a *Admission) Heard() {
	a.g.mu.Lock()
	a.heard = true
	a.g.mu.Unlock()
}

// Done gives back a pending place that Accept did not take (the hello
// failed or was refused). It may be called any number of times, also
// after Accept, which it leaves alone.
func (a *Admission) Done() {
	a.g.mu.Lock()
	defer a.g.mu.Unlock()
	if a.state == admPending {
		a.g.leaveLocked(a)
	}
}

// leaveLocked takes a pending a out of the queue, as done.
func (g *Gate) leaveLocked(a *Admission) {
	for i, p := range g.pending {
		if p == a {
			g.pending = append(g.pending[:i], g.pending[i+1:]...)
			break
		}
	}
	a.state = admDone
}

// Failed counts a failure of peer's source network (why: "token",
// "access", "directory", "hello", "hello_timeout", "pending"); one that
// keeps failing is refused for a while (failures.go).
func (g *Gate) Failed(peer Peer, why string) {
	v := g.fails.failed(peer, time.Now())
	g.warn(v, peer, why)
	if !v.refused {
		g.log.Event("failed_"+why, "remote: a peer's attempt failed", append(peer.args(), "why", why)...)
	}
}

// warn says at warn that a source network is refused, when v says to
// (once a minute per network, or per full table).
func (g *Gate) warn(v verdict, peer Peer, why string) {
	if !v.warn {
		return
	}
	args := peer.args()
	if !v.net.byUID {
		args = append(args, "network", v.net.String())
	}
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
func (g *Gate) Resolve(peer Peer, resolve Resolver, dir string) (*buffer.Domain, error) {
	dom, err := resolve(dir)
	if err == nil {
		return dom, nil
	}
	if e := remote.Errno(err, syscall.ENOENT); e == syscall.ENOENT || e == syscall.ENOTDIR {
		g.Failed(peer, "directory")
	}
	return nil, fmt.Errorf("directory %q: %w", dir, err)
}

// CheckToken admits peer to dom only with dom's token: otherwise the
// peer is refused with EACCES, before any queue pair exists, and the
// failure counts against its source.
func (g *Gate) CheckToken(peer Peer, dir string, dom *buffer.Domain, token [buffer.TokenSize]byte) error {
	if dom.TokenIs(token) {
		return nil
	}
	g.ev.Refused("token")
	g.Failed(peer, "token")
	return fmt.Errorf("wrong token for %q (user.mrfs.token of the directory): %w", dir, syscall.EACCES)
}

// Conns is the number of accepted connections not yet released.
func (g *Gate) Conns() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.conns
}

// Pending is the number of connections admitted at connect whose hello
// is not accepted yet.
func (g *Gate) Pending() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.pending)
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
