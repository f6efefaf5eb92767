//go:build !rdma

package cli

import (
	"context"
	"errors"

	"mrfs/remote"
)

// Built without -tags rdma: the same names as rdma.go, each saying which
// build option is missing.

const rdmaBuilt = false

const defaultTransport = transportTCP

var (
	errNoRDMADial = errors.New("this binary has no rdma_cm transport: rebuild with `go build -tags rdma ./cmd/mrfs`")
)

func dialRDMA(context.Context, string, string, remote.Token) (remote.Conn, error) {
	return nil, errNoRDMADial
}
