// Package remotetest is the admission table every remote transport must
// pass: the same cases with the same errnos on the soft TCP listener
// (remote/server's tests) and on rdma_cm (the Soft-RoCE guest, tests/vm),
// so that the transports cannot disagree about who gets a queue pair.
package remotetest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/remote"
	"mrfs/remote/gate"
	"mrfs/verbs"
)

// Transport is what the table needs of a transport.
type Transport struct {
	// Listen serves p on a fresh listener whose peers are resolved by
	// resolve, and returns the address to dial; the listener closes at
	// the test's cleanup.
	Listen func(t *testing.T, p gate.Policy, resolve gate.Resolver) string
	// Dial connects to addr and asks for the PD of dir with tok.
	Dial func(ctx context.Context, addr, dir string, tok remote.Token) (remote.Conn, error)
	// Idle connects to addr and says nothing: a connection still owing
	// its hello. Nil for a transport whose connection brings its hello
	// whole (rdma_cm's connect request), which has no such state.
	Idle func(t *testing.T, addr string) net.Conn
	// Peer is the address the listener sees this process dial from.
	Peer netip.Addr
	// Domain is a PD of the transport's device: the resolver's "/".
	Domain *buffer.Domain
}

// RunAdmission runs the table.
func RunAdmission(t *testing.T, tr Transport) {
	resolve := func(dir string) (*buffer.Domain, error) {
		switch dir {
		case "/":
			return tr.Domain, nil
		case "/file":
			return nil, fmt.Errorf("%q is not a directory: %w", dir, syscall.ENOTDIR)
		}
		return nil, fmt.Errorf("no directory %q: %w", dir, syscall.ENOENT)
	}
	self := netip.PrefixFrom(tr.Peer, tr.Peer.BitLen())
	other := netip.MustParsePrefix("192.0.2.0/24") // TEST-NET-1: never the peer
	policy := func(max int, allow ...netip.Prefix) gate.Policy {
		return gate.Policy{AllowFrom: allow, MaxConns: max, MaxMessage: 1 << 20, Timeout: 5 * time.Second}
	}
	good, err := remote.ParseToken(tr.Domain.Token())
	if err != nil {
		t.Fatal(err)
	}
	bad := good
	bad[0] ^= 1
	for _, c := range []struct {
		name string
		p    gate.Policy
		dir  string
		tok  remote.Token
		want syscall.Errno // 0: admitted
	}{
		{"allow_from empty admits nobody", policy(4), "/", good, syscall.EACCES},
		{"peer outside allow_from", policy(4, other), "/", good, syscall.EACCES},
		{"peer inside allow_from", policy(4, other, self), "/", good, 0},
		{"no such directory", policy(4, self), "/nope", good, syscall.ENOENT},
		{"not a directory", policy(4, self), "/file", good, syscall.ENOTDIR},
		{"wrong token", policy(4, self), "/", bad, syscall.EACCES},
		{"no token", policy(4, self), "/", remote.Token{}, syscall.EACCES},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr := tr.Listen(t, c.p, resolve)
			err := dialOnce(t, tr, addr, c.dir, c.tok)
			wantRefusal(t, err, c.want)
		})
	}

	// A source that keeps presenting wrong tokens is refused for a
	// while, even with the right one; then admitted again.
	t.Run("a source that keeps failing", func(t *testing.T) {
		p := policy(4, self)
		p.FailLimit, p.FailBlock = 3, 2*time.Second
		addr := tr.Listen(t, p, resolve)
		for range p.FailLimit {
			wantRefusal(t, dialOnce(t, tr, addr, "/", bad), syscall.EACCES)
		}
		blocked := time.Now()
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EACCES)
		time.Sleep(time.Until(blocked.Add(p.FailBlock)))
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), 0)
	})

	// Directories that are not there count as failures too: names are
	// probed no faster than tokens are guessed.
	t.Run("a source that keeps naming directories that are not there", func(t *testing.T) {
		p := policy(4, self)
		p.FailLimit = 3
		addr := tr.Listen(t, p, resolve)
		for _, c := range []struct {
			dir  string
			want syscall.Errno
		}{{"/nope", syscall.ENOENT}, {"/file", syscall.ENOTDIR}, {"/nope", syscall.ENOENT}} {
			wantRefusal(t, dialOnce(t, tr, addr, c.dir, good), c.want)
		}
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EACCES)
	})

	t.Run("max_connections", func(t *testing.T) {
		addr := tr.Listen(t, policy(1, self), resolve)
		first := dial(t, tr, addr, "/", good)
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EBUSY)
		first.Close()
		// The slot frees once the listener sees the close.
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := dialOnce(t, tr, addr, "/", good)
			if err == nil {
				break
			}
			if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
				t.Fatalf("after the first peer left: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})

	// Connections still saying hello are bounded apart from
	// max_connections: idle sockets cannot keep peers out.
	t.Run("connections saying hello take no max_connections slot", func(t *testing.T) {
		p := policy(1, self)
		p.MaxPending = 4
		addr := tr.Listen(t, p, resolve)
		idle(t, tr, addr)
		idle(t, tr, addr)
		idle(t, tr, addr)
		first := dial(t, tr, addr, "/", good)
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EBUSY)
		first.Close()
	})

	t.Run("the oldest connection saying hello makes room, a failure of its source", func(t *testing.T) {
		p := policy(4, self)
		p.MaxPending, p.FailLimit, p.Timeout = 2, 2, time.Minute
		addr := tr.Listen(t, p, resolve)
		oldest := idle(t, tr, addr)
		idle(t, tr, addr)
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), 0)
		wantClosed(t, oldest)
		idle(t, tr, addr)
		idle(t, tr, addr) // makes room again: the second failure
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EACCES)
	})

	t.Run("a hello that does not come in time is a failure", func(t *testing.T) {
		p := policy(4, self)
		p.FailLimit, p.Timeout = 2, 300*time.Millisecond
		addr := tr.Listen(t, p, resolve)
		for range p.FailLimit {
			wantClosed(t, idle(t, tr, addr))
		}
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EACCES)
	})

	t.Run("still mounting", func(t *testing.T) {
		var pending gate.Pending
		addr := tr.Listen(t, policy(4, self), pending.Resolve)
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), syscall.EAGAIN)
		pending.Set(resolve)
		wantRefusal(t, dialOnce(t, tr, addr, "/", good), 0)
	})
}

// dial connects and fails the test unless admitted; the connection
// closes at cleanup.
func dial(t *testing.T, tr Transport, addr, dir string, tok remote.Token) remote.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := tr.Dial(ctx, addr, dir, tok)
	if err != nil {
		t.Fatalf("dial %s for %s: %v", addr, dir, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// idle opens a connection that says nothing, or skips the test on a
// transport without a hello phase; it closes at cleanup.
func idle(t *testing.T, tr Transport, addr string) net.Conn {
	t.Helper()
	if tr.Idle == nil {
		t.Skip("the transport's connect request brings its hello whole: no connection waits to say it")
	}
	c := tr.Idle(t, addr)
	t.Cleanup(func() { c.Close() })
	return c
}

// wantClosed requires the listener to close c (long before the 20 s the
// test waits; the policies' timeouts are a minute where that matters).
func wantClosed(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	_, err := io.Copy(io.Discard, c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("the listener kept a connection it should have closed")
	}
}

// dialOnce connects and, when admitted, proves the connection is a real
// queue pair in the PD (a WRITE with a key nothing has completes with
// REM_ACCESS_ERR) and closes it.
func dialOnce(t *testing.T, tr Transport, addr, dir string, tok remote.Token) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := tr.Dial(ctx, addr, dir, tok)
	if err != nil {
		return err
	}
	defer c.Close()
	if st := remote.Status(c.Write(0x1000, 0xdead00, []byte("x"))); st != verbs.WCRemAccessErr {
		t.Errorf("an admitted peer's WRITE with a made-up key: %v, want IBV_WC_REM_ACCESS_ERR", st)
	}
	return nil
}

// wantRefusal requires err to be mrfs's refusal with errno want, or nil
// when want is 0.
func wantRefusal(t *testing.T, err error, want syscall.Errno) {
	t.Helper()
	var re *remote.RefusedError
	switch {
	case want == 0 && err != nil:
		t.Errorf("refused: %v; want admitted", err)
	case want != 0 && err == nil:
		t.Errorf("admitted; want refused with %s", want)
	case want != 0 && (!errors.As(err, &re) || re.Errno != want):
		t.Errorf("%v; want mrfs's refusal with %s", err, want)
	}
}
