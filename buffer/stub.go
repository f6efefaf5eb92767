package buffer

// STUB: signatures only, the helper implementing package buffer replaces
// this file. Keep every exported signature; add, don't change.

import (
	"log/slog"

	"mrfs/verbs"
)

// Manager owns every buffer and domain of one device.
type Manager struct{}

// NewManager returns a Manager registering on dev. It does not own dev:
// Close does not close it.
func NewManager(dev verbs.Device, opt Options, log *slog.Logger) *Manager { panic("stub") }

// Device is the device buffers are registered on.
func (m *Manager) Device() verbs.Device { panic("stub") }

// Options returns the options the manager enforces.
func (m *Manager) Options() Options { panic("stub") }

// NewDomain allocates a protection domain whose files get defaultAccess.
func (m *Manager) NewDomain(defaultAccess verbs.Access) (*Domain, error) { panic("stub") }

// Create makes a buffer of size bytes in d with d's default access,
// registered at once when size > 0. ENOSPC past MaxBuffers or MaxPinned.
func (m *Manager) Create(d *Domain, size uint64) (*Buffer, error) { panic("stub") }

// Stats returns current totals.
func (m *Manager) Stats() Stats { panic("stub") }

// Close frees every buffer (deregister, unmap, close) and deallocates
// every domain. Operations on them afterwards fail with ENODEV.
func (m *Manager) Close() error { panic("stub") }

// Domain is a protection domain and the buffers registered in it.
type Domain struct{}

// PD is the protection domain's number.
func (d *Domain) PD() uint32 { panic("stub") }

// DefaultAccess is the access given to buffers created in d.
func (d *Domain) DefaultAccess() verbs.Access { panic("stub") }

// SetDefaultAccess checks a (EINVAL, EPERM, EOPNOTSUPP as SetAccess) and
// stores it.
func (d *Domain) SetDefaultAccess(a verbs.Access) error { panic("stub") }

// Buffers is the number of buffers in d.
func (d *Domain) Buffers() int { panic("stub") }

// Close deallocates the PD; ENOTEMPTY while it holds buffers.
func (d *Domain) Close() error { panic("stub") }

// Buffer is one memfd, its daemon mapping, and its registration.
type Buffer struct{}

// Fd is the memfd, for FUSE passthrough; -1 once freed.
func (b *Buffer) Fd() int { panic("stub") }

// Info returns a snapshot.
func (b *Buffer) Info() Info { panic("stub") }

// Domain is the domain the buffer is registered in.
func (b *Buffer) Domain() *Domain { panic("stub") }

// Sync learns the memfd's size by fstat and re-registers when it changed.
func (b *Buffer) Sync() error { panic("stub") }

// Resize sets the size and re-registers: new region first, then the old
// one deregistered. Keeps the first min(old, new) bytes.
func (b *Buffer) Resize(size uint64) error { panic("stub") }

// Allocate is fallocate(2) on the memfd, then a Sync.
func (b *Buffer) Allocate(off, length uint64, mode uint32) error { panic("stub") }

// SetAccess re-registers with access a. EINVAL for an invalid set,
// EPERM outside Options.Allowed, EOPNOTSUPP when the device refuses it.
func (b *Buffer) SetAccess(a verbs.Access) error { panic("stub") }

// Move re-registers the buffer in d (register in d, then deregister the
// old region). Keys change.
func (b *Buffer) Move(d *Domain) error { panic("stub") }

// ReadAt reads from the memfd (pread).
func (b *Buffer) ReadAt(p []byte, off int64) (int, error) { panic("stub") }

// WriteAt writes to the memfd (pwrite), then Syncs.
func (b *Buffer) WriteAt(p []byte, off int64) (int, error) { panic("stub") }

// Free deregisters the region, then unmaps and closes the memfd.
func (b *Buffer) Free() error { panic("stub") }
