package mount

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"mrfs/buffer"
	"mrfs/internal/config"
	"mrfs/remote/gate"
)

type fakeListener struct {
	addr   netip.AddrPort
	reach  map[string]netip.AddrPort
	closed bool
}

func (l *fakeListener) Addr() netip.AddrPort             { return l.addr }
func (l *fakeListener) Reach() map[string]netip.AddrPort { return l.reach }
func (l *fakeListener) Close() error                     { l.closed = true; return nil }
func (l *fakeListener) CloseDevice(string) int           { return 0 }

// What etcd gets: each device's address, and for a listener on every
// address the first device's, which a peer can reach (0.0.0.0 it cannot).
func TestRemotePublishedPerDevice(t *testing.T) {
	reach := map[string]netip.AddrPort{
		"rxe0": netip.MustParseAddrPort("10.0.2.15:7471"),
		"rxe1": netip.MustParseAddrPort("10.0.3.15:7471"),
	}
	for _, c := range []struct {
		bound, primary, want string
	}{
		{"0.0.0.0:7471", "rxe0", "rdma_cm 10.0.2.15:7471"},
		{"0.0.0.0:7471", "rxe1", "rdma_cm 10.0.3.15:7471"},
		{"0.0.0.0:7471", "mlx5_0", "rdma_cm 0.0.0.0:7471"}, // no address known: as bound
		{"10.0.3.15:7471", "rxe0", "rdma_cm 10.0.3.15:7471"},
	} {
		l := &fakeListener{addr: netip.MustParseAddrPort(c.bound), reach: reach}
		fake := func(string, gate.Policy, gate.Resolver, *slog.Logger) (rdmaListener, error) { return l, nil }
		r, err := bindRemoteWith(config.Remote{Listen: c.bound}, config.BackendRDMA, nil, slog.New(slog.DiscardHandler), fake)
		if err != nil {
			t.Fatal(err)
		}
		w := r.Published(c.primary)
		if w.Listen != c.want || len(w.Devices) != 2 || w.Devices["rxe1"] != "rdma_cm 10.0.3.15:7471" || w.Devices["rxe0"] != "rdma_cm 10.0.2.15:7471" {
			t.Errorf("bound to %s, first device %s: published %+v; want listen %q and each device's address", c.bound, c.primary, w, c.want)
		}
	}
	var off *remoteAccess
	if w := off.Published("rxe0"); w.Listen != "" || w.Devices != nil {
		t.Errorf("remote access off: published %+v", w)
	}
}

// user.mrfs.remote shows the address the rdma_cm listener is bound to:
// with port 0, the port it got, not the configured 0.
func TestRemoteWhereRDMABoundAddress(t *testing.T) {
	l := &fakeListener{addr: netip.MustParseAddrPort("10.0.2.15:40123")}
	var listened string
	var resolve gate.Resolver
	var pol gate.Policy
	fake := func(addr string, p gate.Policy, res gate.Resolver, _ *slog.Logger) (rdmaListener, error) {
		listened, pol, resolve = addr, p, res
		return l, nil
	}
	log := slog.New(slog.DiscardHandler)
	cfg := config.Remote{Listen: "10.0.2.15:0", MaxConnections: 3, AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	r, err := bindRemoteWith(cfg, config.BackendRDMA, nil, log, fake)
	if err != nil {
		t.Fatal(err)
	}
	// Bound before the mount: a peer arriving now is refused, not lost.
	if _, err := resolve("/"); !errors.Is(err, syscall.EAGAIN) {
		t.Errorf("resolve before the mount: %v, want EAGAIN", err)
	}
	r.Serve(func(string) (*buffer.Domain, error) { return nil, syscall.ENOTDIR })
	if _, err := resolve("/"); !errors.Is(err, syscall.ENOTDIR) {
		t.Errorf("resolve after Serve: %v, want the mount's answer", err)
	}
	if listened != "10.0.2.15:0" || pol.MaxConns != 3 || len(pol.AllowFrom) != 1 {
		t.Errorf("listened on %q with %+v", listened, pol)
	}
	if got := r.Where(); got != "rdma_cm 10.0.2.15:40123" {
		t.Errorf("Where = %q, want the bound address", got)
	}
	if err := r.Close(); err != nil || !l.closed || r.Where() != "" {
		t.Errorf("Close: %v, listener closed %v, Where %q", err, l.closed, r.Where())
	}

	// A listener that cannot bind fails the mount before it mounts, and
	// the error names the address.
	failing := func(string, gate.Policy, gate.Resolver, *slog.Logger) (rdmaListener, error) {
		return nil, io.ErrUnexpectedEOF
	}
	if _, err := bindRemoteWith(config.Remote{Listen: "10.0.2.15:7471"}, config.BackendRDMA, nil, log, failing); err == nil || !strings.Contains(err.Error(), "10.0.2.15:7471") {
		t.Errorf("bind with a failing listener: %v", err)
	}
}

// The soft transport shows its bound port too (port 0 → the real one).
func TestRemoteWhereSoftBoundAddress(t *testing.T) {
	r, err := bindRemote(config.Remote{Listen: "127.0.0.1:0"}, config.BackendSoft, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w := r.Where()
	if !strings.HasPrefix(w, "tcp 127.0.0.1:") || strings.HasSuffix(w, ":0") {
		t.Errorf("Where = %q, want tcp and the bound port", w)
	}
}

// [remote] reaches the gate whole: the failure rule's limit (0 turns it
// off) and the prefix lengths that make a source network.
func TestPolicyFromConfig(t *testing.T) {
	p := policy(config.Remote{MaxConnections: 5, MaxFailures: 7, FailurePrefixV4: 16, FailurePrefixV6: 48}, nil)
	if p.MaxConns != 5 || p.FailLimit != 7 || p.FailPrefixV4 != 16 || p.FailPrefixV6 != 48 {
		t.Errorf("policy = %+v, want max 5, failures 7, prefixes 16 and 48", p)
	}
	if p := policy(config.Remote{MaxFailures: 0}, nil); p.FailLimit >= 0 {
		t.Errorf("max_failures = 0 gives FailLimit %d, want the rule off (negative)", p.FailLimit)
	}
}
