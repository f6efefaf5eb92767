package gate

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A source network that fails FailLimit times within the window is
// refused for FailBlock, every address of it, with one warn line a minute
// naming it; other networks are not; once the block ends it is admitted
// again.
func TestGateRefusesASourceThatKeepsFailing(t *testing.T) {
	var log bytes.Buffer
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MaxConns: 8,
		FailLimit: 3, FailBlock: 300 * time.Millisecond}, slog.New(slog.NewTextHandler(&log, nil)))
	bad, neighbour, good := netip.MustParseAddr("10.0.0.9"), netip.MustParseAddr("10.0.0.10"), netip.MustParseAddr("10.0.1.10")
	admit := func(peer netip.Addr) error {
		a, err := g.Admit(peerAt(peer), nil)
		if err == nil {
			a.Done()
		}
		return err
	}
	for i := range 2 {
		g.Failed(peerAt(bad), "token")
		if err := admit(bad); err != nil {
			t.Fatalf("after %d failures: %v", i+1, err)
		}
	}
	g.Failed(peerAt(bad), "token")
	blocked := time.Now()
	for _, peer := range []netip.Addr{bad, neighbour, bad} {
		if err := admit(peer); !errors.Is(err, syscall.EACCES) || !strings.Contains(err.Error(), "10.0.0.0/24") {
			t.Fatalf("%s after 3 failures of 10.0.0.0/24: %v, want EACCES naming the network", peer, err)
		}
	}
	if err := admit(good); err != nil {
		t.Errorf("another network: %v", err)
	}
	if n := strings.Count(log.String(), "level=WARN"); n != 1 || !strings.Contains(log.String(), "peer=10.0.0.9 network=10.0.0.0/24") {
		t.Errorf("want one warn line naming 10.0.0.9 and 10.0.0.0/24, got:\n%s", log.String())
	}
	time.Sleep(time.Until(blocked.Add(300 * time.Millisecond)))
	if err := admit(bad); err != nil {
		t.Errorf("after the block: %v", err)
	}
}

// Failures older than the window do not add up.
func TestFailuresWindow(t *testing.T) {
	f := newFailures(Policy{FailLimit: 3, FailWindow: time.Minute})
	a := netip.MustParseAddr("10.0.0.1")
	t0 := time.Now()
	f.failed(peerAt(a), t0)
	f.failed(peerAt(a), t0.Add(30*time.Second))
	if f.failed(peerAt(a), t0.Add(61*time.Second)).refused {
		t.Error("refused for failures spread over more than the window")
	}
	if !f.failed(peerAt(a), t0.Add(62*time.Second)).refused {
		t.Error("not refused for 3 failures within the window")
	}
}

// Failures count per network: an IPv4 /24 and an IPv6 /64 by default,
// an IPv4-mapped IPv6 address as its IPv4 address, and other prefix
// lengths when configured.
func TestFailuresPerNetwork(t *testing.T) {
	addr := netip.MustParseAddr
	for _, c := range []struct {
		name       string
		v4, v6     int
		fail       []string // one failure each, limit len(fail)
		refused    []string
		notRefused []string
	}{
		{"IPv4 /24", 0, 0, []string{"127.3.4.5", "127.3.4.6", "127.3.4.250"}, []string{"127.3.4.1", "::ffff:127.3.4.9"}, []string{"127.3.5.5", "127.0.0.1"}},
		{"IPv6 /64", 0, 0, []string{"2001:db8::1", "2001:db8::2:0:0:1", "2001:db8::ffff:ffff:ffff:ffff"}, []string{"2001:db8::9"}, []string{"2001:db8:0:1::1", "::1"}},
		{"IPv4-mapped unmapped first", 0, 0, []string{"::ffff:10.1.2.3", "10.1.2.4", "::ffff:10.1.2.5"}, []string{"10.1.2.200"}, []string{"10.1.3.1", "::ffff:10.1.3.1"}},
		{"IPv4 /32, IPv6 /128", 32, 128, []string{"10.1.2.3", "10.1.2.3"}, []string{"10.1.2.3"}, []string{"10.1.2.4"}},
		{"IPv4 /16", 16, 48, []string{"10.1.2.3", "10.1.200.3"}, []string{"10.1.77.1"}, []string{"10.2.2.3"}},
		{"IPv6 /48", 16, 48, []string{"2001:db8:1:1::1", "2001:db8:1:2::1"}, []string{"2001:db8:1:ffff::9"}, []string{"2001:db8:2::1"}},
	} {
		f := newFailures(Policy{FailLimit: len(c.fail), FailPrefixV4: c.v4, FailPrefixV6: c.v6})
		now := time.Now()
		for _, a := range c.fail {
			f.failed(peerAt(addr(a)), now)
		}
		for _, a := range c.refused {
			if !f.refused(peerAt(addr(a)), now).refused {
				t.Errorf("%s: %s not refused", c.name, a)
			}
		}
		for _, a := range c.notRefused {
			if f.refused(peerAt(addr(a)), now).refused {
				t.Errorf("%s: %s refused", c.name, a)
			}
		}
	}
}

// A full table forgets a network only when it is neither refused nor
// failed within the window; until then a network it has no room for is
// refused (fail closed), and the refused ones stay refused.
func TestFailuresNeverForgetARefusedNetwork(t *testing.T) {
	f := newFailures(Policy{FailLimit: 2, FailWindow: time.Minute, FailBlock: 2 * time.Minute})
	f.max = 3
	n := func(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 0, byte(i), 1}) }
	t0 := time.Now()
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	// Networks 0 and 1 refused, network 2 with one failure.
	for _, i := range []int{0, 0, 1, 1, 2} {
		f.failed(peerAt(n(i)), t0)
	}
	if v := f.failed(peerAt(n(3)), at(time.Second)); !v.refused || !v.full || !v.warn {
		t.Errorf("a new network's failure with the table full of refused and failing ones: %+v, want refused (full, warn)", v)
	}
	if v := f.refused(peerAt(n(4)), at(2*time.Second)); !v.refused || !v.full || v.warn {
		t.Errorf("a network the full table has no entry for: %+v, want refused (full, warned already)", v)
	}
	for _, i := range []int{0, 1} {
		if !f.refused(peerAt(n(i)), at(3*time.Second)).refused {
			t.Errorf("network %d forgotten to make room", i)
		}
	}
	// Past the window network 2 is quiet, but 0 and 1 are refused until
	// t0+2m: the oldest, 0, may not go, so the table stays closed.
	if v := f.failed(peerAt(n(3)), at(90*time.Second)); !v.refused || !v.full {
		t.Errorf("while the oldest network is still refused: %+v, want refused (full)", v)
	}
	// Past the block every one is forgettable: the oldest goes first.
	if v := f.failed(peerAt(n(3)), at(121*time.Second)); v.refused {
		t.Errorf("a new network's first failure once room can be made: %+v, want counted, not refused", v)
	}
	if _, ok := f.sources[f.network(peerAt(n(0)))]; ok {
		t.Error("the oldest network was not the one forgotten")
	}
	if f.refused(peerAt(n(4)), at(122*time.Second)).refused {
		t.Error("a network with no failures refused once the table has room to make")
	}
	if v := f.refused(peerAt(n(0)), at(122*time.Second)); v.refused {
		t.Errorf("a forgotten network after its block: %+v", v)
	}
}

// The table full of failing networks is said at warn once a minute, and
// its refusal names the network it has no room for.
func TestGateFullTable(t *testing.T) {
	var log bytes.Buffer
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, MaxConns: 8, FailLimit: 5},
		slog.New(slog.NewTextHandler(&log, nil)))
	g.fails.max = 2
	g.Failed(peerAt(netip.MustParseAddr("10.0.0.1")), "token")
	g.Failed(peerAt(netip.MustParseAddr("10.0.1.1")), "directory")
	g.Failed(peerAt(netip.MustParseAddr("10.0.2.1")), "hello")
	for _, p := range []string{"10.0.3.1", "10.0.4.1"} {
		if _, err := g.Admit(peerAt(netip.MustParseAddr(p)), nil); !errors.Is(err, syscall.EACCES) || !strings.Contains(err.Error(), p[:len(p)-1]+"0/24") {
			t.Errorf("%s with the table full: %v, want EACCES naming its network", p, err)
		}
	}
	if _, err := g.Admit(peerAt(netip.MustParseAddr("10.0.1.7")), nil); err != nil {
		t.Errorf("a network in the table, not refused: %v", err)
	}
	if n := strings.Count(log.String(), "too many failing networks"); n != 1 || !strings.Contains(log.String(), "level=WARN") || !strings.Contains(log.String(), "network=10.0.2.0/24") {
		t.Errorf("want one warn line naming 10.0.2.0/24, got:\n%s", log.String())
	}
}

// Every /24 of 127.0.0.0/8, where every local user may connect from,
// fits in the table, in little memory; one network more does not while
// they all failed within the window.
func TestFailuresTableHoldsLoopback(t *testing.T) {
	if testing.Short() {
		t.Skip("fills the whole table")
	}
	f := newFailures(Policy{})
	now := time.Now()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range 1 << 16 {
		if v := f.failed(peerAt(netip.AddrFrom4([4]byte{127, byte(i >> 8), byte(i), 1})), now); v.refused {
			t.Fatalf("127.%d.%d.1: %+v after one failure", i>>8, i&0xff, v)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / (1 << 16)
	t.Logf("%.0f bytes per network, %.1f MiB for the table", per, per*(1<<16)/(1<<20))
	if per > 256 {
		t.Errorf("%.0f bytes per network; want at most 256 (16 MiB for the table)", per)
	}
	if v := f.refused(peerAt(netip.MustParseAddr("127.255.255.254")), now); v.refused {
		t.Errorf("a network of the table refused: %+v", v)
	}
	if v := f.failed(peerAt(netip.MustParseAddr("10.0.0.1")), now); !v.refused || !v.full {
		t.Errorf("one network more: %+v, want refused (full)", v)
	}
	runtime.KeepAlive(f)
}

func ExampleGate_Failed() {
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, MaxConns: 1, FailLimit: 2}, nil)
	g.Failed(peerAt(netip.MustParseAddr("127.1.2.3")), "token")
	g.Failed(peerAt(netip.MustParseAddr("127.1.2.4")), "directory")
	_, err := g.Admit(peerAt(netip.MustParseAddr("127.1.2.5")), nil)
	fmt.Println(err)
	// Output: peer 127.1.2.5: too many failed attempts from 127.1.2.0/24; refused for a while: permission denied
}

// A network that failed within the window is not forgotten to make room
// either, even when it is not refused; once its failures are older than
// the window it may go.
func TestFailuresKeepRecentNetworks(t *testing.T) {
	f := newFailures(Policy{FailLimit: 3, FailWindow: time.Minute})
	f.max = 2
	a, b, c := netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.2.1"), netip.MustParseAddr("10.0.3.1")
	t0 := time.Now()
	f.failed(peerAt(a), t0)
	f.failed(peerAt(b), t0.Add(time.Second))
	if v := f.failed(peerAt(c), t0.Add(30*time.Second)); !v.refused || !v.full {
		t.Errorf("a third network while two failed within the minute: %+v, want refused (full)", v)
	}
	f.failed(peerAt(a), t0.Add(40*time.Second)) // a is the newest now
	f.failed(peerAt(a), t0.Add(62*time.Second))
	if v := f.failed(peerAt(c), t0.Add(62*time.Second)); v.refused {
		t.Errorf("once b's failure is past the window: %+v, want room made", v)
	}
	if _, ok := f.sources[f.network(peerAt(b))]; ok {
		t.Error("b, quiet for the window, was kept while a, failing within it, was not")
	}
	f.failed(peerAt(a), t0.Add(63*time.Second))
	if !f.refused(peerAt(a), t0.Add(63*time.Second)).refused {
		t.Error("a's failures were forgotten: 3 within the minute (at 40 s, 62 s, 63 s) do not refuse it")
	}
}

// A local peer whose owner the transport knows counts by its uid: one
// local user's bad tokens do not lock out another local user, and the
// refusal names the uid; a loopback peer of no known owner counts by its
// /24 as any other.
func TestLocalPeersCountByUID(t *testing.T) {
	lo := netip.MustParseAddr("127.0.0.1")
	g := NewGate(Policy{AllowFrom: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, MaxConns: 8, FailLimit: 3}, nil)
	mallory, alice := Peer{Addr: lo, UID: 1000, HasUID: true}, Peer{Addr: lo, UID: 1001, HasUID: true}
	for range 3 {
		g.Failed(mallory, "token")
	}
	if _, err := g.Admit(mallory, nil); !errors.Is(err, syscall.EACCES) || !strings.Contains(err.Error(), "uid 1000 on this machine") {
		t.Fatalf("uid 1000 after 3 failures: %v, want EACCES naming the uid", err)
	}
	for _, p := range []Peer{alice, peerAt(lo)} {
		a, err := g.Admit(p, nil)
		if err != nil {
			t.Fatalf("%s after another local user's failures: %v", p, err)
		}
		a.Done()
	}
	for range 3 {
		g.Failed(peerAt(netip.MustParseAddr("127.0.0.2")), "token")
	}
	if _, err := g.Admit(peerAt(lo), nil); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("an unknown local peer after 3 failures of 127.0.0.0/24: %v", err)
	}
}
