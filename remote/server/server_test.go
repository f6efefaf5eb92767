package server_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/remote"
	"mrfs/remote/client"
	"mrfs/remote/gate"
	"mrfs/remote/proto"
	"mrfs/remote/server"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

const remoteAll = verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic

type env struct {
	mgr  *buffer.Manager
	doms map[string]*buffer.Domain
	srv  *server.Server
	addr string
	log  *logBuffer // the server's log, at debug
}

// logBuffer is a log the test reads while the server writes it.
type logBuffer struct {
	mu  sync.Mutex // guards: buf
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// waitLog waits until the server's log holds n lines containing s.
func (e *env) waitLog(t *testing.T, s string, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); strings.Count(e.log.String(), s) < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the server never logged %d lines with %q:\n%s", n, s, e.log)
		}
	}
}

// setup serves two PDs, "/" and "/b", of a soft device on loopback.
func setup(t testing.TB, opt gate.Policy) *env {
	t.Helper()
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: remoteAll}, nil)
	e := &env{mgr: mgr, doms: map[string]*buffer.Domain{}, log: &logBuffer{}}
	for _, name := range []string{"/", "/b"} {
		d, err := mgr.NewDomain(remoteAll)
		if err != nil {
			t.Fatal(err)
		}
		e.doms[name] = d
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if opt.AllowFrom == nil {
		opt.AllowFrom = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	}
	if opt.MaxConns == 0 {
		opt.MaxConns = 8
	}
	if opt.MaxMessage == 0 {
		opt.MaxMessage = 1 << 20
	}
	if opt.Timeout == 0 {
		opt.Timeout = 5 * time.Second
	}
	e.addr = ln.Addr().String()
	e.srv = server.Serve(ln, opt, func(dir string) (*buffer.Domain, error) {
		if d, ok := e.doms[dir]; ok {
			return d, nil
		}
		return nil, syscall.ENOENT
	}, slog.New(slog.NewTextHandler(e.log, &slog.HandlerOptions{Level: slog.LevelDebug})))
	t.Cleanup(func() {
		e.srv.Close()
		mgr.Close()
		dev.Close()
	})
	return e
}

func (e *env) buffer(t *testing.T, dir string, size uint64) (*buffer.Buffer, buffer.Info) {
	t.Helper()
	b, err := e.mgr.Create(e.doms[dir], size, 0)
	if err != nil {
		t.Fatal(err)
	}
	return b, b.Info()
}

// tok is dir's token (the zero token for a directory that is not there).
func (e *env) tok(dir string) remote.Token {
	var t remote.Token
	if d, ok := e.doms[dir]; ok {
		t, _ = remote.ParseToken(d.Token())
	}
	return t
}

// dialErr dials dir once and returns the refusal, or nil when admitted
// (the connection is closed again).
func dialErr(e *env, dir string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, e.addr, dir, e.tok(dir))
	if err == nil {
		c.Close()
	}
	return err
}

func dial(t *testing.T, e *env, dir string) *client.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, e.addr, dir, e.tok(dir))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestOps(t *testing.T) {
	e := setup(t, gate.Policy{})
	b, info := e.buffer(t, "/", 8192)
	c := dial(t, e, "/")
	if c.PD() != e.doms["/"].PD() || c.MaxMessage() != 1<<20 {
		t.Errorf("PD %d, max message %d", c.PD(), c.MaxMessage())
	}
	iova, rkey := uint64(info.Addr), info.RKey
	if err := c.Write(iova+100, rkey, []byte("remote")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 6)
	if _, err := b.ReadAt(got, 100); err != nil || string(got) != "remote" {
		t.Errorf("buffer after WRITE: %q, %v", got, err)
	}
	b.WriteAt([]byte("local!"), 4000)
	if err := c.Read(got, iova+4000, rkey); err != nil || string(got) != "local!" {
		t.Errorf("READ: %q, %v", got, err)
	}
	if old, err := c.FetchAdd(iova+8, rkey, 5); err != nil || old != 0 {
		t.Errorf("FetchAdd: %d, %v", old, err)
	}
	if old, err := c.CompareSwap(iova+8, rkey, 5, 77); err != nil || old != 5 {
		t.Errorf("CompareSwap: %d, %v", old, err)
	}
	var w [8]byte
	b.ReadAt(w[:], 8)
	if v := binary.NativeEndian.Uint64(w[:]); v != 77 {
		t.Errorf("word = %d, want 77", v)
	}
	// Zero-length operations succeed whatever the key.
	if err := c.Write(0, 0, nil); err != nil {
		t.Errorf("zero-length WRITE: %v", err)
	}
	// Too long for the path: the requester refuses, nothing is sent and
	// the connection stays usable.
	if err := c.Write(iova, rkey, make([]byte, 1<<20+1)); remote.Status(err) != verbs.WCLocLenErr {
		t.Errorf("WRITE past max message: %v", err)
	}
	if err := c.Read(got, iova, rkey); err != nil {
		t.Errorf("READ after a local length error: %v", err)
	}
}

// After an error the connection is an RC QP in ERROR: later operations
// are flushed, even valid ones; a new connection works.
func TestErrorStateFlushes(t *testing.T) {
	e := setup(t, gate.Policy{})
	_, info := e.buffer(t, "/", 4096)
	_, other := e.buffer(t, "/b", 4096)
	c := dial(t, e, "/")
	if err := c.Write(uint64(other.Addr), other.RKey, []byte("x")); remote.Status(err) != verbs.WCRemAccessErr {
		t.Fatalf("WRITE into another PD's buffer: %v, want REM_ACCESS_ERR", err)
	}
	var se *remote.StatusError
	if err := c.Write(uint64(info.Addr), info.RKey, []byte("x")); !errors.As(err, &se) || se.Status != verbs.WCWRFlushErr {
		t.Errorf("valid WRITE after the error: %v, want WR_FLUSH_ERR", err)
	}
	if _, err := c.FetchAdd(uint64(info.Addr)+1, info.RKey, 1); remote.Status(err) != verbs.WCWRFlushErr {
		t.Errorf("FADD after the error: %v, want WR_FLUSH_ERR", err)
	}
	c2 := dial(t, e, "/")
	if _, err := c2.FetchAdd(uint64(info.Addr)+4, info.RKey, 1); remote.Status(err) != verbs.WCRemInvReqErr {
		t.Errorf("misaligned FADD: %v, want REM_INV_REQ_ERR", err)
	}
	c3 := dial(t, e, "/")
	if err := c3.Write(uint64(info.Addr), info.RKey, []byte("x")); err != nil {
		t.Errorf("WRITE on a new connection: %v", err)
	}
}

func TestHelloRefused(t *testing.T) {
	e := setup(t, gate.Policy{})
	ctx := context.Background()
	if _, err := client.Dial(ctx, e.addr, "/nope", e.tok("/nope")); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Dial of a missing directory: %v, want ENOENT", err)
	}
	// A version this server does not speak.
	nc, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	b, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: 99, Path: "/"})
	nc.Write(b)
	f, err := proto.NewReader(nc, 0).Next()
	if err != nil || f.Type != proto.TypeHelloErr || syscall.Errno(f.Errno) != syscall.EPROTONOSUPPORT {
		t.Errorf("hello version 99: %+v, %v; want HELLO_ERR EPROTONOSUPPORT", f, err)
	}
}

// rmdir (Domain.Close) closes the PD's connections before the PD goes.
func TestDomainCloseEndsConnections(t *testing.T) {
	e := setup(t, gate.Policy{})
	c := dial(t, e, "/b")
	if err := e.doms["/b"].Close(); err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.Write(0, 0, nil); err == nil || remote.Status(err) != verbs.WCWRFlushErr {
		t.Errorf("operation after the PD closed: %v, want a broken connection", err)
	}
}

func TestAllowFrom(t *testing.T) {
	e := setup(t, gate.Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	if err := dialErr(e, "/"); !errors.Is(err, syscall.EACCES) {
		t.Errorf("a loopback peer with allow_from = 10.0.0.0/8: %v, want a refusal with EACCES", err)
	}
}

func TestMaxConnections(t *testing.T) {
	e := setup(t, gate.Policy{MaxConns: 1})
	c := dial(t, e, "/")
	if err := dialErr(e, "/"); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("a second peer with max_connections = 1: %v, want a refusal with EBUSY", err)
	}
	c.Close()
	// The slot frees once the server sees the close.
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := dialErr(e, "/")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the slot never freed: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Hostile peers end their own connection only; a good peer keeps working.
func TestHostilePeers(t *testing.T) {
	e := setup(t, gate.Policy{Timeout: 300 * time.Millisecond, MaxMessage: 4096})
	_, info := e.buffer(t, "/", 4096)
	good := dial(t, e, "/")
	hello, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: proto.Version, Path: "/", Token: e.tok("/")})
	write, _ := proto.Append(nil, proto.Frame{Type: proto.TypeWrite, IOVA: uint64(info.Addr), RKey: info.RKey, Data: []byte("evil")})
	huge := append([]byte{byte(proto.TypeWrite), 0, 0, 0, 0xff, 0xff, 0xff, 0xff}, make([]byte, 8)...)
	unknown := append([]byte{0x7e, 0, 0, 0, 0, 0, 0, 0}, make([]byte, 8)...)
	readTooLong, _ := proto.Append(nil, proto.Frame{Type: proto.TypeRead, IOVA: uint64(info.Addr), RKey: info.RKey, Length: 4097})
	for _, c := range []struct {
		name  string
		send  []byte
		trick func(nc net.Conn) // after send
	}{
		{"no hello, garbage", []byte("GET / HTTP/1.1\r\n\r\n"), nil},
		{"truncated frame", append(hello, write[:len(write)-2]...), nil},
		{"4 GiB length", append(hello, huge...), nil},
		{"unknown op", append(hello, unknown...), nil},
		{"second hello", append(hello, hello...), nil},
		{"silent after connect", nil, nil},
		{"slowloris", hello, func(nc net.Conn) {
			for i := range write {
				if _, err := nc.Write(write[i : i+1]); err != nil {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}},
	} {
		nc, err := net.Dial("tcp", e.addr)
		if err != nil {
			t.Fatal(err)
		}
		nc.Write(c.send)
		if c.trick != nil {
			go c.trick(nc)
		}
		// The server ends the connection: we read EOF (or a reset) well
		// before our own deadline.
		nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		start := time.Now()
		_, err = io.Copy(io.Discard, nc)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Errorf("%s: the server kept the connection open", c.name)
		}
		nc.Close()
		t.Logf("%s: closed after %v", c.name, time.Since(start).Round(time.Millisecond))
		if err := good.Write(uint64(info.Addr), info.RKey, []byte("good")); err != nil {
			t.Fatalf("after %s: the good peer failed: %v", c.name, err)
		}
	}
	// A READ longer than the max message size is a length error, not a
	// broken frame: REM_INV_REQ_ERR, and the QP is in error.
	nc, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.Write(append(hello, readTooLong...))
	r := proto.NewReader(nc, 4096)
	nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	if f, err := r.Next(); err != nil || f.Type != proto.TypeHelloOK {
		t.Fatalf("hello: %+v %v", f, err)
	}
	if f, err := r.Next(); err != nil || verbs.WCStatus(f.Status) != verbs.WCRemInvReqErr {
		t.Errorf("READ of 4097 with max 4096: %+v %v, want REM_INV_REQ_ERR", f, err)
	}
	got := make([]byte, 4)
	if err := good.Read(got, uint64(info.Addr), info.RKey); err != nil || !bytes.Equal(got, []byte("good")) {
		t.Errorf("good peer READ: %q %v", got, err)
	}
}

// A peer whose operations keep failing with REM_ACCESS_ERR (guessing
// rkeys) gets its source refused for a while, even with the right token.
func TestAccessErrorsRefuseTheSource(t *testing.T) {
	e := setup(t, gate.Policy{FailLimit: 3, FailBlock: time.Minute})
	_, info := e.buffer(t, "/", 4096)
	for i := range 3 {
		c := dial(t, e, "/")
		if err := c.Write(uint64(info.Addr), info.RKey^uint32(i+1)<<8, []byte("x")); remote.Status(err) != verbs.WCRemAccessErr {
			t.Fatalf("a guessed rkey: %v, want REM_ACCESS_ERR", err)
		}
	}
	if err := dialErr(e, "/"); !errors.Is(err, syscall.EACCES) {
		t.Errorf("after 3 access errors: %v, want a refusal with EACCES", err)
	}
}

// The first frame is read up to the size of the largest HELLO: a WRITE
// announcing max_message_size before any hello costs the daemon nothing
// of that size (the connection ends at its header).
func TestFirstFrameReadToAHelloAtMost(t *testing.T) {
	const body = 16 << 20
	e := setup(t, gate.Policy{MaxMessage: body, Timeout: 300 * time.Millisecond})
	header := binary.BigEndian.AppendUint32([]byte{byte(proto.TypeWrite), 0, 0, 0}, 16+body)
	header = append(header, make([]byte, 8)...)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 4 {
		nc, err := net.Dial("tcp", e.addr)
		if err != nil {
			t.Fatal(err)
		}
		nc.Write(header)
		nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, nc); err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("the daemon did not end the connection: %v", err)
		}
		nc.Close()
	}
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n >= body {
		t.Errorf("4 first frames announcing %d-byte WRITEs made the server allocate %d bytes", body, n)
	}
}

// Frames a peer sends right behind its hello, in the same segment, are
// served: the hello is read alone, and the connection's reader gets the
// rest.
func TestHelloPipelined(t *testing.T) {
	e := setup(t, gate.Policy{})
	b, info := e.buffer(t, "/", 4096)
	b.WriteAt([]byte("before"), 100)
	var wire []byte
	for _, f := range []proto.Frame{
		{Type: proto.TypeHello, Version: proto.Version, Path: "/", Token: e.tok("/")},
		{Type: proto.TypeRead, WRID: 1, IOVA: uint64(info.Addr) + 100, RKey: info.RKey, Length: 6},
		{Type: proto.TypeWrite, WRID: 2, IOVA: uint64(info.Addr) + 100, RKey: info.RKey, Data: []byte("after!")},
		{Type: proto.TypeRead, WRID: 3, IOVA: uint64(info.Addr) + 100, RKey: info.RKey, Length: 6},
	} {
		wire, _ = proto.Append(wire, f)
	}
	nc, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Write(wire); err != nil {
		t.Fatal(err)
	}
	nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	r := proto.NewReader(nc, 1<<20)
	want := []string{"HELLO_OK", "1 before", "2 ", "3 after!"}
	for i, w := range want {
		f, err := r.Next()
		got := f.Type.String()
		if f.Type == proto.TypeCompletion {
			got = fmt.Sprintf("%d %s", f.WRID, f.Data)
		}
		if err != nil || got != w || f.Status != 0 {
			t.Fatalf("reply %d: %q (status %d), %v; want %q", i, got, f.Status, err, w)
		}
	}
}

// What a peer does wrong before its hello is accepted counts against its
// source, as a wrong token does: hellos that do not come in time, first
// frames that are not a HELLO or break the format, directories that are
// not there. A HELLO of another version (an mrfs peer) and a connection
// closed before saying anything do not count.
func TestHelloFailuresCount(t *testing.T) {
	raw := func(t *testing.T, e *env, send []byte) {
		nc, err := net.Dial("tcp", e.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		nc.Write(send)
		nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, nc); err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("the server kept the connection: %v", err)
		}
	}
	v99, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: 99, Path: "/"})
	read, _ := proto.Append(nil, proto.Frame{Type: proto.TypeRead, Length: 8})
	for _, c := range []struct {
		name   string
		fail   func(t *testing.T, e *env)
		counts bool
	}{
		{"a hello that does not come in time", func(t *testing.T, e *env) { raw(t, e, nil) }, true},
		{"half a hello in time", func(t *testing.T, e *env) { raw(t, e, []byte{byte(proto.TypeHello), 0, 0}) }, true},
		{"a first frame that is not a HELLO", func(t *testing.T, e *env) { raw(t, e, read) }, true},
		{"garbage", func(t *testing.T, e *env) { raw(t, e, []byte("GET / HTTP/1.1\r\n\r\n")) }, true},
		{"a directory that is not there", func(t *testing.T, e *env) {
			if err := dialErr(e, "/nope"); !errors.Is(err, syscall.ENOENT) {
				t.Errorf("dial /nope: %v, want ENOENT", err)
			}
		}, true},
		{"another version", func(t *testing.T, e *env) { raw(t, e, v99) }, false},
		{"closed at once", func(t *testing.T, e *env) {
			nc, err := net.Dial("tcp", e.addr)
			if err != nil {
				t.Fatal(err)
			}
			nc.Close()
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := setup(t, gate.Policy{FailLimit: 2, Timeout: 200 * time.Millisecond})
			c.fail(t, e)
			c.fail(t, e)
			e.waitLog(t, "hello failed", 2)
			err := dialErr(e, "/")
			if !c.counts {
				if err != nil {
					t.Errorf("after two: %v, want admitted", err)
				}
				return
			}
			if !errors.Is(err, syscall.EACCES) {
				t.Errorf("after two: %v, want a refusal with EACCES", err)
			}
		})
	}
}
