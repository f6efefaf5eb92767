package remote

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
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
		release, err := NewGate(p, nil).Admit(c.peer)
		if c.want == 0 {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			} else {
				release()
			}
		} else if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %s", c.name, err, c.want)
		}
	}
}

func TestGateMaxConnsAndClose(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, MaxConns: 2}, nil)
	r1, err1 := g.Admit(lo)
	r2, err2 := g.Admit(lo)
	if err1 != nil || err2 != nil || g.Conns() != 2 {
		t.Fatalf("two admits: %v %v, conns %d", err1, err2, g.Conns())
	}
	if _, err := g.Admit(lo); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("third admit: %v, want EBUSY", err)
	}
	r1()
	r1() // release is idempotent: the slot is freed once
	if g.Conns() != 1 {
		t.Errorf("conns %d after one release", g.Conns())
	}
	r3, err := g.Admit(lo)
	if err != nil {
		t.Fatalf("admit after a release: %v", err)
	}
	if _, err := g.Admit(lo); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("admit past max again: %v, want EBUSY", err)
	}
	r2()
	r3()
	g.Close()
	if _, err := g.Admit(lo); !errors.Is(err, syscall.ESHUTDOWN) {
		t.Errorf("admit after Close: %v, want ESHUTDOWN", err)
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
		if _, err := g.Resolve(peer, resolve, dir); err == nil || !strings.Contains(err.Error(), dir) {
			t.Fatalf("Resolve %s: %v, want its error naming it", dir, err)
		}
	}
	if _, err := g.Admit(peer); err != nil {
		t.Fatalf("after two missing directories and three still mounting: %v", err)
	}
	if _, err := g.Resolve(peer, resolve, "/b"); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Resolve /b: %v, want ENOENT", err)
	}
	if _, err := g.Admit(netip.MustParseAddr("10.0.0.6")); !errors.Is(err, syscall.EACCES) {
		t.Errorf("after three missing directories: %v, want EACCES", err)
	}
}
