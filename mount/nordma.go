//go:build !rdma

package mount

import (
	"errors"
	"log/slog"

	"mrfs/remote/gate"
	"mrfs/verbs"
)

// Built without -tags rdma: the same names as rdma.go, each saying which
// build option is missing.

const rdmaBuilt = false

var (
	errNoRDMABuild = errors.New("the rdma backend is not built in: rebuild with `go build -tags rdma ./cmd/mrfs` (needs the libibverbs-dev and librdmacm-dev packages)")
	errNoRDMACM    = errors.New("remote.listen is set but this binary has no rdma_cm transport for the rdma backend: rebuild with `go build -tags rdma ./cmd/mrfs`, or use the soft backend")
)

func rdmaProvider() (verbs.Provider, error) { return nil, errNoRDMABuild }

func listenRDMA(string, gate.Policy, gate.Resolver, *slog.Logger) (rdmaListener, error) {
	return nil, errNoRDMACM
}
