//go:build rdma

package cli

import (
	"context"

	"mrfs/remote"
	"mrfs/remote/rdmacm"
)

// Built with -tags rdma, `mrfs remote` speaks rdma_cm by default
// (--transport tcp reaches a soft backend's daemon); the mount's side is
// in package mount. nordma.go defines the same names for the build
// without it.

const rdmaBuilt = true

const defaultTransport = transportRDMA

func dialRDMA(ctx context.Context, peer, dir string, tok remote.Token) (remote.Conn, error) {
	c, err := rdmacm.DialContext(ctx, peer, dir, tok)
	if err != nil {
		return nil, err
	}
	return c, nil
}
