package buffer

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"mrfs/internal/bytesize"
	"mrfs/store"
	"mrfs/verbs"
)

// A buffer registered in place (b.src set) has as its file memory a
// client brought (package source): the daemon maps and registers it and
// never resizes, fills or frees it. Its size is the source's when it was
// registered; when the source is resized, the registration no longer
// matches its pages, and the buffer goes stale: deregistered for good,
// its charge dropped. The Buffer methods branch here for it.

// Source is what RegisterInPlace registers: an open source file.
type Source interface {
	store.File
	Path() string
	Kind() string
	// Writable: the caller may write the source, and it is mapped so.
	Writable() bool
	// ID is which file it is (its device and inode number).
	ID() (dev, ino uint64)
}

// inPlace is a buffer's source; a pointer in Buffer, which most buffers
// leave nil.
type inPlace struct {
	Source
	id    uint64 // guarded by the buffer's mu: its id (Kept.File: no store file has it)
	stale bool   // guarded by the buffer's mu: its source was resized
}

// SourceInfo is where an in-place buffer's memory comes from.
type SourceInfo struct {
	Path, Kind string
}

// sourceWatch is how often the sources are checked for a resize, besides
// every look at a file's attributes.
const sourceWatch = time.Second

// RegisterInPlace makes a buffer of src in d, registered whole with access
// a and charged to owner. It takes src: on failure src is closed. EACCES
// when a writes and src is not writable; EPERM in a pool.
func (m *Manager) RegisterInPlace(d *Domain, src Source, owner uint32, a verbs.Access) (*Buffer, error) {
	return m.registerInPlace(d, src, Kept{Owner: owner, Access: a})
}

// AdoptInPlace takes back a buffer registered in place that an earlier
// process kept (k.Source): its source opened again (Options.Reopen: the
// same file at its path), registered anew with k's access, owner and id,
// its generation going on from k's. A source that is gone, another file,
// or was stale (resized) is refused: such a file is not taken back.
func (m *Manager) AdoptInPlace(d *Domain, k Kept) (*Buffer, error) {
	switch {
	case k.Source == nil || k.File == 0:
		return nil, fmt.Errorf("adopt a file registered in place: no source: %w", syscall.EINVAL)
	case k.Source.Stale:
		return nil, fmt.Errorf("adopt a file registered in place of %s: its source was resized: %w", k.Source.Path, syscall.ESTALE)
	case m.opt.Reopen == nil:
		return nil, fmt.Errorf("adopt a file registered in place of %s: no sources are opened again: %w", k.Source.Path, syscall.EOPNOTSUPP)
	}
	src, err := m.opt.Reopen(*k.Source)
	if err != nil {
		return nil, fmt.Errorf("adopt a file registered in place: %w", err)
	}
	return m.registerInPlace(d, src, k)
}

// registerInPlace is RegisterInPlace, with the owner and access of k,
// and its id and generation when k was kept.
func (m *Manager) registerInPlace(d *Domain, src Source, k Kept) (*Buffer, error) {
	owner, a := k.Owner, k.Access
	fail := func(err error) (*Buffer, error) {
		src.Remove()
		return nil, fmt.Errorf("register %s in place: %w", src.Path(), err)
	}
	switch {
	case d == nil:
		return fail(fmt.Errorf("no domain: %w", syscall.EINVAL))
	case d.Pool() != nil:
		return fail(fmt.Errorf("a pool's files are its slots; register in place outside pools: %w", syscall.EPERM))
	}
	if err := m.checkAccess(a); err != nil {
		return fail(err)
	}
	if err := checkSourceAccess(src, a); err != nil {
		return fail(err)
	}
	size, _, err := src.Stat()
	if err != nil {
		return fail(err)
	}
	in := &inPlace{Source: src}
	b := &Buffer{m: m, dom: d, owner: owner, gen: uint32(k.Generation), src: in}
	b.mu.Lock()
	defer b.mu.Unlock()
	id, err := m.reserveBuffer(b, d, owner, k.File)
	if err != nil {
		return fail(err)
	}
	in.id = id
	b.f, b.access = src, a
	if err := b.registerLocked(context.Background(), size, d, a); err != nil {
		b.abandonLocked() // closes src
		return nil, fmt.Errorf("register %s in place (%s): %w", src.Path(), bytesize.Format(size), err)
	}
	b.size = size
	b.settleFileLocked()
	m.mu.Lock()
	m.sources[b] = struct{}{}
	if !m.watching {
		m.watching = true
		go m.watchSources()
	}
	m.mu.Unlock()
	return b, nil
}

// InPlace says whether b is registered in place.
func (b *Buffer) InPlace() bool { return b.src != nil }

// checkSourceAccess bounds a by what the caller may do to src.
func checkSourceAccess(src Source, a verbs.Access) error {
	if a.Writable() && !src.Writable() {
		return fmt.Errorf("access %s writes, and %s was registered read-only (its registrant may not write it): %w", a, src.Path(), syscall.EACCES)
	}
	return nil
}

// watchSources looks at every source each sourceWatch until the manager
// closes, so a resize is noticed even when nobody looks at the file.
func (m *Manager) watchSources() {
	for range time.Tick(sourceWatch) {
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			return
		}
		bufs := make([]*Buffer, 0, len(m.sources))
		for b := range m.sources {
			bufs = append(bufs, b)
		}
		m.mu.Unlock()
		for _, b := range bufs {
			_ = b.Sync() // logged where it goes stale
		}
	}
}

// syncSourceLocked is Sync for an in-place buffer: a source whose size is
// no longer the registered one makes the buffer stale.
func (b *Buffer) syncSourceLocked() error {
	if b.src.stale {
		return nil
	}
	cur, _, err := b.f.Stat()
	if err != nil || cur == b.size {
		return err
	}
	if err := b.dropLocked(); err != nil {
		return fmt.Errorf("deregister the stale registration of %s: %w", b.src.Path(), err)
	}
	b.src.stale, b.reason = true, "source resized"
	b.keptChangedLocked()
	b.settleFileLocked()
	b.m.mu.Lock()
	delete(b.m.sources, b)
	b.m.mu.Unlock()
	b.m.log.Warn("a source registered in place was resized (by its owner, or by a write past its end through a zero-copy open): deregistered",
		"source", b.src.Path(), "registered", bytesize.Format(b.size), "now", bytesize.Format(cur))
	return nil
}
