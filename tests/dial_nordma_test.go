//go:build !rdma

package tests

import (
	"context"
	"errors"

	"mrfs/remote"
)

// dialRDMA needs the rdma build of this package.
func dialRDMA(context.Context, string, string, remote.Token) (remote.Conn, error) {
	return nil, errors.New("MRFS_TEST_BACKEND=rdma needs the tests built with -tags rdma (rdma_cm)")
}
