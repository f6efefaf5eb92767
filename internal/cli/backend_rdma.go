//go:build rdma

package cli

import "mrfs/verbs/ibv"

// Built with -tags rdma, the binary has the libibverbs backend.
func init() { rdmaProvider = ibv.New }
