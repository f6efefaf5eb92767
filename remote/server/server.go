// Package server is the soft remote transport: a TCP listener that gives
// each accepted peer the responder side of an RC queue pair in the PD of
// the directory its hello names, and executes the peer's one-sided
// operations through that PD's verbs.Responder (the soft backend), one at
// a time, in order. The wire format is remote/proto (docs/PROTOCOL.md).
//
// Peers are not trusted. Admission is gate.Gate's, as on every
// transport: a peer outside allow_from or past max_connections is refused
// on accept with HELLO_ERR and the errno; a connection takes a
// max_connections slot only once its hello and token are accepted, and
// until then counts among those still saying hello, bounded apart (the
// gate closes one to make room, preferring those whose hello has not
// arrived: pendingConn); a hello, a started frame and each reply must
// complete within the timeout (slowloris); a frame that breaks the format
// ends that connection and nothing else. An operation that
// fails a check completes with the requester's status and moves the
// connection to the error state of an RC QP: every later operation
// completes with IBV_WC_WR_FLUSH_ERR without running.
package server

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/remote"
	"mrfs/remote/gate"
	"mrfs/remote/proto"
	"mrfs/verbs"
)

// Server accepts peers on one listener.
type Server struct {
	gate    *gate.Gate
	p       gate.Policy
	ln      net.Listener
	resolve gate.Resolver
	log     *slog.Logger
	wg      sync.WaitGroup // the accept loop and every connection

	// guards: conns and closed. Lock order: mu, then the gate's
	// (an admission ends under mu).
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// Serve accepts peers on ln under policy p until Close; resolve maps a
// hello's directory to its PD (a gate.Pending while mrfs mounts).
func Serve(ln net.Listener, p gate.Policy, resolve gate.Resolver, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{gate: gate.NewGate(p, log), p: p, ln: ln, resolve: resolve, log: log, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.accept()
	return s
}

// Addr is the address the server listens on.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Close stops accepting, closes every connection and waits until no
// connection goroutine is left, so that nothing touches a PD afterwards.
func (s *Server) Close() error {
	s.gate.Close()
	s.mu.Lock()
	s.closed = true
	conns := s.conns
	s.conns = map[net.Conn]struct{}{}
	s.mu.Unlock()
	err := s.ln.Close()
	for c := range conns {
		c.Close()
	}
	s.wg.Wait()
	if err != nil && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("close remote listener %s: %w", s.ln.Addr(), err)
	}
	return nil
}

func (s *Server) accept() {
	defer s.wg.Done()
	var backoff time.Duration
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: wait and retry
			// rather than spin or give up on every later peer.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("remote: accept failed; retrying", "err", err, "in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		s.admit(c)
	}
}

// admit applies the gate's first phase (allow_from, failures,
// max_connections), then serves c.
func (s *Server) admit(c net.Conn) {
	peer := c.RemoteAddr().String()
	a, err := s.gate.Admit(peerOf(c), pendingConn{c})
	if err == nil {
		s.mu.Lock()
		if s.closed {
			err = fmt.Errorf("mrfs is shutting down: %w", syscall.ESHUTDOWN)
			a.Done()
		} else {
			s.conns[c] = struct{}{}
			s.wg.Add(1)
		}
		s.mu.Unlock()
	}
	if err != nil {
		// A fresh socket's send buffer takes this without blocking; the
		// deadline only bounds the unexpected.
		c.SetWriteDeadline(time.Now().Add(s.p.Timeout))
		b, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHelloErr, Errno: uint32(remote.Errno(err, syscall.EACCES)), Msg: err.Error()})
		c.Write(b)
		c.Close()
		return
	}
	go func() {
		defer s.wg.Done()
		defer func() {
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
			c.Close()
			a.Done()
		}()
		defer func() {
			// A bug in serving one peer must not take the daemon, and
			// every other peer and the mount, down with it.
			if e := recover(); e != nil {
				s.log.Error("remote: panic serving a peer; connection closed", "peer", peer, "panic", e, "stack", string(debug.Stack()))
			}
		}()
		s.serve(c, a)
	}()
}

// pendingConn is a connection still saying hello, as the gate sees it.
// Closing it ends a hello read in progress.
type pendingConn struct{ net.Conn }

var _ gate.PendingConn = pendingConn{}

// HelloWaiting peeks at the socket: whether the first frame, as long as
// its header says, has arrived whole. The connection's goroutine may be
// reading it meanwhile; a peek takes nothing from it.
func (p pendingConn) HelloWaiting() bool {
	sc, ok := p.Conn.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	waiting := false
	rc.Control(func(fd uintptr) {
		var hdr [proto.HeaderSize]byte
		n, _, err := unix.Recvfrom(int(fd), hdr[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		if err != nil || n < len(hdr) {
			return
		}
		queued, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		waiting = err == nil && int64(queued) >= proto.FrameSize(hdr[:])
	})
	return waiting
}

// conn is one peer's queue pair.
type conn struct {
	s    *Server
	c    net.Conn
	peer gate.Peer // for the gate's failure count
	r    *proto.Reader
	resp verbs.Responder
	log  *slog.Logger
	out  []byte // reply frames, reused
	// failed: an operation completed in error; the QP is in ERROR and
	// flushes everything after (IB spec; verbs-semantics.md §5).
	failed bool
}

func (s *Server) serve(c net.Conn, a *gate.Admission) {
	k := &conn{s: s, c: c, log: s.log.With("peer", c.RemoteAddr().String())}
	k.peer = a.Peer()
	release, detach, err := k.hello(a)
	if err != nil {
		s.gate.Log().EventTo(k.log, "hello", "remote: hello failed; connection closed", "err", err)
		return
	}
	defer release()
	defer detach()
	ops, err := k.loop()
	switch {
	case errors.Is(err, io.EOF):
		k.log.Debug("remote: peer disconnected", "ops", ops)
	case errors.Is(err, net.ErrClosed):
		k.log.Debug("remote: connection closed by mrfs (rmdir, unmount)", "ops", ops)
	default:
		s.gate.Log().EventTo(k.log, "ended", "remote: connection ended", "ops", ops, "err", err)
	}
}

// hello reads the peer's HELLO, finds its PD, takes a max_connections
// slot (the gate's second phase) and attaches the connection to the PD's
// domain, so that rmdir and unmount close it before the PD goes. A
// refusal is answered with HELLO_ERR and an errno.
func (k *conn) hello(a *gate.Admission) (release, detach func(), err error) {
	k.c.SetReadDeadline(time.Now().Add(k.s.p.Timeout))
	refuse := func(errno syscall.Errno, err error) (func(), func(), error) {
		k.send(proto.Frame{Type: proto.TypeHelloErr, Errno: uint32(errno), Msg: err.Error()})
		return nil, nil, err
	}
	// Read from the socket itself, no more than the hello: nothing of the
	// peer's beyond a hello-sized frame is read or allocated before its
	// token is checked, and what it sent behind the hello stays in the
	// socket for the reader made below.
	f, err := proto.ReadHello(k.c)
	var ve *proto.VersionError
	switch {
	case errors.As(err, &ve):
		// Not a failure: an mrfs of another version.
		return refuse(syscall.EPROTONOSUPPORT, fmt.Errorf("protocol version %d is not supported; this mrfs speaks %d", ve.Version, proto.Version))
	case errors.Is(err, os.ErrDeadlineExceeded):
		k.s.gate.Failed(k.peer, "hello_timeout")
		return nil, nil, fmt.Errorf("no hello within %s (remote.timeout): %w", k.s.p.Timeout, err)
	case errors.Is(err, proto.ErrProtocol):
		k.s.gate.Failed(k.peer, "hello")
		return nil, nil, fmt.Errorf("read hello: %w", err)
	case err != nil:
		// The peer went, or the gate closed the connection to make room
		// (and counted it).
		return nil, nil, fmt.Errorf("read hello: %w", err)
	}
	a.Heard()
	dom, err := k.s.gate.Resolve(k.peer, k.s.resolve, f.Path)
	if err != nil {
		return refuse(remote.Errno(err, syscall.ENOENT), err)
	}
	if err := k.s.gate.CheckToken(k.peer, f.Path, dom, f.Token); err != nil {
		return refuse(syscall.EACCES, err)
	}
	rp, ok := dom.VerbsPD().(verbs.ResponderPD)
	if !ok {
		return refuse(syscall.EOPNOTSUPP, fmt.Errorf("pd %q: the verbs backend cannot serve the soft transport", f.Path))
	}
	release, err = a.Accept()
	if err != nil {
		return refuse(remote.Errno(err, syscall.EBUSY), err)
	}
	detach, err = dom.Attach(k.c)
	if err != nil {
		release()
		return refuse(remote.Errno(err, syscall.ENOENT), fmt.Errorf("pd %q: %w", f.Path, err))
	}
	k.resp = rp.Responder()
	k.r = proto.NewReader(bufio.NewReaderSize(k.c, 64<<10), k.s.p.MaxMessage)
	if err := k.send(proto.Frame{Type: proto.TypeHelloOK, Version: proto.Version, PD: dom.PD(), MaxMessage: k.s.p.MaxMessage}); err != nil {
		detach()
		release()
		return nil, nil, err
	}
	k.log = k.log.With("pd", f.Path)
	k.log.Debug("remote: peer connected")
	return release, detach, nil
}

// loop runs operations until the peer goes or breaks the format.
func (k *conn) loop() (ops int, err error) {
	timeout := k.s.p.Timeout
	for {
		// Idle between frames is allowed (an RC QP may idle for ever);
		// once a frame starts it must arrive whole within the timeout.
		k.c.SetReadDeadline(time.Time{})
		f, err := k.r.NextStarted(func() { k.c.SetReadDeadline(time.Now().Add(timeout)) })
		if err != nil {
			return ops, err
		}
		if !f.Type.IsOp() {
			return ops, fmt.Errorf("%w: %s after the hello", proto.ErrProtocol, f.Type)
		}
		ops++
		if err := k.send(k.execute(f)); err != nil {
			return ops, err
		}
	}
}

// execute runs one operation and returns its completion.
func (k *conn) execute(f proto.Frame) proto.Frame {
	c := proto.Frame{Type: proto.TypeCompletion, WRID: f.WRID, Op: f.Type}
	if k.failed {
		c.Status = uint32(verbs.WCWRFlushErr)
		k.s.gate.Events().Completed(verbs.WCWRFlushErr)
		return c
	}
	var st verbs.WCStatus
	switch f.Type {
	case proto.TypeRead:
		if f.Length > k.s.p.MaxMessage {
			// Longer than the path's largest message: a length error,
			// which a responder NAKs as an invalid request.
			st = verbs.WCRemInvReqErr
			break
		}
		// The reader's body buffer: this frame's is no longer needed, and
		// the result is sent before the next frame is read. So a
		// connection holds one buffer of at most MaxMessage.
		c.Data = k.r.Scratch(int(f.Length))
		st = k.resp.Read(c.Data, f.IOVA, f.RKey)
	case proto.TypeWrite:
		st = k.resp.Write(f.IOVA, f.RKey, f.Data)
	case proto.TypeCAS:
		c.Old, st = k.resp.CompareSwap(f.IOVA, f.RKey, f.Compare, f.Swap)
	case proto.TypeFetchAdd:
		c.Old, st = k.resp.FetchAdd(f.IOVA, f.RKey, f.Add)
	}
	c.Status = uint32(st)
	k.s.gate.Events().Completed(st)
	if st == verbs.WCRemAccessErr {
		k.s.gate.Failed(k.peer, "access")
	}
	if st != verbs.WCSuccess {
		c.Data, c.Old = nil, 0
		k.failed = true
		k.log.Debug("remote: operation failed; queue pair in error", "op", f.Type, "iova", fmt.Sprintf("0x%x", f.IOVA),
			"rkey", fmt.Sprintf("0x%x", f.RKey), "status", st)
	}
	return c
}

// send writes one frame within the timeout; a READ result goes out from
// its own buffer, not copied behind the header.
func (k *conn) send(f proto.Frame) error {
	var err error
	k.out, err = proto.AppendPrefix(k.out[:0], f)
	if err != nil {
		return fmt.Errorf("encode %s: %w", f.Type, err)
	}
	k.c.SetWriteDeadline(time.Now().Add(k.s.p.Timeout))
	bufs := net.Buffers{k.out}
	if len(f.Data) > 0 {
		bufs = append(bufs, f.Data)
	}
	if _, err := bufs.WriteTo(k.c); err != nil {
		return fmt.Errorf("send %s: %w", f.Type, err)
	}
	return nil
}
