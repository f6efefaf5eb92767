//go:build rdma

package cli

import "testing"

// The rdma build's `mrfs remote` speaks rdma_cm unless told otherwise.
func TestRemoteRDMADefault(t *testing.T) {
	if defaultTransport != transportRDMA || !rdmaBuilt {
		t.Fatalf("rdma build: default %q, rdmaBuilt %v; want rdma_cm", defaultTransport, rdmaBuilt)
	}
}
