// Package buffer owns the memory behind mrfs files: one memfd per buffer,
// mapped MAP_SHARED in the daemon, and that mapping registered with a verbs
// device. It implements the lifecycle rules of DESIGN.md (create, resize,
// size learned by fstat, access change, move between PDs, unlink,
// teardown) and the limits, and knows nothing of FUSE.
//
// # Locking
//
// FUSE requests arrive concurrently, so two mutexes guard the state:
//
//   - Buffer.mu guards one buffer: its memfd, mapping, region, size,
//     access, state and domain.
//   - Manager.mu guards the sets of buffers and domains, every Domain's
//     mutable fields (default access, buffer count, closed), the
//     counters (registered and pinned bytes, regions) and the limit-warning
//     flags.
//
// Lock order: Buffer.mu before Manager.mu, never the reverse. Code holding
// Manager.mu never takes a Buffer.mu, so Manager.Close snapshots the set,
// releases Manager.mu, and only then frees each buffer. Verbs calls that
// register or deregister are made under Buffer.mu only; Manager.mu is held
// just long enough to check and charge the limits.
package buffer
