// Package remote is how peers reach mrfs's buffers: a peer connects,
// names a directory (a protection domain), gets a queue pair in that PD,
// and then performs one-sided READ, WRITE and atomic operations on any
// buffer of the PD at (addr, rkey), checked as a NIC checks them.
//
// The pieces, one job each: remote/proto is the soft transport's wire
// format; remote/server serves it over TCP on the soft backend, executing
// operations through verbs.Responder; remote/client is the Go package
// programs and `mrfs remote` use. The soft transport is an emulation for
// machines without RDMA (docs/REMOTE.md, docs/PROTOCOL.md). On a real NIC
// the rdma_cm transport (build tag rdma) gives peers real queue pairs.
package remote

import "mrfs/buffer"

// Resolver maps the directory a peer names, relative to the mount's root
// ("/" is the root), to its protection domain. fs.Server.Domain is one.
// Errors wrap an errno (ENOENT, ENOTDIR) that is reported to the peer.
type Resolver func(dir string) (*buffer.Domain, error)
