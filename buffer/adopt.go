package buffer

import (
	"encoding/hex"
	"fmt"
	"syscall"

	"mrfs/store"
	"mrfs/verbs"
)

// A restart (DESIGN, Restart) keeps the store's files and nothing of the
// process: the regions and PDs die with it. What a later process needs to
// take a buffer back is Kept; it allocates each PD again with its old
// token (AdoptDomain), so that a peer's token stays good, and registers
// each buffer's file again (Adopt): new keys, the generation grown.

// Kept is what a later process needs of a buffer to take it back.
type Kept struct {
	File       uint64       // the id of its file in the (Lasting) store, or of a buffer in place
	Owner      uint32       // the uid charged for it
	Access     verbs.Access // its registration's access
	Generation uint64       // registrations made for it so far
	// Source is a buffer registered in place's source (it has no file in
	// the store), nil for others.
	Source *KeptSource `json:"source,omitempty"`
}

// KeptSource is the source of a buffer registered in place, as a later
// process opens it again (Options.Reopen).
type KeptSource struct {
	Path     string `json:"path"`
	Dev      uint64 `json:"dev"` // which file it was
	Ino      uint64 `json:"ino"`
	Writable bool   `json:"writable,omitempty"`
	// Stale: it was resized, and its registration dropped for good.
	Stale bool `json:"stale,omitempty"`
}

// Keep says what a later process needs to adopt b. EOPNOTSUPP for a
// buffer no later process can take back yet: a pool's file, one in a
// store that dies with the process (memfd); ENOENT once freed.
func (b *Buffer) Keep() (Kept, error) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	switch {
	case b.gone != alive:
		return Kept{}, fmt.Errorf("keep a buffer: %w", b.gone.err())
	case b.slot != nil:
		return Kept{}, fmt.Errorf("keep a pool's file across a restart: not built yet: %w", syscall.EOPNOTSUPP)
	}
	k, lasting := b.keptLocked()
	if !lasting {
		return Kept{}, fmt.Errorf("keep a buffer across a restart: the %s store dies with the process: %w", b.m.store.Kind(), syscall.EOPNOTSUPP)
	}
	return k, nil
}

// keptLocked is what a later process needs of b, a buffer not a slot;
// ok is false when its store dies with the process. Callers hold b.mu.
func (b *Buffer) keptLocked() (k Kept, ok bool) {
	k = Kept{Owner: b.owner, Access: b.access, Generation: uint64(b.gen)}
	if s := b.src; s != nil {
		dev, ino := s.ID()
		k.File = s.id
		k.Source = &KeptSource{Path: s.Path(), Dev: dev, Ino: ino, Writable: s.Writable(), Stale: s.stale}
		return k, true
	}
	k.File, ok = store.FileID(b.f)
	return k, ok
}

// keptChangedLocked tells Options.OnKept of b as it is now. Callers hold
// b.mu for writing. A buffer without its Aux is one its maker has not
// handed out yet (Create, Adopt): the record that names it will carry
// its Kept, so none is written before.
func (b *Buffer) keptChangedLocked() {
	if b.m.opt.OnKept == nil || b.slot != nil || b.aux == nil {
		return
	}
	if k, ok := b.keptLocked(); ok {
		b.m.opt.OnKept(k)
	}
}

// AdoptDomain allocates a protection domain as NewDomain does, with the
// token (Domain.Token) of an earlier process's PD: what peers were given
// stays good.
func (m *Manager) AdoptDomain(defaultAccess verbs.Access, token string) (*Domain, error) {
	var tok [TokenSize]byte
	if n, err := hex.Decode(tok[:], []byte(token)); err != nil || n != TokenSize || len(token) != 2*TokenSize {
		return nil, fmt.Errorf("adopt a pd: token %q is not %d hex bytes: %w", token, TokenSize, syscall.EINVAL)
	}
	return m.newDomain(defaultAccess, &tok)
}

// Adopt makes a buffer in d of the file k names, which an earlier process
// of the store made (Keep), owned by k.Owner with k.Access, and registers
// the file's size as Sync would (its generation goes on from
// k.Generation). A size that a limit refuses leaves the buffer
// Unregistered with its bytes, as Sync does, rather than failing: the
// error is returned with the buffer. EOPNOTSUPP when the store is not
// Lasting; the limits of Create. On any other failure nothing is left
// behind, and the file stays in the store.
func (m *Manager) Adopt(d *Domain, k Kept) (*Buffer, error) {
	ls, ok := m.store.(store.Lasting)
	switch {
	case d == nil:
		return nil, fmt.Errorf("adopt buffer: no domain: %w", syscall.EINVAL)
	case !ok:
		return nil, fmt.Errorf("adopt buffer %d: the %s store keeps no file of an earlier process: %w", k.File, m.store.Kind(), syscall.EOPNOTSUPP)
	case k.File == 0:
		return nil, fmt.Errorf("adopt buffer: no file: %w", syscall.EINVAL)
	case d.Pool() != nil:
		return nil, fmt.Errorf("adopt buffer %d: into a pool: not built yet: %w", k.File, syscall.EOPNOTSUPP)
	}
	if err := m.checkAccess(k.Access); err != nil {
		return nil, fmt.Errorf("adopt buffer %d: %w", k.File, err)
	}
	b := &Buffer{m: m, dom: d, owner: k.Owner}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := m.reserveBuffer(b, d, k.Owner, k.File); err != nil {
		return nil, fmt.Errorf("adopt buffer %d in pd %d: %w", k.File, d.handle, err)
	}
	f, err := ls.Open(k.File)
	if err != nil {
		b.abandonLocked() // no file yet: nothing is removed
		return nil, fmt.Errorf("adopt buffer: %w", err)
	}
	b.f, b.access, b.gen = f, k.Access, uint32(k.Generation)
	// A new process knows nothing of the file: it is one whose size a
	// client changed (Sync), and its pages are charged as they are.
	if err := b.syncLocked(); err != nil {
		return b, fmt.Errorf("adopt buffer %d: %w", k.File, err)
	}
	return b, nil
}
