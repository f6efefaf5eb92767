//go:build rdma

package rdmacm

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/remote"
	"mrfs/remote/gate"
	"mrfs/verbs"
	"mrfs/verbs/ibv"
)

// qpDepth is the send queue of a responder QP: one-sided operations
// consume no work request on the responder, but the QP needs queues.
const qpDepth = 4

// Listener accepts rdma_cm connections and gives each an RC QP in the
// PD of the directory its connect request names.
type Listener struct {
	ch      *ibv.EventChannel
	id      ibv.CMID // the listening id
	addr    netip.AddrPort
	device  string // the bound address's device; "" for the unspecified address
	resolve gate.Resolver
	gate    *gate.Gate
	log     *slog.Logger
	wake    [2]int        // a pipe: Close writes to stop the event loop
	done    chan struct{} // closed when the event loop has returned

	// guards: conns and closed. Never held across a librdmacm call.
	mu     sync.Mutex
	conns  map[ibv.CMID]*conn
	closed bool
}

// Listen binds an rdma_cm listener to addr ("10.0.2.15:7471"; the
// address of an RDMA device's netdev, or the unspecified address for
// all of them) and serves connect requests under policy p until Close
// (its allow_from and max_connections; message sizes and timeouts are
// the NIC's). A connection's QP is created in the PD that resolve
// returns, which must be a PD of the rdma backend on librdmacm's device
// context (verbs/ibv opens devices so): anything else is rejected.
func Listen(addr string, p gate.Policy, resolve gate.Resolver, log *slog.Logger) (*Listener, error) {
	ap, err := parseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ch, err := ibv.NewEventChannel()
	if err != nil {
		return nil, fmt.Errorf("rdma_cm listener on %s: %w", addr, err)
	}
	fail := func(err error) (*Listener, error) {
		ch.Close()
		return nil, fmt.Errorf("rdma_cm listener on %s: %w", addr, err)
	}
	id, err := ch.CreateID()
	if err != nil {
		return fail(err)
	}
	if err := id.Bind(ap); err != nil {
		id.Destroy()
		return fail(err)
	}
	if err := id.Listen(64); err != nil {
		id.Destroy()
		return fail(err)
	}
	l := &Listener{
		ch: ch, id: id, addr: netip.AddrPortFrom(ap.Addr(), id.Port()), device: id.DeviceName(),
		resolve: resolve, gate: gate.NewGate(p, log), log: log,
		done: make(chan struct{}), conns: map[ibv.CMID]*conn{},
	}
	if err := unix.Pipe2(l.wake[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		id.Destroy()
		return fail(fmt.Errorf("pipe: %w", err))
	}
	go l.loop()
	l.log.Info("rdma_cm listening", "addr", l.addr.String(), "device", l.device)
	return l, nil
}

// parseAddrPort takes numeric addresses, and names the resolver knows.
func parseAddrPort(s string) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap, nil
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: %w", s, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: bad port: %w", s, err)
	}
	if host == "" {
		return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(p)), nil
	}
	ips, err := net.LookupIP(host)
	if err != nil || len(ips) == 0 {
		return netip.AddrPort{}, fmt.Errorf("address %q: cannot resolve %s: %w", s, host, err)
	}
	a, _ := netip.AddrFromSlice(ips[0])
	return netip.AddrPortFrom(a.Unmap(), uint16(p)), nil
}

// Addr is the address the listener is bound to, with the port chosen
// when the configured one was 0.
func (l *Listener) Addr() netip.AddrPort { return l.addr }

// Reach is where peers reach each device the listener serves, by
// device name: its bound address, or bound to the unspecified address,
// each RDMA device's own (read now: addresses change).
func (l *Listener) Reach() map[string]netip.AddrPort {
	return reach(l.addr, l.device, func() map[string]netip.Addr {
		return deviceAddrs(sysInfiniband, netdevAddrs)
	})
}

// CloseDevice closes the connections that came through the named
// device (it is gone: their queue pairs must go before its PDs do) and
// returns how many.
func (l *Listener) CloseDevice(name string) int {
	n := 0
	for _, c := range l.snapshot() {
		if c.device == name {
			c.closeFromOutside("device " + name + " is gone")
			n++
		}
	}
	return n
}

// Conns is the number of connections.
func (l *Listener) Conns() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// loop handles events one at a time until Close: a new id is only made
// by librdmacm inside Next (CONNECT_REQUEST), so an event about an id
// that was destroyed meanwhile is dispatched before any new id could
// reuse its address, and finds no connection.
func (l *Listener) loop() {
	defer close(l.done)
	fds := []unix.PollFd{{Fd: int32(l.ch.Fd()), Events: unix.POLLIN}, {Fd: int32(l.wake[0]), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil && err != syscall.EINTR {
			l.log.Error("rdma_cm listener: poll failed; no more connections are accepted", "err", err)
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		for {
			ev, err := l.ch.Next()
			if err == syscall.EAGAIN {
				break
			}
			if err != nil {
				l.log.Error("rdma_cm listener: rdma_get_cm_event failed", "err", err)
				break
			}
			l.handle(ev)
		}
	}
}

func (l *Listener) lookup(id ibv.CMID) *conn {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.conns[id]
}

func (l *Listener) handle(ev ibv.Event) {
	switch ev.Type {
	case ibv.EventConnectRequest:
		l.accept(ev)
	case ibv.EventEstablished:
		if c := l.lookup(ev.ID); c != nil {
			l.log.Info("rdma_cm connection established", "peer", c.peer.String(), "dir", c.dir, "pd", c.pd, "qp", c.qpNum)
			c.establishedOnce.Do(func() { close(c.established) })
		}
	case ibv.EventDisconnected:
		if c := l.lookup(ev.ID); c != nil {
			c.close("the peer disconnected")
		}
	case ibv.EventDeviceRemoval:
		// Whether this comes before the device waits for its contexts
		// depends on the kernel's order; the devices' watch does not
		// count on it (CloseDevice).
		if c := l.lookup(ev.ID); c != nil {
			c.close("its device was removed")
		}
	case ibv.EventConnectError, ibv.EventUnreachable, ibv.EventRejected:
		if c := l.lookup(ev.ID); c != nil {
			c.close(fmt.Sprintf("%s (status %d)", ev.Type, ev.Status))
		}
	case ibv.EventDeviceRemoval:
		l.log.Error("rdma_cm: the RDMA device is being removed; closing its connections", "device", l.id.DeviceName())
		for _, c := range l.snapshot() {
			c.close("device removal")
		}
	default:
		l.log.Debug("rdma_cm event", "event", ev.Type.String(), "status", ev.Status)
	}
}

func (l *Listener) snapshot() []*conn {
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := make([]*conn, 0, len(l.conns))
	for _, c := range l.conns {
		cs = append(cs, c)
	}
	return cs
}

// accept serves a CONNECT_REQUEST: the gate must admit the peer
// (allow_from, failures, max_connections), its private data name an
// existing directory and present that directory's token; only then does
// it take a max_connections slot (the gate's second phase: the request
// is the hello, whole, so it never waits among pending connections), a
// QP in the directory's PD is created, attached to its Domain (so that
// rmdir and unmount close it before the PD goes), and the request
// accepted. Until the token is checked nothing of the peer's exists here
// but the request's id (librdmacm's), its private data (at most 256
// bytes) and c. A refusal carries its errno in the reject's private data.
func (l *Listener) accept(ev ibv.Event) {
	id := ev.ID
	peer := id.Peer()
	reject := func(errno syscall.Errno, msg string) {
		if err := id.Reject(encodeReject(errno, msg)); err != nil {
			l.log.Warn("rdma_cm: reject failed", "peer", peer.String(), "err", err)
		}
		if err := id.Destroy(); err != nil {
			l.log.Warn("rdma_cm: destroy a rejected id", "peer", peer.String(), "err", err)
		}
		l.gate.Log().Event("rejected", "rdma_cm connection rejected", "peer", peer.String(), "errno", errno.Error(), "reason", msg)
	}
	// A remote peer, counted by its network: rdma_cm tells no local uid.
	from := gate.Peer{Addr: peer.Addr()}
	a, err := l.gate.Admit(from, nil)
	if err != nil {
		reject(remote.Errno(err, syscall.EACCES), err.Error())
		return
	}
	defer a.Done() // a no-op once accepted
	dir, tok, err := decodeConnect(ev.Private)
	if err != nil {
		if !errors.Is(err, errVersion) {
			l.gate.Failed(from, "hello")
		}
		reject(syscall.EPROTO, err.Error())
		return
	}
	c := &conn{l: l, id: id, dir: dir, peer: peer, device: id.DeviceName(), release: func() {}, established: make(chan struct{})}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		reject(syscall.ESHUTDOWN, "mrfs is shutting down")
		return
	}
	l.conns[id] = c // close removes it
	l.mu.Unlock()
	unreserve := func() {
		l.mu.Lock()
		delete(l.conns, id)
		l.mu.Unlock()
	}

	dom, err := l.gate.Resolve(from, l.resolve, dir)
	if err != nil {
		unreserve()
		reject(remote.Errno(err, syscall.ENOENT), err.Error())
		return
	}
	if err := l.gate.CheckToken(from, dir, dom, tok); err != nil {
		unreserve()
		reject(syscall.EACCES, err.Error())
		return
	}
	// Attached first, so that an rmdir from now on closes it; c.mu held
	// until accepted, so that such a close waits for a whole QP.
	c.pd = dom.PD()
	c.mu.Lock()
	defer c.mu.Unlock()
	release, err := a.Accept()
	if err != nil {
		unreserve()
		reject(remote.Errno(err, syscall.EBUSY), err.Error())
		return
	}
	c.release = release
	unreserve = func() {
		l.mu.Lock()
		delete(l.conns, id)
		l.mu.Unlock()
		release()
	}
	detach, err := dom.Attach(c)
	if err != nil {
		unreserve()
		reject(remote.Errno(err, syscall.ENOENT), fmt.Sprintf("directory %q: %v", dir, err))
		return
	}
	c.detach = detach
	// The peer's initiator depth, within what rxe and most NICs take.
	resp := min(ev.ResponderResources, maxResponderResources)
	vpd, device := dom.VerbsPD(), c.device
	if mp, ok := vpd.(verbs.MultiPD); ok {
		// Buffers on several devices: the QP is made in the PD's part on
		// the device the request came through, whose keys then work.
		if vpd = mp.On(device); vpd == nil {
			detach()
			unreserve()
			reject(syscall.ENODEV, fmt.Sprintf("pd %d is not on device %s", dom.PD(), device))
			return
		}
	}
	qp, err := id.AcceptQP(vpd, qpDepth, resp, encodeAccept(device))
	if err != nil {
		detach()
		unreserve()
		reject(remote.Errno(err, syscall.EIO), fmt.Sprintf("queue pair in pd %d: %v", dom.PD(), err))
		return
	}
	c.qp, c.qpNum = qp, qp.Num()
	l.log.Info("rdma_cm connection accepted", "peer", peer.String(), "dir", dir, "pd", c.pd, "device", device, "qp", c.qpNum,
		"responder_resources", resp)
}

// maxResponderResources bounds the READs and atomics a peer may have in
// flight at mrfs.
const maxResponderResources = 16

// Close stops accepting, closes every connection (disconnect, destroy
// QP, CQ and id) and the listener. It does not deallocate any PD.
func (l *Listener) Close() error {
	l.gate.Close()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.mu.Unlock()
	// Connections go while the event loop still runs: one accepted but
	// not yet established needs its ESTABLISHED event before a
	// disconnect can reach the peer (see conn.Close).
	n := 0
	for _, c := range l.snapshot() {
		c.closeFromOutside("mrfs is shutting down")
		n++
	}
	unix.Write(l.wake[1], []byte{0})
	<-l.done
	var errs []error
	if err := l.id.Destroy(); err != nil {
		errs = append(errs, err)
	}
	l.ch.Close()
	unix.Close(l.wake[0])
	unix.Close(l.wake[1])
	l.log.Info("rdma_cm listener closed", "addr", l.addr.String(), "closed_connections", n)
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close the rdma_cm listener on %s: %w", l.addr, err)
	}
	return nil
}

// conn is one accepted connection: its id and its QP in a directory's PD.
type conn struct {
	l      *Listener
	id     ibv.CMID
	dir    string
	peer   netip.AddrPort
	device string // the device the request came through
	pd     uint32
	qpNum  uint32
	// established is closed at the ESTABLISHED event (once).
	established     chan struct{}
	establishedOnce sync.Once

	// guards: qp, detach, release and closed. Held across the
	// teardown's librdmacm calls, so that a close (from rmdir, unmount or
	// the peer's disconnect) and the accept never interleave.
	mu     sync.Mutex
	qp     *ibv.QP
	detach func()
	// release gives the gate its slot back (once); a no-op until the
	// connection took one.
	release func()
	closed  bool
}

// establishWait bounds how long a close from outside waits for a
// connection still being established.
const establishWait = 2 * time.Second

// Close is the Domain's: the directory is being removed or mrfs stops.
func (c *conn) Close() error {
	c.closeFromOutside("the directory's PD is being deallocated")
	return nil
}

// closeFromOutside closes a connection for a reason of mrfs's own (not
// the event loop's). A connection accepted but not yet established would
// be destroyed without the peer hearing of it: the peer, already
// established on its side, would wait forever for a DISCONNECTED. So it
// first waits, briefly, for ESTABLISHED; never call it from the event
// loop, which delivers that event.
func (c *conn) closeFromOutside(reason string) {
	select {
	case <-c.established:
	case <-time.After(establishWait):
	}
	c.close(reason)
}

func (c *conn) close(reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closeLocked(reason)
}

// closeLocked tears the connection down once: disconnect (the peer sees
// DISCONNECTED, its QP goes to ERROR), destroy the QP and CQ, the id,
// and leave the Domain and the listener.
func (c *conn) closeLocked(reason string) {
	if c.closed {
		return
	}
	c.closed = true
	var errs []error
	if c.qp != nil {
		c.qp.Disconnect() // fails harmlessly when the peer already left
		if err := c.qp.Destroy(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.id.Destroy(); err != nil {
		errs = append(errs, err)
	}
	if c.detach != nil {
		c.detach()
	}
	c.l.mu.Lock()
	delete(c.l.conns, c.id)
	c.l.mu.Unlock()
	c.release()
	if err := errors.Join(errs...); err != nil {
		c.l.log.Error("rdma_cm connection teardown failed", "peer", c.peer.String(), "dir", c.dir, "err", err)
		return
	}
	c.l.log.Info("rdma_cm connection closed", "peer", c.peer.String(), "dir", c.dir, "pd", c.pd, "qp", c.qpNum, "reason", reason)
}

// sysInfiniband is where the kernel lists RDMA devices.
const sysInfiniband = "/sys/class/infiniband"

// netdevAddrs lists a network device's addresses.
func netdevAddrs(name string) []netip.Addr {
	ifc, err := net.InterfaceByName(name)
	if err != nil {
		return nil
	}
	addrs, err := ifc.Addrs()
	if err != nil {
		return nil
	}
	var out []netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}
