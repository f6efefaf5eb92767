// Package client is the requester side of mrfs's soft remote transport,
// for programs and scripts (`mrfs remote`): Dial a peer running mrfs,
// name a directory (its protection domain), then READ, WRITE,
// COMPARE_AND_SWAP and FETCH_AND_ADD at (addr, rkey) as read from the
// buffer's xattrs. A Conn is a remote.Conn: an operation that completes
// in error returns a *remote.StatusError carrying the ibv_wc_status a
// real requester would see, and a refused hello a *remote.RefusedError.
//
//	tok, err := remote.ParseToken(token) // user.mrfs.token of the directory
//	c, err := client.Dial(ctx, "127.0.0.1:7471", "/", tok)
//	err = c.Write(addr, rkey, data)
//	if remote.Status(err) == verbs.WCRemAccessErr { ... }
//
// As on an RC queue pair, the first error puts the connection in the
// error state: every later operation fails with IBV_WC_WR_FLUSH_ERR.
// Dial again to start over. A Conn runs one operation at a time; it is
// safe for concurrent use, which serializes.
package client

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"mrfs/remote"
	"mrfs/remote/proto"
	"mrfs/verbs"
)

// Conn is a connection to one PD of a peer.
type Conn struct {
	c      net.Conn
	pd     uint32
	maxMsg uint32

	// guards: r, out, wrid, broken, and the connection's byte stream.
	mu     sync.Mutex
	r      *proto.Reader
	out    []byte
	wrid   uint64
	broken error // a transport or protocol failure: the stream is out of step
}

// Dial connects to peer (host:port) and asks for a queue pair in the PD
// of dir, a directory of the peer's mount ("/" is its root), presenting
// tok, that directory's user.mrfs.token. ctx bounds the connect and the
// hello.
func Dial(ctx context.Context, peer, dir string, tok remote.Token) (*Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "tcp", peer)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", peer, err)
	}
	c, err := handshake(ctx, nc, dir, tok)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("hello to %s for %q: %w", peer, dir, err)
	}
	return c, nil
}

func handshake(ctx context.Context, nc net.Conn, dir string, tok remote.Token) (*Conn, error) {
	if dl, ok := ctx.Deadline(); ok {
		nc.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	b, err := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: proto.Version, Path: dir, Token: tok})
	if err != nil {
		return nil, err
	}
	if _, err := nc.Write(b); err != nil {
		return nil, err
	}
	// Until HELLO_OK says otherwise, accept only small frames.
	r := proto.NewReader(bufio.NewReaderSize(nc, 64<<10), 0)
	f, err := r.Next()
	if err != nil {
		return nil, err
	}
	switch f.Type {
	case proto.TypeHelloOK:
	case proto.TypeHelloErr:
		return nil, &remote.RefusedError{Errno: syscall.Errno(f.Errno), Msg: f.Msg}
	default:
		return nil, fmt.Errorf("%w: answer to HELLO is %s", proto.ErrProtocol, f.Type)
	}
	if f.Version != proto.Version {
		return nil, fmt.Errorf("%w: peer answered with version %d, want %d", proto.ErrProtocol, f.Version, proto.Version)
	}
	r.SetMaxMessage(f.MaxMessage)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	nc.SetDeadline(time.Time{})
	return &Conn{c: nc, r: r, pd: f.PD, maxMsg: f.MaxMessage}, nil
}

// PD is the peer's number of the protection domain (user.mrfs.pd).
func (c *Conn) PD() uint32 { return c.pd }

var _ remote.Conn = (*Conn)(nil)

// MaxMessage is the largest READ or WRITE the peer accepts.
func (c *Conn) MaxMessage() uint32 { return c.maxMsg }

// SetDeadline bounds the operations in progress and later ones, as
// net.Conn.SetDeadline does. A deadline that passes breaks the Conn.
func (c *Conn) SetDeadline(t time.Time) error { return c.c.SetDeadline(t) }

// Close closes the connection.
func (c *Conn) Close() error { return c.c.Close() }

// Read reads len(dst) bytes at iova of the region rkey names into dst.
func (c *Conn) Read(dst []byte, iova uint64, rkey uint32) error {
	if uint64(len(dst)) > uint64(c.maxMsg) {
		// The requester's own check: longer than the path's largest
		// message, never sent.
		return &remote.StatusError{Op: "READ", Status: verbs.WCLocLenErr}
	}
	f, err := c.do(proto.Frame{Type: proto.TypeRead, IOVA: iova, RKey: rkey, Length: uint32(len(dst))}, func(f proto.Frame) error {
		if f.Status == 0 && len(f.Data) != len(dst) {
			return fmt.Errorf("%w: READ of %d bytes returned %d", proto.ErrProtocol, len(dst), len(f.Data))
		}
		copy(dst, f.Data)
		return nil
	})
	if err != nil {
		return err
	}
	return statusErr(f)
}

// Write writes src at iova of the region rkey names.
func (c *Conn) Write(iova uint64, rkey uint32, src []byte) error {
	if uint64(len(src)) > uint64(c.maxMsg) {
		return &remote.StatusError{Op: "WRITE", Status: verbs.WCLocLenErr}
	}
	f, err := c.do(proto.Frame{Type: proto.TypeWrite, IOVA: iova, RKey: rkey, Data: src}, nil)
	if err != nil {
		return err
	}
	return statusErr(f)
}

// CompareSwap atomically replaces the 8-byte word at iova (8-byte
// aligned) with swap if it equals compare, and returns the old value.
func (c *Conn) CompareSwap(iova uint64, rkey uint32, compare, swap uint64) (uint64, error) {
	f, err := c.do(proto.Frame{Type: proto.TypeCAS, IOVA: iova, RKey: rkey, Compare: compare, Swap: swap}, nil)
	if err != nil {
		return 0, err
	}
	return f.Old, statusErr(f)
}

// FetchAdd atomically adds add to the 8-byte word at iova (8-byte
// aligned) and returns the old value.
func (c *Conn) FetchAdd(iova uint64, rkey uint32, add uint64) (uint64, error) {
	f, err := c.do(proto.Frame{Type: proto.TypeFetchAdd, IOVA: iova, RKey: rkey, Add: add}, nil)
	if err != nil {
		return 0, err
	}
	return f.Old, statusErr(f)
}

func statusErr(f proto.Frame) error {
	if f.Status == 0 {
		return nil
	}
	return &remote.StatusError{Op: f.Op.String(), Status: verbs.WCStatus(f.Status)}
}

// do sends one request and reads its completion; use, when set, consumes
// the completion's data before the next operation reuses the buffer.
func (c *Conn) do(req proto.Frame, use func(proto.Frame) error) (proto.Frame, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken != nil {
		return proto.Frame{}, c.broken
	}
	f, err := c.exchange(req, use)
	if err != nil {
		c.broken = fmt.Errorf("connection broken: %w", err)
		c.c.Close()
		return proto.Frame{}, fmt.Errorf("%s: %w", req.Type, err)
	}
	return f, nil
}

func (c *Conn) exchange(req proto.Frame, use func(proto.Frame) error) (proto.Frame, error) {
	c.wrid++
	req.WRID = c.wrid
	var err error
	c.out, err = proto.AppendPrefix(c.out[:0], req)
	if err != nil {
		return proto.Frame{}, err
	}
	bufs := net.Buffers{c.out}
	if len(req.Data) > 0 {
		bufs = append(bufs, req.Data)
	}
	if _, err := bufs.WriteTo(c.c); err != nil {
		return proto.Frame{}, err
	}
	f, err := c.r.Next()
	if err != nil {
		return proto.Frame{}, err
	}
	if f.Type != proto.TypeCompletion || f.WRID != req.WRID || f.Op != req.Type {
		return proto.Frame{}, fmt.Errorf("%w: got %s of %s wr_id %d, want the COMPLETION of %s wr_id %d",
			proto.ErrProtocol, f.Type, f.Op, f.WRID, req.Type, req.WRID)
	}
	if use != nil {
		if err := use(f); err != nil {
			return proto.Frame{}, err
		}
	}
	return f, nil
}
