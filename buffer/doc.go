// Package buffer owns the memory behind mrfs files: one file of the store
// per buffer (store: a private tmpfs instance, or memfds in the degraded
// mode), mapped MAP_SHARED in the daemon, and that mapping registered with
// a verbs device. It implements the lifecycle rules of DESIGN.md (create,
// resize, size learned by fstat, access change, move between PDs, unlink,
// teardown), the accounting of every page the store holds (charge.go), and
// the limits (limits.go, maps.go), and knows nothing of FUSE.
//
// # Locking
//
// FUSE requests arrive concurrently, so two mutexes guard the state:
//
//   - Buffer.mu guards one buffer: its file, mapping, regions, size,
//     access, state, owner and domain.
//   - Manager.mu guards the sets of buffers and domains, every Domain's
//     mutable fields (default access, buffer count, closed), the
//     counters (registered bytes, charges, regions, mappings), every
//     Buffer's charge, descriptors and orphan state, and the
//     limit-warning times.
//
// Lock order: Buffer.mu before Manager.mu, never the reverse. Code holding
// Manager.mu never takes a Buffer.mu, so Manager.Close snapshots the set,
// releases Manager.mu, and only then frees each buffer; code holding one
// Buffer.mu only tries another's (chargeUnseen). Verbs calls that register
// or deregister are made under Buffer.mu only; Manager.mu is held just
// long enough to check and charge the limits, as one step.
package buffer
