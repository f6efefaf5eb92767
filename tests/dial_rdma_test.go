//go:build rdma

package tests

import (
	"context"

	"mrfs/remote"
	"mrfs/remote/rdmacm"
)

// dialRDMA connects over rdma_cm (MRFS_TEST_BACKEND=rdma).
func dialRDMA(ctx context.Context, peer, dir string, tok remote.Token) (remote.Conn, error) {
	c, err := rdmacm.DialContext(ctx, peer, dir, tok)
	if err != nil {
		return nil, err
	}
	return c, nil
}
