//go:build rdma

package mount

import (
	"log/slog"

	"mrfs/remote/gate"
	"mrfs/remote/rdmacm"
	"mrfs/verbs"
	"mrfs/verbs/ibv"
)

// Built with -tags rdma, a mount may use the libibverbs backend and
// serves [remote] over rdma_cm on it. nordma.go defines the same names
// for the build without it.

const rdmaBuilt = true

func rdmaProvider() (verbs.Provider, error) { return ibv.New() }

func listenRDMA(addr string, p gate.Policy, resolve gate.Resolver, log *slog.Logger) (rdmaListener, error) {
	l, err := rdmacm.Listen(addr, p, resolve, log)
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return l, nil
}
