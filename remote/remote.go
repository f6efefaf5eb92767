// Package remote is how peers reach mrfs's buffers: a peer connects,
// names a directory (a protection domain), gets a queue pair in that PD,
// and then performs one-sided READ, WRITE and atomic operations on any
// buffer of the PD at (addr, rkey), checked as a NIC checks them.
//
// This package holds what every transport shares, so that they cannot
// disagree: the admission policy ([remote]: Policy, applied by a Gate),
// the directory lookup (Resolver, Pending), a connection as a requester
// sees it (Conn), and the errors a requester gets (StatusError for a work
// completion in error, RefusedError for a refused connection).
//
// The transports, one job each: remote/proto is the soft transport's
// wire format; remote/server serves it over TCP on the soft backend,
// executing operations through verbs.Responder; remote/client is its
// requester, for programs and `mrfs remote`. The soft transport is an
// emulation for machines without RDMA (docs/REMOTE.md, docs/PROTOCOL.md).
// On a real NIC, remote/rdmacm (build tag rdma) gives peers real queue
// pairs and the NIC checks every operation.
package remote

import (
	"fmt"
	"sync/atomic"
	"syscall"

	"mrfs/buffer"
)

// Resolver maps the directory a peer names, relative to the mount's root
// ("/" is the root), to its protection domain (tree.Tree.Domain). Errors
// wrap an errno (ENOENT, ENOTDIR) that is reported to the peer.
type Resolver func(dir string) (*buffer.Domain, error)

// Pending is the Resolver of a transport bound before the mount exists
// (so that a busy port fails before anything is mounted): until Set, it
// refuses every peer with EAGAIN.
type Pending struct {
	r atomic.Pointer[Resolver]
}

// Set makes p answer with r from now on.
func (p *Pending) Set(r Resolver) { p.r.Store(&r) }

// Resolve is p as a Resolver.
func (p *Pending) Resolve(dir string) (*buffer.Domain, error) {
	r := p.r.Load()
	if r == nil {
		return nil, fmt.Errorf("mrfs is still mounting: %w", syscall.EAGAIN)
	}
	return (*r)(dir)
}

// Conn is a requester's connection to one PD of a peer, whatever the
// transport: an operation that completes with a status other than
// IBV_WC_SUCCESS returns a *StatusError. As on an RC queue pair, the
// first error puts the connection in the error state: every later
// operation completes with IBV_WC_WR_FLUSH_ERR.
type Conn interface {
	// MaxMessage is the largest READ or WRITE the path carries; a larger
	// one completes with IBV_WC_LOC_LEN_ERR without being sent.
	MaxMessage() uint32
	Read(dst []byte, iova uint64, rkey uint32) error
	Write(iova uint64, rkey uint32, src []byte) error
	CompareSwap(iova uint64, rkey uint32, compare, swap uint64) (old uint64, err error)
	FetchAdd(iova uint64, rkey uint32, add uint64) (old uint64, err error)
	Close() error
}
