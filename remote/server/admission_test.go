package server_test

import (
	"context"
	"net"
	"net/netip"
	"testing"

	"mrfs/buffer"
	"mrfs/remote"
	"mrfs/remote/client"
	"mrfs/remote/gate"
	"mrfs/remote/remotetest"
	"mrfs/remote/server"
	"mrfs/verbs/soft"
)

// The admission table every transport passes (the rdma_cm half runs in
// the Soft-RoCE guest).
func TestAdmission(t *testing.T) {
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: remoteAll}, nil)
	dom, err := mgr.NewDomain(remoteAll)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		mgr.Close()
		dev.Close()
	})
	remotetest.RunAdmission(t, remotetest.Transport{
		Listen: func(t *testing.T, p gate.Policy, resolve gate.Resolver) string {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			s := server.Serve(ln, p, resolve, nil)
			t.Cleanup(func() { s.Close() })
			return ln.Addr().String()
		},
		Dial: func(ctx context.Context, addr, dir string, tok remote.Token) (remote.Conn, error) {
			return client.Dial(ctx, addr, dir, tok)
		},
		Idle: func(t *testing.T, addr string) net.Conn {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			return c
		},
		Peer:   netip.MustParseAddr("127.0.0.1"),
		Domain: dom,
	})
}
