//go:build rdma

package guest

import (
	"context"
	"net/netip"
	"testing"

	mbuffer "mrfs/buffer"
	"mrfs/remote"
	"mrfs/remote/gate"
	"mrfs/remote/rdmacm"
	"mrfs/remote/remotetest"
	"mrfs/verbs"
	"mrfs/verbs/ibv"
)

// The rdma_cm half of the admission table remote/server's tests run on
// the soft listener: the same cases and errnos on rxe0, with peers over
// rdma_cm from this process (eth0's address, 10.0.2.15).
func TestAdmissionRDMACM(t *testing.T) {
	requireGuest(t)
	p, err := ibv.New()
	if err != nil {
		t.Fatal(err)
	}
	dev, err := p.Open(device)
	if err != nil {
		t.Fatal(err)
	}
	const all = verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic
	mgr := mbuffer.NewManager(dev, mbuffer.Options{Allowed: all}, nil)
	dom, err := mgr.NewDomain(all)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := mgr.Close(); err != nil {
			t.Errorf("manager Close: %v", err)
		}
		dev.Close()
	})
	remotetest.RunAdmission(t, remotetest.Transport{
		Listen: func(t *testing.T, pol gate.Policy, resolve gate.Resolver) string {
			l, err := rdmacm.Listen(listenAddr, pol, resolve, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := l.Close(); err != nil {
					t.Errorf("listener Close: %v", err)
				}
			})
			return l.Addr().String()
		},
		Dial: func(ctx context.Context, addr, dir string, tok remote.Token) (remote.Conn, error) {
			return rdmacm.DialContext(ctx, addr, dir, tok)
		},
		Peer:   netip.MustParseAddr("10.0.2.15"),
		Domain: dom,
	})
}
