//go:build rdma

package cli

import (
	"context"
	"log/slog"

	"mrfs/remote"
	"mrfs/remote/rdmacm"
	"mrfs/verbs"
	"mrfs/verbs/ibv"
)

// Built with -tags rdma, the binary has the libibverbs backend, serves
// [remote] over rdma_cm on it, and `mrfs remote` speaks rdma_cm by
// default (--transport tcp reaches a soft backend's daemon). nordma.go
// defines the same names for the build without it.

const rdmaBuilt = true

const defaultTransport = transportRDMA

func rdmaProvider() (verbs.Provider, error) { return ibv.New() }

func listenRDMA(addr string, p remote.Policy, resolve remote.Resolver, log *slog.Logger) (rdmaListener, error) {
	l, err := rdmacm.Listen(addr, p, resolve, log)
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return l, nil
}

func dialRDMA(ctx context.Context, peer, dir string, tok remote.Token) (remote.Conn, error) {
	c, err := rdmacm.DialContext(ctx, peer, dir, tok)
	if err != nil {
		return nil, err
	}
	return c, nil
}
