package cli

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
)

type fakeListener struct {
	addr   netip.AddrPort
	closed bool
}

func (l *fakeListener) Addr() netip.AddrPort { return l.addr }
func (l *fakeListener) Close() error         { l.closed = true; return nil }

// user.mrfs.remote shows the address the rdma_cm listener is bound to:
// with port 0, the port it got, not the configured 0.
func TestRemoteWhereRDMABoundAddress(t *testing.T) {
	saved := rdmaRemote
	t.Cleanup(func() { rdmaRemote = saved })
	l := &fakeListener{addr: netip.MustParseAddrPort("10.0.2.15:40123")}
	var listened string
	var resolve func(string) (*buffer.Domain, error)
	rdmaRemote = func(cfg config.Remote, res func(string) (*buffer.Domain, error), _ *slog.Logger) (rdmaListener, error) {
		listened, resolve = cfg.Listen, res
		return l, nil
	}
	log := slog.New(slog.DiscardHandler)
	r, err := bindRemote(config.Remote{Listen: "10.0.2.15:0"}, config.BackendRDMA, log)
	if err != nil {
		t.Fatal(err)
	}
	// Bound before the mount: a peer arriving now is refused, not lost.
	if _, err := resolve("/"); !errors.Is(err, syscall.EAGAIN) {
		t.Errorf("resolve before the mount: %v, want EAGAIN", err)
	}
	if err := r.start(func(string) (*buffer.Domain, error) { return nil, errors.New("none") }); err != nil {
		t.Fatal(err)
	}
	if listened != "10.0.2.15:0" {
		t.Errorf("listened on %q", listened)
	}
	if got := r.Where(); got != "rdma_cm 10.0.2.15:40123" {
		t.Errorf("Where = %q, want the bound address", got)
	}
	if err := r.Close(); err != nil || !l.closed || r.Where() != "" {
		t.Errorf("Close: %v, listener closed %v, Where %q", err, l.closed, r.Where())
	}

	// A listener that cannot bind fails the mount before it mounts, and
	// the error names the address.
	rdmaRemote = func(config.Remote, func(string) (*buffer.Domain, error), *slog.Logger) (rdmaListener, error) {
		return nil, io.ErrUnexpectedEOF
	}
	if _, err := bindRemote(config.Remote{Listen: "10.0.2.15:7471"}, config.BackendRDMA, log); err == nil || !strings.Contains(err.Error(), "10.0.2.15:7471") {
		t.Errorf("bind with a failing listener: %v", err)
	}
}

// The soft transport shows its bound port too (port 0 → the real one).
func TestRemoteWhereSoftBoundAddress(t *testing.T) {
	r, err := bindRemote(config.Remote{Listen: "127.0.0.1:0"}, config.BackendSoft, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	w := r.Where()
	if !strings.HasPrefix(w, "tcp 127.0.0.1:") || strings.HasSuffix(w, ":0") {
		t.Errorf("Where = %q, want tcp and the bound port", w)
	}
}
