package buffer

import (
	"fmt"
	"syscall"

	"mrfs/verbs"
)

// Domain is a protection domain and the buffers registered in it.
type Domain struct {
	m      *Manager
	pd     verbs.PD
	handle uint32 // pd.Handle(), fixed for the PD's life

	// guarded by m.mu: the default access, the buffer count, closed.
	access verbs.Access
	nbuf   int // buffers in d, counted from the start of their Create or Move
	closed bool
}

// NewDomain allocates a protection domain whose files get defaultAccess.
// defaultAccess is checked as SetAccess does (EINVAL, EPERM, EOPNOTSUPP).
func (m *Manager) NewDomain(defaultAccess verbs.Access) (*Domain, error) {
	if err := m.checkAccess(defaultAccess); err != nil {
		return nil, err
	}
	m.mu.Lock()
	closed := m.closed
	m.mu.Unlock()
	if closed {
		return nil, errClosed
	}
	pd, err := m.dev.AllocPD()
	if err != nil {
		return nil, fmt.Errorf("allocate pd on %s: %w", m.dev.Name(), err)
	}
	d := &Domain{m: m, pd: pd, handle: pd.Handle(), access: defaultAccess}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed { // Close ran while we allocated: it cannot see this PD
		pd.Dealloc()
		return nil, errClosed
	}
	m.domains[d] = struct{}{}
	return d, nil
}

// PD is the protection domain's number.
func (d *Domain) PD() uint32 { return d.handle }

// DefaultAccess is the access given to buffers created in d.
func (d *Domain) DefaultAccess() verbs.Access {
	d.m.mu.Lock()
	defer d.m.mu.Unlock()
	return d.access
}

// SetDefaultAccess checks a (EINVAL, EPERM, EOPNOTSUPP as SetAccess) and
// stores it. Buffers already in d keep their access.
func (d *Domain) SetDefaultAccess(a verbs.Access) error {
	if err := d.m.checkAccess(a); err != nil {
		return err
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
	// Dealloc under m.mu: a Create or Move into d reserves its place
	// under m.mu too, so none can register in the PD while it goes away.
	if err := d.pd.Dealloc(); err != nil {
		return fmt.Errorf("dealloc pd %d: %w", d.handle, err)
	}
	d.closed = true
	delete(d.m.domains, d)
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
