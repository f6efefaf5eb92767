package buffer

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"io"
	"syscall"

	"mrfs/verbs"
)

// Domain is a protection domain and the buffers registered in it.
type Domain struct {
	m      *Manager
	pd     verbs.PD
	handle uint32 // pd.Handle(), fixed for the PD's life
	// token is the PD's remote-access secret, fixed for its life: a peer
	// must present it to get a queue pair in the PD (Token).
	token [TokenSize]byte

	// guarded by m.mu: the default access, the buffer count, closed,
	// closing and users.
	access  verbs.Access
	nbuf    int // buffers in d, counted from the start of their Create or Move
	closed  bool
	closing bool               // Close is closing the users
	users   map[*user]struct{} // see Attach
	pool    *Pool              // set once: its files are slots (pool.go)
	making  bool               // MakePool is making the pool
}

// user is something living in the PD besides regions (a queue pair, a
// remote connection) that must go before the PD is deallocated.
type user struct{ c io.Closer }

// NewDomain allocates a protection domain whose files get defaultAccess.
// defaultAccess is checked as SetAccess does (EINVAL, EPERM, EOPNOTSUPP).
func (m *Manager) NewDomain(defaultAccess verbs.Access) (*Domain, error) {
	return m.newDomain(defaultAccess, nil)
}

// newDomain is NewDomain with the token given, or a new one for nil.
func (m *Manager) newDomain(defaultAccess verbs.Access, token *[TokenSize]byte) (*Domain, error) {
	if err := m.checkAccess(defaultAccess); err != nil {
		return nil, err
	}
	// The place is taken before the device is asked, so that concurrent
	// mkdirs cannot pass max_pd together.
	m.mu.Lock()
	if err := m.reservePDLocked(); err != nil {
		m.mu.Unlock()
		return nil, err
	}
	m.mu.Unlock()
	pd, err := m.dev.AllocPD()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pdsPending--
	if err != nil {
		return nil, fmt.Errorf("allocate pd on %s: %w", m.dev.Name(), err)
	}
	d := &Domain{m: m, pd: pd, handle: pd.Handle(), access: defaultAccess}
	if token != nil {
		d.token = *token
	} else {
		rand.Read(d.token[:]) // never fails (crypto/rand, Go 1.24)
	}
	if m.closed { // Close ran while we allocated: it cannot see this PD
		pd.Dealloc()
		return nil, errClosed
	}
	m.domains[d] = struct{}{}
	return d, nil
}

// reservePDLocked takes a place for one more PD: ENOSPC, naming the
// device's max_pd, when it holds as many as it can (rather than its own
// EINVAL or ENOMEM, which name nothing). Callers hold m.mu.
func (m *Manager) reservePDLocked() error {
	if m.closed {
		return errClosed
	}
	if max := m.attr.MaxPD; max > 0 && len(m.domains)+m.pdsPending >= max {
		dev := m.dev.Name()
		if l, ok := m.dev.(interface {
			Limiting(func(verbs.DeviceAttr) int) string
		}); ok {
			dev = l.Limiting(func(a verbs.DeviceAttr) int { return a.MaxPD }) // of several, the smallest's
		}
		return m.refuseLocked(limitMaxPD, syscall.ENOSPC, fmt.Sprintf("device max_pd (%d) reached", max),
			fmt.Sprintf("cannot make a directory: each one is a protection domain, and device %s holds at most %d (max_pd); remove directories, or use a device with a larger max_pd", dev, max),
			"value", max, "device", dev)
	}
	m.pdsPending++
	return nil
}

// PD is the protection domain's number.
func (d *Domain) PD() uint32 { return d.handle }

// TokenSize is the size of a PD's token: 128 random bits.
const TokenSize = 16

// Token is the PD's token in hex (user.mrfs.token): what a remote peer
// presents to join the PD. Keys alone, even guessed, give nothing.
func (d *Domain) Token() string { return hex.EncodeToString(d.token[:]) }

// TokenIs says, in constant time, whether tok is the PD's token.
func (d *Domain) TokenIs(tok [TokenSize]byte) bool {
	return subtle.ConstantTimeCompare(tok[:], d.token[:]) == 1
}

// VerbsPD is the verbs protection domain, for creating queue pairs in it
// or serving one-sided operations (verbs.ResponderPD).
func (d *Domain) VerbsPD() verbs.PD { return d.pd }

// Attach registers c (a queue pair, a remote connection) to be closed
// when d closes, by rmdir or Manager.Close, before the PD is deallocated
// (the kernel refuses to free a PD that queue pairs still use). detach
// forgets c; call it when c ends on its own. ENOENT once d is closed or
// closing, ENODEV after Manager.Close.
func (d *Domain) Attach(c io.Closer) (detach func(), err error) {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	if err := d.openLocked(); err != nil {
		return nil, err
	}
	u := &user{c}
	if d.users == nil {
		d.users = make(map[*user]struct{})
	}
	d.users[u] = struct{}{}
	return func() {
		d.m.mu.Lock()
		delete(d.users, u)
		d.m.mu.Unlock()
	}, nil
}

// closeUsers closes what Attach registered, without m.mu held (a closer
// may take time or call back into d), and keeps new ones out meanwhile.
// It returns with m.mu held and closing cleared.
func (d *Domain) closeUsersLocked() {
	if len(d.users) == 0 {
		return
	}
	users := d.users
	d.users = nil
	d.closing = true
	d.m.mu.Unlock()
	for u := range users {
		u.c.Close()
	}
	d.m.mu.Lock()
	d.closing = false
}

// DefaultAccess is the access given to buffers created in d.
func (d *Domain) DefaultAccess() verbs.Access {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	return d.access
}

// SetDefaultAccess checks a (EINVAL, EPERM, EOPNOTSUPP as SetAccess) and
// stores it. Buffers already in d keep their access, but in a pool, whose
// chunks are re-registered with a (new keys for all its files).
func (d *Domain) SetDefaultAccess(a verbs.Access) error {
	if err := d.m.checkAccess(a); err != nil {
		return err
	}
	if p := d.Pool(); p != nil {
		if err := p.setAccess(a); err != nil {
			return err
		}
	}
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	if err := d.goneLocked(); err != nil {
		return err
	}
	d.access = a
	return nil
}

// Buffers is the number of buffers in d.
func (d *Domain) Buffers() int {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	return d.nbuf
}

// Close deallocates the PD; ENOTEMPTY while it holds buffers, ENOENT when
// it is already closed, ENODEV after Manager.Close.
func (d *Domain) Close() error {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	if err := d.goneLocked(); err != nil {
		return err
	}
	if d.nbuf > 0 {
		return fmt.Errorf("pd %d holds %d buffers: %w", d.handle, d.nbuf, syscall.ENOTEMPTY)
	}
	d.closeUsersLocked()
	if err := d.goneLocked(); err != nil { // closed meanwhile
		return err
	}
	if d.nbuf > 0 { // a Create or Move came in meanwhile
		return fmt.Errorf("pd %d holds %d buffers: %w", d.handle, d.nbuf, syscall.ENOTEMPTY)
	}
	if p := d.pool; p != nil {
		// Its chunks are the last regions in the PD: their slots' files
		// are gone. Without m.mu (the pool's lock comes first); closing
		// keeps buffers out meanwhile.
		d.closing = true
		d.m.mu.Unlock()
		err := p.close()
		d.m.mu.Lock()
		d.closing = false
		if err != nil {
			return fmt.Errorf("pd %d: %w", d.handle, err)
		}
	}
	// Dealloc under m.mu: a Create or Move into d reserves its place
	// under m.mu too, so none can register in the PD while it goes away.
	if err := d.pd.Dealloc(); err != nil {
		return fmt.Errorf("dealloc pd %d: %w", d.handle, err)
	}
	d.closed = true
	delete(d.m.domains, d)
	return nil
}

// openLocked is goneLocked, and ENOENT too while d closes (an rmdir
// under way): no buffer comes into a PD that is going. Callers hold m.mu.
func (d *Domain) openLocked() error {
	if err := d.goneLocked(); err != nil {
		return err
	}
	if d.closing {
		return fmt.Errorf("pd %d is being deallocated: %w", d.handle, syscall.ENOENT)
	}
	return nil
}

// goneLocked is the error for a closed domain or manager. Callers hold m.mu.
func (d *Domain) goneLocked() error {
	if d.m.closed {
		return errClosed
	}
	if d.closed {
		return fmt.Errorf("pd %d is deallocated: %w", d.handle, syscall.ENOENT)
	}
	return nil
}
