package gate

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"

	"mrfs/buffer"
)

func TestGate(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	for _, c := range []struct {
		name  string
		allow []string
		peer  netip.Addr
		want  syscall.Errno
	}{
		{"empty allow_from admits nobody", nil, lo, syscall.EACCES},
		{"empty list, IPv6", []string{}, netip.MustParseAddr("::1"), syscall.EACCES},
		{"another network", []string{"10.0.0.0/8"}, lo, syscall.EACCES},
		{"in the network", []string{"10.0.0.0/8", "127.0.0.0/8"}, lo, 0},
		{"IPv4-mapped IPv6 peer", []string{"127.0.0.0/8"}, netip.MustParseAddr("::ffff:127.0.0.1"), 0},
		{"a host", []string{"192.168.1.7/32"}, netip.MustParseAddr("192.168.1.8"), syscall.EACCES},
	} {
		var p Policy
		for _, s := range c.allow {
			p.AllowFrom = append(p.AllowFrom, netip.MustParsePrefix(s))
		}
		p.MaxConns = 1
		_, err := NewGate(p, nil).Admit(peerAt(c.peer), nil)
		if c.want == 0 {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
		} else if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %s", c.name, err, c.want)
		}
	}
}

// accept takes a connection from peer through both phases.
func accept(g *Gate, peer netip.Addr) (release func(), err error) {
	a, err := g.Admit(peerAt(peer), nil)
	if err != nil {
		return nil, err
	}
	defer a.Done()
	return a.Accept()
}

func TestGateMaxConnsAndClose(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, MaxConns: 2}, nil)
	r1, err1 := accept(g, lo)
	r2, err2 := accept(g, lo)
	if err1 != nil || err2 != nil || g.Conns() != 2 || g.Pending() != 0 {
		t.Fatalf("two accepts: %v %v, conns %d, pending %d", err1, err2, g.Conns(), g.Pending())
	}
	if _, err := g.Admit(peerAt(lo), nil); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("third admit: %v, want EBUSY", err)
	}
	r1()
	r1() // release is idempotent: the slot is freed once
	if g.Conns() != 1 {
		t.Errorf("conns %d after one release", g.Conns())
	}
	r3, err := accept(g, lo)
	if err != nil {
		t.Fatalf("accept after a release: %v", err)
	}
	if _, err := g.Admit(peerAt(lo), nil); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("admit past max again: %v, want EBUSY", err)
	}
	r2()
	r3()
	g.Close()
	if _, err := g.Admit(peerAt(lo), nil); !errors.Is(err, syscall.ESHUTDOWN) {
		t.Errorf("admit after Close: %v, want ESHUTDOWN", err)
	}
}

// fakeConn is a pending connection that records its closing.
type fakeConn struct {
	n       int
	closed  *[]int
	waiting bool // its hello has arrived whole
}

func (c *fakeConn) HelloWaiting() bool { return c.waiting }
func (c *fakeConn) Close() error {
	*c.closed = append(*c.closed, c.n)
	return nil
}

// Connections still saying hello take no max_connections slot: they are
// bounded apart, and past that bound the oldest is closed to make room,
// which counts as a failure of its source. Only an accepted hello takes a
// slot, and is told EBUSY if they filled meanwhile.
func TestGateTwoPhases(t *testing.T) {
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MaxConns: 1, MaxPending: 2, FailLimit: 2}, nil)
	idle, good := netip.MustParseAddr("10.0.7.1"), netip.MustParseAddr("10.0.0.1")
	var closed []int
	admit := func(peer netip.Addr, n int) *Admission {
		t.Helper()
		a, err := g.Admit(peerAt(peer), &fakeConn{n: n, closed: &closed})
		if err != nil {
			t.Fatalf("admit %d: %v", n, err)
		}
		return a
	}
	a1, a2 := admit(idle, 1), admit(idle, 2)
	a3 := admit(good, 3)
	if len(closed) != 1 || closed[0] != 1 || g.Pending() != 2 || g.Conns() != 0 {
		t.Fatalf("a third connection saying hello with 2 allowed: closed %v, pending %d, conns %d; want 1 closed (the oldest), 2, 0", closed, g.Pending(), g.Conns())
	}
	if _, err := a1.Accept(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("the closed one's hello: %v, want EBUSY", err)
	}
	a1.Done()
	release, err := a3.Accept()
	if err != nil || g.Conns() != 1 || g.Pending() != 1 {
		t.Fatalf("accept: %v, conns %d, pending %d", err, g.Conns(), g.Pending())
	}
	a3.Done() // leaves the slot alone
	if g.Conns() != 1 {
		t.Errorf("Done after Accept gave the slot back")
	}
	if _, err := a2.Accept(); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("a hello accepted with every slot taken meanwhile: %v, want EBUSY", err)
	}
	if g.Pending() != 0 {
		t.Errorf("pending %d after every hello ended", g.Pending())
	}
	if _, err := g.Admit(peerAt(good), nil); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("a connection with every slot taken: %v, want EBUSY at once", err)
	}
	release()
	// One failure of 10.0.7.0/24 so far (1 closed); one more refuses it.
	admit(idle, 4)
	admit(idle, 5)
	admit(good, 6)
	if _, err := g.Admit(peerAt(idle), nil); !errors.Is(err, syscall.EACCES) {
		t.Errorf("after two of its connections were closed to make room: %v, want EACCES", err)
	}
	if len(closed) != 2 || closed[1] != 4 {
		t.Errorf("closed %v, want 1 and 4", closed)
	}
}

// To make room the gate closes the oldest connection whose hello has
// neither arrived whole nor been read, and the oldest only when every one
// has: a hello that waits for the CPU is not lost to a flood.
func TestGateMakesRoomWithTheIdle(t *testing.T) {
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MaxConns: 8, MaxPending: 3}, nil)
	var closed []int
	admit := func(n int, waiting bool) *Admission {
		t.Helper()
		a, err := g.Admit(peerAt(netip.AddrFrom4([4]byte{10, 0, byte(n), 1})), &fakeConn{n: n, closed: &closed, waiting: waiting})
		if err != nil {
			t.Fatalf("admit %d: %v", n, err)
		}
		return a
	}
	admit(1, true)          // its hello waits in the socket
	admit(2, false).Heard() // its hello is being read
	admit(3, false)         // idle
	admit(4, false)
	admit(5, true)
	if want := []int{3, 4}; !slices.Equal(closed, want) {
		t.Errorf("closed %v, want %v: the idle ones, oldest first", closed, want)
	}
	admit(6, true)
	if want := []int{3, 4, 1}; !slices.Equal(closed, want) {
		t.Errorf("closed %v, want %v: the oldest, when every hello has arrived", closed, want)
	}
}

// A peer can cause refusals as fast as it opens sockets: only the first
// of a kind within peerLogEvery is logged at Info.
func TestPeerLogRateLimited(t *testing.T) {
	var out bytes.Buffer
	l := NewPeerLog(slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})))
	for range 100 {
		l.Event("allow_from", "refused")
	}
	l.Event("hello", "hello failed")
	text := out.String()
	if n := strings.Count(text, "level=INFO msg=refused"); n != 1 {
		t.Errorf("%d refusals at Info, want 1", n)
	}
	if n := strings.Count(text, "level=DEBUG msg=refused"); n != 99 {
		t.Errorf("%d refusals at Debug, want 99", n)
	}
	if !strings.Contains(text, "level=INFO msg=\"hello failed\"") {
		t.Error("another kind is not rate-limited by the first")
	}
}

func TestPending(t *testing.T) {
	var p Pending
	if _, err := p.Resolve("/"); !errors.Is(err, syscall.EAGAIN) {
		t.Errorf("before Set: %v, want EAGAIN", err)
	}
	p.Set(func(dir string) (*buffer.Domain, error) { return nil, syscall.ENOTDIR })
	if _, err := p.Resolve("/x"); !errors.Is(err, syscall.ENOTDIR) {
		t.Errorf("after Set: %v, want the resolver's ENOTDIR", err)
	}
}

// A directory that is not there counts as a failure of the peer's
// source network; one still mounting (EAGAIN) does not.
func TestGateResolveCountsMissingDirectories(t *testing.T) {
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MaxConns: 4, FailLimit: 3}, nil)
	resolve := func(dir string) (*buffer.Domain, error) {
		switch dir {
		case "/file":
			return nil, syscall.ENOTDIR
		case "/mounting":
			return nil, syscall.EAGAIN
		}
		return nil, fmt.Errorf("no directory %q: %w", dir, syscall.ENOENT)
	}
	peer := netip.MustParseAddr("10.0.0.5")
	for _, dir := range []string{"/mounting", "/mounting", "/mounting", "/a", "/file"} {
		if _, err := g.Resolve(peerAt(peer), resolve, dir); err == nil || !strings.Contains(err.Error(), dir) {
			t.Fatalf("Resolve %s: %v, want its error naming it", dir, err)
		}
	}
	if _, err := g.Admit(peerAt(peer), nil); err != nil {
		t.Fatalf("after two missing directories and three still mounting: %v", err)
	}
	if _, err := g.Resolve(peerAt(peer), resolve, "/b"); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Resolve /b: %v, want ENOENT", err)
	}
	if _, err := g.Admit(peerAt(netip.MustParseAddr("10.0.0.6")), nil); !errors.Is(err, syscall.EACCES) {
		t.Errorf("after three missing directories: %v, want EACCES", err)
	}
}

// peerAt is a peer known by its address alone (a remote one).
func peerAt(a netip.Addr) Peer { return Peer{Addr: a} }
