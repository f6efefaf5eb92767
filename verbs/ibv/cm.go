//go:build rdma

package ibv

// The connection manager (librdmacm) as a small Go API: an event
// channel, connection ids, and an RC queue pair in an mrfs PD. The
// protocol on top (what private data says, when to accept) is
// remote/rdmacm's; this file only makes the calls safe to use from Go.

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
)

// EventType is an rdma_cm event type.
type EventType int

// The events mrfs handles.
var (
	EventAddrResolved   = EventType(evAddrResolved)
	EventAddrError      = EventType(evAddrError)
	EventRouteResolved  = EventType(evRouteResolved)
	EventRouteError     = EventType(evRouteError)
	EventConnectRequest = EventType(evConnectRequest)
	EventConnectError   = EventType(evConnectError)
	EventUnreachable    = EventType(evUnreachable)
	EventRejected       = EventType(evRejected)
	EventEstablished    = EventType(evEstablished)
	EventDisconnected   = EventType(evDisconnected)
	EventDeviceRemoval  = EventType(evDeviceRemoval)
	EventTimewaitExit   = EventType(evTimewaitExit)
)

// String is librdmacm's name, e.g. RDMA_CM_EVENT_ESTABLISHED.
func (t EventType) String() string { return eventName(int(t)) }

// Event is one rdma_cm event, already acknowledged: ids may be destroyed
// right away (rdma_destroy_id waits for its events' acknowledgements).
type Event struct {
	Type EventType
	// Status is the event's status: for REJECTED the IB CM reject
	// reason (28: the peer's application rejected), else 0 or -errno.
	Status int
	// ID is the id the event is about; for CONNECT_REQUEST a new id for
	// the connection, owned by the caller from now on.
	ID CMID
	// Listen is the listening id of a CONNECT_REQUEST.
	Listen CMID
	// InitiatorDepth and ResponderResources are the peer's (CONNECT_REQUEST).
	InitiatorDepth, ResponderResources uint8
	// Private is a copy of the private data. Over IB and RoCE the length
	// is the CM message's field, not the sender's: trailing zeros pad it.
	Private []byte
}

// RejectConsumer is the REJECTED status when the peer's application
// called rdma_reject (IB_CM_REJ_CONSUMER_DEFINED).
const RejectConsumer = 28

// EventChannel is an rdma_event_channel in non-blocking mode, so that
// Go code can poll it with a timeout and stop waiting at will.
type EventChannel struct{ c cChannel }

// NewEventChannel opens an event channel. ENODEV or ENOENT when the
// kernel has no rdma_cm device (load rdma_ucm).
func NewEventChannel() (*EventChannel, error) {
	c, err := createChannel()
	if err != nil {
		return nil, fmt.Errorf("rdma_create_event_channel (is the rdma_ucm module loaded?): %w", err)
	}
	if err := unix.SetNonblock(c.fd(), true); err != nil {
		c.destroy()
		return nil, fmt.Errorf("rdma_cm event channel: set non-blocking: %w", err)
	}
	return &EventChannel{c: c}, nil
}

// Fd is the channel's file descriptor, readable when an event is queued.
func (ch *EventChannel) Fd() int { return ch.c.fd() }

// Next returns the next queued event; EAGAIN when there is none.
func (ch *EventChannel) Next() (Event, error) {
	r, err := ch.c.getEvent()
	if err != nil {
		return Event{}, err
	}
	return Event{
		Type: EventType(r.typ), Status: r.status, ID: CMID{r.id}, Listen: CMID{r.listenID},
		InitiatorDepth: r.initDepth, ResponderResources: r.respRs, Private: r.private,
	}, nil
}

// Wait returns the next event, waiting up to timeout; ETIMEDOUT when
// none came.
func (ch *EventChannel) Wait(timeout time.Duration) (Event, error) {
	deadline := time.Now().Add(timeout)
	for {
		ev, err := ch.Next()
		if err != syscall.EAGAIN {
			return ev, err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return Event{}, syscall.ETIMEDOUT
		}
		fds := []unix.PollFd{{Fd: int32(ch.Fd()), Events: unix.POLLIN}}
		if _, err := unix.Poll(fds, int(left.Milliseconds())+1); err != nil && err != syscall.EINTR {
			return Event{}, fmt.Errorf("poll the rdma_cm event channel: %w", err)
		}
	}
}

// Close destroys the channel; destroy its ids first.
func (ch *EventChannel) Close() { ch.c.destroy() }

// CMID is an rdma_cm_id (RDMA_PS_TCP: reliable connected). It is a
// value, comparable, so that an event's ID can be looked up in a map of
// the ids a caller owns. Calls on one id must not run concurrently with
// its Destroy.
type CMID struct{ c cID }

// CreateID makes an id whose events arrive on ch.
func (ch *EventChannel) CreateID() (CMID, error) {
	c, err := ch.c.createID()
	if err != nil {
		return CMID{}, fmt.Errorf("rdma_create_id: %w", err)
	}
	return CMID{c}, nil
}

// Valid reports whether id names an id (the zero CMID does not).
func (id CMID) Valid() bool { return id.c.p != nil }

func ipBytes(a netip.Addr) []byte {
	if a.Is4() || a.Is4In6() {
		b := a.Unmap().As4()
		return b[:]
	}
	b := a.As16()
	return b[:]
}

// Bind binds the id to a local address (rdma_bind_addr); a port of 0
// picks one (see Port). Binding to a device's address binds the id to
// that device.
func (id CMID) Bind(ap netip.AddrPort) error {
	if err := id.c.bind(ipBytes(ap.Addr()), ap.Port()); err != nil {
		return fmt.Errorf("rdma_bind_addr %s: %w", ap, err)
	}
	return nil
}

// Listen starts listening (rdma_listen).
func (id CMID) Listen(backlog int) error {
	if err := id.c.listen(backlog); err != nil {
		return fmt.Errorf("rdma_listen: %w", err)
	}
	return nil
}

// Port is the id's local port.
func (id CMID) Port() uint16 { return id.c.srcPort() }

// Peer is the id's remote address, invalid before it is known.
func (id CMID) Peer() netip.AddrPort {
	ip, port := id.c.peerAddr()
	a, ok := netip.AddrFromSlice(ip)
	if !ok {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(a.Unmap(), port)
}

// DeviceName is the name of the device the id is bound to, "" before.
func (id CMID) DeviceName() string { return id.c.deviceName() }

// ResolveAddr starts resolving a destination (rdma_resolve_addr):
// ADDR_RESOLVED or ADDR_ERROR follows on the channel.
func (id CMID) ResolveAddr(dst netip.AddrPort, timeout time.Duration) error {
	if err := id.c.resolveAddr(ipBytes(dst.Addr()), dst.Port(), int(timeout.Milliseconds())); err != nil {
		return fmt.Errorf("rdma_resolve_addr %s: %w", dst, err)
	}
	return nil
}

// ResolveRoute starts resolving the route (rdma_resolve_route):
// ROUTE_RESOLVED or ROUTE_ERROR follows.
func (id CMID) ResolveRoute(timeout time.Duration) error {
	if err := id.c.resolveRoute(int(timeout.Milliseconds())); err != nil {
		return fmt.Errorf("rdma_resolve_route: %w", err)
	}
	return nil
}

// MaxPrivateConnect is the private data a connect request carries over
// IB and RoCE (the CM REQ's 92 bytes less rdma_cm's 36-byte header).
const MaxPrivateConnect = 56

// Connect sends a connect request (rdma_connect) with private data;
// ESTABLISHED, REJECTED, UNREACHABLE or CONNECT_ERROR follows.
// initiatorDepth is how many READs and atomics this side may have in
// flight; the responder gives its QP remote read and atomic access only
// when it is above 0.
func (id CMID) Connect(private []byte, responderResources, initiatorDepth uint8) error {
	if len(private) > MaxPrivateConnect {
		return fmt.Errorf("rdma_connect: %d bytes of private data, at most %d fit: %w", len(private), MaxPrivateConnect, syscall.EINVAL)
	}
	if err := id.c.connect(private, responderResources, initiatorDepth); err != nil {
		return fmt.Errorf("rdma_connect: %w", err)
	}
	return nil
}

// MaxResponderResources asks Accept for as many READs and atomics in
// flight as the peer asked for, within the device's limit
// (RDMA_MAX_RESP_RES).
const MaxResponderResources = 0xFF

// Accept accepts a connect request (rdma_accept): librdmacm moves the
// id's QP to RTR and RTS first. The QP's remote access flags come from
// the connection manager: remote write always, remote read and atomic
// when responderResources is above 0 (the memory regions' flags then
// decide, as on any RC QP).
func (id CMID) Accept(responderResources, initiatorDepth uint8) error {
	if err := id.c.accept(responderResources, initiatorDepth); err != nil {
		return fmt.Errorf("rdma_accept: %w", err)
	}
	return nil
}

// MaxPrivateAccept is the private data an accept carries over IB and
// RoCE (the CM REP's field; rdma_cm adds no header to it).
const MaxPrivateAccept = 196

// MaxPrivateReject is the private data a reject carries over IB and
// RoCE (the CM REJ's field).
const MaxPrivateReject = 148

// Reject rejects a connect request (rdma_reject) with private data.
func (id CMID) Reject(private []byte) error {
	if len(private) > MaxPrivateReject {
		private = private[:MaxPrivateReject]
	}
	if err := id.c.reject(private); err != nil {
		return fmt.Errorf("rdma_reject: %w", err)
	}
	return nil
}

// Disconnect disconnects (rdma_disconnect): the QP moves to ERROR and
// the peer gets DISCONNECTED.
func (id CMID) Disconnect() error {
	if err := id.c.disconnect(); err != nil {
		return fmt.Errorf("rdma_disconnect: %w", err)
	}
	return nil
}

// Destroy destroys the id (rdma_destroy_id); destroy its QP first.
func (id CMID) Destroy() error {
	if err := id.c.destroy(); err != nil {
		return fmt.Errorf("rdma_destroy_id: %w", err)
	}
	return nil
}

// QP is an RC queue pair that rdma_cm manages, in a PD of this package,
// with one completion queue for both of its queues.
type QP struct {
	id  CMID
	cq  cCQ
	pd  *pd
	dev *device
	own cQP // the QP when mrfs manages it (AcceptQP), else id->qp
	// wrID numbers work requests, so that a completion is matched to the
	// request it belongs to. Calls on one QP are not concurrent.
	wrID uint64
}

// lockPD checks that p is a live PD of this package on the very context
// of id (librdmacm's: see Open) and returns it with its device and itself
// read-locked, so neither goes away while a QP is created in it; unlock
// releases both. EXDEV when the PD is on another context, for instance a
// device opened without the rdma_ucm module.
func (id CMID) lockPD(p verbs.PD) (pp *pd, unlock func(), err error) {
	pp, ok := p.(*pd)
	if !ok {
		return nil, nil, fmt.Errorf("create_qp: the PD is not of the rdma backend: %w", syscall.EINVAL)
	}
	d := pp.dev
	d.mu.RLock()
	if d.closed {
		d.mu.RUnlock()
		return nil, nil, fmt.Errorf("create_qp in pd %d on %s: device closed: %w", pp.handle, d.name, syscall.ENODEV)
	}
	pp.mu.RLock()
	unlock = func() { pp.mu.RUnlock(); d.mu.RUnlock() }
	if pp.dead {
		unlock()
		return nil, nil, fmt.Errorf("create_qp in pd %d on %s: the protection domain was deallocated: %w", pp.handle, d.name, syscall.EINVAL)
	}
	if id.c.context().p != d.ctx.p {
		unlock()
		return nil, nil, fmt.Errorf("create_qp in pd %d on %s: the connection is on %q through another device context (rdma_cm needs the PD in its own; was the device opened without rdma_ucm loaded?): %w",
			pp.handle, d.name, id.DeviceName(), syscall.EXDEV)
	}
	return pp, unlock, nil
}

// CreateQP creates an RC QP for id in p (rdma_create_qp), able to hold
// depth outstanding send work requests. p must be a PD of this package
// on the very context of the id (librdmacm's: see Open); EXDEV when it is
// on another context, for instance a device opened without the rdma_cm
// module.
func (id CMID) CreateQP(p verbs.PD, depth int) (*QP, error) {
	pp, unlock, err := id.lockPD(p)
	if err != nil {
		return nil, err
	}
	defer unlock()
	d := pp.dev
	cq, err := d.ctx.createCQ(depth + 1)
	if err != nil {
		return nil, fmt.Errorf("create_cq on %s: %w", d.name, err)
	}
	if err := id.c.createQP(pp.c, cq, depth); err != nil {
		cq.destroy()
		return nil, fmt.Errorf("rdma_create_qp in pd %d on %s: %w", pp.handle, d.name, err)
	}
	return &QP{id: id, cq: cq, pd: pp, dev: d}, nil
}

// AcceptQP answers a CONNECT_REQUEST on id: it creates an RC QP in p
// that allows every remote access (remote write, read and atomic), so
// that the memory regions' flags alone decide what a peer may do, as
// they do on any RC QP; moves it to RTS with the connection manager's
// attributes and accepts. responderResources is how many READs and
// atomics the peer may have in flight at mrfs (its initiator depth,
// Event.ResponderResources).
//
// Why not rdma_create_qp and rdma_accept's own transitions: then the
// QP's remote read and atomic access follow the connection manager's
// record of responder resources (what the peer asked for), and librdmacm
// re-initialises the access flags on the way to RTR, so mrfs could not
// set them. Moving the QP itself (rdma_init_qp_attr, then ibv_modify_qp)
// and accepting by QP number leaves the decision to the regions' flags;
// Disconnect and Destroy handle such a QP too. The private data (at
// most MaxPrivateAccept bytes) reaches the peer with its ESTABLISHED.
func (id CMID) AcceptQP(p verbs.PD, depth int, responderResources uint8, private []byte) (*QP, error) {
	if len(private) > MaxPrivateAccept {
		return nil, fmt.Errorf("rdma_accept: %d bytes of private data, at most %d fit: %w", len(private), MaxPrivateAccept, syscall.EINVAL)
	}
	pp, unlock, err := id.lockPD(p)
	if err != nil {
		return nil, err
	}
	defer unlock()
	d := pp.dev
	cq, err := d.ctx.createCQ(depth + 1)
	if err != nil {
		return nil, fmt.Errorf("create_cq on %s: %w", d.name, err)
	}
	own, err := pp.c.createOwnQP(cq, depth)
	if err != nil {
		cq.destroy()
		return nil, fmt.Errorf("create_qp in pd %d on %s: %w", pp.handle, d.name, err)
	}
	q := &QP{id: id, cq: cq, pd: pp, dev: d, own: own}
	all := uint32(verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic)
	if err := own.ready(id.c, all, responderResources); err != nil {
		q.Destroy()
		return nil, fmt.Errorf("move qp %d to RTS: %w", own.num(), err)
	}
	if err := id.c.acceptQPN(own.num(), responderResources, private); err != nil {
		q.Destroy()
		return nil, fmt.Errorf("rdma_accept: %w", err)
	}
	return q, nil
}

// Num is the QP number.
func (q *QP) Num() uint32 {
	if q.own.p != nil {
		return q.own.num()
	}
	return q.id.c.qpNum()
}

// Disconnect moves the QP to ERROR and disconnects its id: the peer
// gets DISCONNECTED. Errors are those of a peer that already left.
func (q *QP) Disconnect() {
	if q.own.p != nil {
		q.own.toError()
	}
	q.id.Disconnect()
}

// Destroy destroys the QP, then its CQ. Disconnect first for a clean
// end; the id stays and is destroyed by its owner.
func (q *QP) Destroy() error {
	if q.own.p != nil {
		if errno := q.own.destroy(); errno != 0 {
			return fmt.Errorf("destroy_qp %d: %w", q.own.num(), errno)
		}
	} else {
		q.id.c.destroyQP()
	}
	if errno := q.cq.destroy(); errno != 0 {
		return fmt.Errorf("destroy_cq: %w", errno)
	}
	return nil
}

// Op is a one-sided operation.
type Op int

// The operations.
const (
	OpWrite Op = iota
	OpRead
	OpCompareSwap
	OpFetchAdd
)

var opCodes = map[Op]int{OpWrite: opWrite, OpRead: opRead, OpCompareSwap: opCAS, OpFetchAdd: opFAdd}

// Request is one one-sided work request. Local is memory registered in
// the QP's PD (an mmap, never the Go heap) with LKey; atomics use 8
// bytes there, where the old remote value lands.
type Request struct {
	Op         Op
	Local      uintptr
	Length     uint32
	LKey       uint32
	RemoteAddr uint64
	RKey       uint32
	CompareAdd uint64 // compare for CompareSwap, the addend for FetchAdd
	Swap       uint64
}

// ErrTimeout is returned by Do when no completion came in time; the QP
// must not be used again (the request may still complete).
var ErrTimeout = errors.New("no completion")

// Do posts r signaled and polls the CQ for its completion, spinning
// (latency matters more than a core here) until timeout. The status is
// the completion's: IBV_WC_REM_ACCESS_ERR when the responder's NIC
// refused the rkey, the PD, the access or the range; after an error the
// RC QP is in ERROR and later requests complete with WR_FLUSH_ERR.
func (q *QP) Do(r Request, timeout time.Duration) (verbs.WCStatus, error) {
	op, ok := opCodes[r.Op]
	if !ok {
		return 0, fmt.Errorf("post_send: unknown operation %d: %w", r.Op, syscall.EINVAL)
	}
	if r.Op == OpCompareSwap || r.Op == OpFetchAdd {
		r.Length = 8
	}
	q.wrID++
	if errno := q.id.c.post(op, r.Local, r.Length, r.LKey, r.RemoteAddr, r.RKey, r.CompareAdd, r.Swap, q.wrID); errno != 0 {
		return 0, fmt.Errorf("ibv_post_send: %w", errno)
	}
	deadline := time.Now().Add(timeout)
	for spins := 0; ; spins++ {
		n, st, wr := q.cq.poll()
		switch {
		case n < 0:
			return 0, fmt.Errorf("ibv_poll_cq: returned %d: %w", n, syscall.EIO)
		case n == 1 && wr == q.wrID:
			return verbs.WCStatus(st), nil
		case n == 1:
			continue // a late completion of an earlier, timed-out request
		}
		if spins&1023 == 1023 && time.Now().After(deadline) {
			return 0, fmt.Errorf("work request %d: %w within %v", q.wrID, ErrTimeout, timeout)
		}
	}
}
