//go:build rdma

package cli

import (
	"errors"
	"fmt"
	"testing"

	"mrfs/remote/client"
	"mrfs/remote/rdmacm"
	"mrfs/verbs"
)

// The rdma build's `mrfs remote` speaks rdma_cm unless told otherwise,
// and reports a work completion in error by its status.
func TestRemoteRDMADefault(t *testing.T) {
	if defaultTransport != transportRDMA || remoteDialers[transportRDMA] == nil || remoteDialers[transportTCP] == nil {
		t.Fatalf("rdma build: default %q, transports %v; want rdma_cm by default and tcp too", defaultTransport, remoteDialers)
	}
	err := wcErr(fmt.Errorf("wrapped: %w", &rdmacm.WCError{Op: "RDMA WRITE", Addr: 0x1000, RKey: 0x42, Status: verbs.WCRemAccessErr}))
	var se *client.StatusError
	if !errors.As(err, &se) || se.Status != verbs.WCRemAccessErr || se.Op != "RDMA WRITE" {
		t.Errorf("wcErr = %v, want a StatusError with IBV_WC_REM_ACCESS_ERR", err)
	}
	other := errors.New("no device")
	if wcErr(other) != other || wcErr(nil) != nil {
		t.Errorf("wcErr changed a non-completion error")
	}
}
