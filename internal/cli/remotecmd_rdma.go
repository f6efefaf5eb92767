//go:build rdma

package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"mrfs/remote/client"
	"mrfs/remote/rdmacm"
	"mrfs/verbs"
)

// Built with -tags rdma, `mrfs remote` speaks rdma_cm by default (the
// transport the build's daemon serves on the rdma backend); --transport
// tcp reaches a soft backend's daemon.
func init() {
	remoteDialers[transportRDMA] = dialRDMA
	defaultTransport = transportRDMA
}

// rdmaMaxMessage is the largest RDMA message (2^31 bytes, the IB
// specification's bound and rxe's max_msg_sz).
const rdmaMaxMessage = 1 << 31

// rdmaConn adapts an rdma_cm client connection to remoteConn: its work
// completions in error become *client.StatusError.
type rdmaConn struct{ c *rdmacm.Conn }

func dialRDMA(ctx context.Context, peer, dir string) (remoteConn, error) {
	// rdmacm bounds each step (resolution, connection, every completion)
	// by one timeout: what is left of ctx's.
	timeout := 10 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	if timeout <= 0 {
		return nil, fmt.Errorf("connect to %s: %w", peer, context.DeadlineExceeded)
	}
	c, err := rdmacm.Dial(peer, dir, rdmacm.DialOptions{Timeout: timeout})
	if err != nil {
		return nil, err
	}
	return &rdmaConn{c: c}, nil
}

func (r *rdmaConn) MaxMessage() uint32 { return rdmaMaxMessage }
func (r *rdmaConn) Close() error       { return r.c.Close() }

func (r *rdmaConn) Read(dst []byte, iova uint64, rkey uint32) error {
	if uint64(len(dst)) > rdmaMaxMessage {
		return &client.StatusError{Op: "RDMA READ", Status: verbs.WCLocLenErr}
	}
	b, err := r.c.Read(iova, rkey, len(dst))
	if err != nil {
		return wcErr(err)
	}
	copy(dst, b)
	return nil
}

func (r *rdmaConn) Write(iova uint64, rkey uint32, src []byte) error {
	if uint64(len(src)) > rdmaMaxMessage {
		return &client.StatusError{Op: "RDMA WRITE", Status: verbs.WCLocLenErr}
	}
	return wcErr(r.c.Write(iova, rkey, src))
}

func (r *rdmaConn) CompareSwap(iova uint64, rkey uint32, compare, swap uint64) (uint64, error) {
	old, err := r.c.CompareSwap(iova, rkey, compare, swap)
	return old, wcErr(err)
}

func (r *rdmaConn) FetchAdd(iova uint64, rkey uint32, add uint64) (uint64, error) {
	old, err := r.c.FetchAdd(iova, rkey, add)
	return old, wcErr(err)
}

// wcErr turns a work completion in error into the status error
// cmdRemote reports; other errors pass unchanged.
func wcErr(err error) error {
	var we *rdmacm.WCError
	if errors.As(err, &we) {
		return &client.StatusError{Op: we.Op, Status: we.Status}
	}
	return err
}
