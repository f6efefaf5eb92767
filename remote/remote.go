// Package remote is how peers reach mrfs's buffers: a peer connects,
// names a directory (a protection domain), gets a queue pair in that PD,
// and then performs one-sided READ, WRITE and atomic operations on any
// buffer of the PD at (addr, rkey), checked as a NIC checks them.
//
// This package holds what a peer uses, whatever the transport: a
// connection as a requester sees it (Conn), a buffer's regions and the
// pieces of a range over them (Region, Span), PD tokens (Token), and the
// errors a requester gets (StatusError for a work completion in error,
// RefusedError for a refused connection). What a listener enforces, the
// same for every transport so that they cannot disagree, is remote/gate:
// the admission policy ([remote]: Policy, applied by a Gate), the rule
// against guessing and the directory lookup (Resolver, Pending).
//
// The transports, one job each: remote/proto is the soft transport's
// wire format; remote/server serves it over TCP on the soft backend,
// executing operations through verbs.Responder; remote/client is its
// requester, for programs and `mrfs remote`. The soft transport is an
// emulation for machines without RDMA (docs/REMOTE.md, docs/PROTOCOL.md).
// On a real NIC, remote/rdmacm (build tag rdma) gives peers real queue
// pairs and the NIC checks every operation.
package remote

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

// DeviceConn is a Conn that knows the far side's device it came through
// (rdma_cm): with buffers registered on several devices, only that
// device's keys work on it. Device is "" when the far side did not say.
type DeviceConn interface {
	Conn
	Device() string
}
