package buffer

// Locking.
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

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
)

// Manager owns every buffer and domain of one device.
type Manager struct {
	dev  verbs.Device
	attr verbs.DeviceAttr // queried once: device limits do not change
	opt  Options
	log  *slog.Logger

	mu sync.Mutex
	// guards (with mu): the sets of buffers and domains, counters.
	closed     bool
	buffers    map[*Buffer]struct{}
	domains    map[*Domain]struct{}
	registered uint64 // sum of registered lengths, net of a replacement in flight
	pinned     uint64 // the same in whole pages
	regions    int    // live regions, counting both during a replacement
	warned     map[limitKind]bool
	nextID     uint64
}

// NewManager returns a Manager registering on dev. It does not own dev:
// Close does not close it. A nil log discards messages.
func NewManager(dev verbs.Device, opt Options, log *slog.Logger) *Manager {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Manager{
		dev:     dev,
		attr:    dev.Attr(),
		opt:     opt,
		log:     log,
		buffers: make(map[*Buffer]struct{}),
		domains: make(map[*Domain]struct{}),
		warned:  make(map[limitKind]bool),
	}
}

// Device is the device buffers are registered on.
func (m *Manager) Device() verbs.Device { return m.dev }

// Options returns the options the manager enforces.
func (m *Manager) Options() Options { return m.opt }

// Stats returns current totals.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return Stats{
		Buffers:         len(m.buffers),
		PDs:             len(m.domains),
		RegisteredBytes: m.registered,
		PinnedBytes:     m.pinned,
	}
}

// checkAccess applies the checks of SetAccess and SetDefaultAccess, in
// the documented order.
func (m *Manager) checkAccess(a verbs.Access) error {
	if err := a.Validate(); err != nil {
		return err
	}
	if extra := a &^ m.opt.Allowed; extra != 0 {
		return fmt.Errorf("access %s: %s not in buffers.allowed_access (%s): %w",
			a, extra, m.opt.Allowed, syscall.EPERM)
	}
	if extra := a &^ m.attr.Access; extra != 0 {
		return fmt.Errorf("access %s: device %s does not support %s: %w",
			a, m.dev.Name(), extra, syscall.EOPNOTSUPP)
	}
	return nil
}

// Close closes what is attached to the domains (remote connections,
// queue pairs), frees every buffer (deregister, unmap, close) and
// deallocates every domain. It returns what it freed itself, counted as
// each call to the device succeeds, so that the caller can report the
// teardown that happened rather than the totals before it. Operations on
// the buffers and domains afterwards fail with ENODEV. Close is
// idempotent (a second call frees nothing); it does not close the device.
func (m *Manager) Close() (Freed, error) {
	var freed Freed
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return freed, nil
	}
	// From here Create and NewDomain refuse, so the sets only shrink.
	m.closed = true
	bufs := make([]*Buffer, 0, len(m.buffers))
	for b := range m.buffers {
		bufs = append(bufs, b)
	}
	var users []*user
	for d := range m.domains {
		for u := range d.users {
			users = append(users, u)
		}
		d.users = nil
	}
	m.mu.Unlock()

	// Peers go first: nothing reaches a region while it is deregistered,
	// and no queue pair holds a PD when it is deallocated.
	for _, u := range users {
		u.c.Close()
	}
	var errs []error
	for _, b := range bufs {
		// free waits for a Create still building b (it holds b.mu).
		unpinned, err := b.free(errClosed)
		if err != nil && !errors.Is(err, errClosed) && !errors.Is(err, errFreed) {
			errs = append(errs, err)
		}
		if unpinned > 0 {
			freed.Regions++
			freed.UnpinnedBytes += unpinned
		}
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	for d := range m.domains {
		if err := d.pd.Dealloc(); err != nil {
			errs = append(errs, fmt.Errorf("dealloc pd %d: %w", d.handle, err))
			continue
		}
		freed.PDs++
		d.closed = true
		delete(m.domains, d)
	}
	return freed, errors.Join(errs...)
}

// Sentinels for a buffer or domain that is gone. They wrap the errnos the
// FUSE layer answers with.
var (
	errFreed  = fmt.Errorf("buffer freed: %w", syscall.ENOENT)
	errClosed = fmt.Errorf("buffer manager closed: %w", syscall.ENODEV)
)

// limitKind names a limit for logging and for State Unregistered reasons.
type limitKind string

const (
	limitMaxBuffers limitKind = "max_buffers"
	limitMaxPinned  limitKind = "max_pinned"
	limitMemlock    limitKind = "RLIMIT_MEMLOCK"
	limitMaxMR      limitKind = "max_mr"
	limitNoFile     limitKind = "RLIMIT_NOFILE"
)

// limitError is a refusal because of a limit: the errno, and a short
// reason for Info.Reason.
type limitError struct {
	kind   limitKind
	reason string // e.g. "max_pinned (1 GiB) reached"
	err    error  // the errno, or the device's error
}

func (e *limitError) Error() string { return e.reason + ": " + e.err.Error() }
func (e *limitError) Unwrap() error { return e.err }

// warn logs a limit once; it is logged again only after clearLimit says the
// condition went away. Callers hold m.mu.
func (m *Manager) warn(kind limitKind, msg string, args ...any) {
	if m.warned[kind] {
		return
	}
	m.warned[kind] = true
	m.log.Warn(msg, append([]any{"limit", string(kind)}, args...)...)
}

// reserveBuffer counts one more buffer in d, or refuses with ENOSPC past
// MaxBuffers. Callers hold m.mu.
func (m *Manager) reserveBuffer(d *Domain) error {
	if m.closed {
		return errClosed
	}
	if d.m != m {
		return fmt.Errorf("domain belongs to another manager: %w", syscall.EINVAL)
	}
	if d.closed {
		return fmt.Errorf("pd %d is deallocated: %w", d.handle, syscall.ENOENT)
	}
	if max := m.opt.MaxBuffers; max > 0 && len(m.buffers) >= max {
		m.warn(limitMaxBuffers, fmt.Sprintf("max_buffers (%d) reached; raise buffers.max_buffers in the config", max),
			"value", max)
		return &limitError{kind: limitMaxBuffers, reason: fmt.Sprintf("max_buffers (%d) reached", max), err: syscall.ENOSPC}
	}
	delete(m.warned, limitMaxBuffers)
	return nil
}

// charge moves the byte counters from a region of oldLen to one of newLen
// (either may be 0). When check is set it refuses with ENOSPC if the
// page-rounded total would pass MaxPinned. The net change is what counts:
// the brief overlap of new and old regions during a replacement is the
// daemon's own doing, not the user's.
func (m *Manager) charge(oldLen, newLen uint64, check bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	oldP, newP := pageRound(oldLen), pageRound(newLen)
	total := m.pinned - oldP + newP
	if max := m.opt.MaxPinned; check && max > 0 && newP > oldP {
		if total > max {
			m.warn(limitMaxPinned, fmt.Sprintf("cannot pin %s: max_pinned (%s) would be passed with %s pinned; raise buffers.max_pinned in the config",
				formatSize(newLen), formatSize(max), formatSize(m.pinned)),
				"value", max, "pinned", m.pinned, "request", newLen)
			return &limitError{kind: limitMaxPinned, reason: fmt.Sprintf("max_pinned (%s) reached", formatSize(max)), err: syscall.ENOSPC}
		}
		delete(m.warned, limitMaxPinned)
	}
	m.pinned = total
	m.registered = m.registered - oldLen + newLen
	return nil
}

// errRaced says a client truncated the memfd below the range being
// registered while it was registered: pinning pages past EOF fails, and
// that failure says nothing about the device or a limit. Callers learn
// the new size and try again.
var errRaced = fmt.Errorf("memfd shrank during registration: %w", syscall.EAGAIN)

// maxRetries bounds the retries after errRaced.
const maxRetries = 3

// regMR registers [addr, addr+length) of fd's mapping in pd, charging
// the limits with the net change from a current region of oldLen bytes.
// It classifies a device refusal (RLIMIT_MEMLOCK, max_mr) for the log
// and Info.Reason, unless the memfd shrank meanwhile (errRaced).
func (m *Manager) regMR(fd int, pd verbs.PD, pdNum uint32, addr uintptr, length, oldLen uint64, a verbs.Access) (verbs.MR, error) {
	if err := m.charge(oldLen, length, true); err != nil {
		return nil, fmt.Errorf("register %s in pd %d: %w", formatSize(length), pdNum, err)
	}
	mr, err := pd.RegMR(addr, length, a)
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		m.pinned = m.pinned - pageRound(length) + pageRound(oldLen)
		m.registered = m.registered - length + oldLen
		if cur, serr := memfdSize(fd); serr == nil && cur < length {
			err = fmt.Errorf("%w (to %s): %w", errRaced, formatSize(cur), err)
		} else {
			err = m.classifyLocked(err, length)
		}
		return nil, fmt.Errorf("register %s in pd %d: %w", formatSize(length), pdNum, err)
	}
	m.regions++
	delete(m.warned, limitMemlock)
	delete(m.warned, limitMaxMR)
	return mr, nil
}

// classifyLocked turns a device refusal that is a known limit into a
// limitError (same errno) and logs how to raise the limit.
func (m *Manager) classifyLocked(err error, length uint64) error {
	switch verbs.Errno(err) {
	case syscall.ENOMEM, syscall.EPERM:
		var lim unix.Rlimit
		if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) != nil || lim.Cur == unix.RLIM_INFINITY {
			return err // not RLIMIT_MEMLOCK: pass it through as it is
		}
		m.warn(limitMemlock, fmt.Sprintf("cannot pin %s: RLIMIT_MEMLOCK is %s; raise it with `ulimit -l` or run with CAP_IPC_LOCK",
			formatSize(length), formatSize(lim.Cur)), "value", lim.Cur)
		return &limitError{kind: limitMemlock, reason: fmt.Sprintf("RLIMIT_MEMLOCK (%s) reached", formatSize(lim.Cur)), err: err}
	case syscall.EINVAL:
		// With access validated and a mapped range, EINVAL from reg_mr is
		// the device's region pool being full (rxe, soft).
		if m.attr.MaxMR <= 0 {
			return err
		}
		m.warn(limitMaxMR, fmt.Sprintf("device %s refused a registration: its max_mr is %d and mrfs holds %d regions; free buffers or use a device with a larger max_mr",
			m.dev.Name(), m.attr.MaxMR, m.regions), "value", m.attr.MaxMR, "device", m.dev.Name())
		return &limitError{kind: limitMaxMR, reason: fmt.Sprintf("device max_mr (%d) reached", m.attr.MaxMR), err: err}
	}
	return err
}

// deregMR deregisters mr. uncharge says whether its bytes still count:
// after a replacement the new region's regMR already charged the net
// change, so the old one's bytes are gone from the totals.
func (m *Manager) deregMR(mr verbs.MR, uncharge bool) error {
	if err := mr.Dereg(); err != nil {
		return fmt.Errorf("deregister %s (lkey 0x%x) in pd %d: %w", formatSize(mr.Length()), mr.LKey(), mr.PD().Handle(), err)
	}
	m.mu.Lock()
	m.regions--
	if uncharge {
		m.pinned -= pageRound(mr.Length())
		m.registered -= mr.Length()
	}
	m.mu.Unlock()
	return nil
}

// reason is the Info.Reason for an error that left a buffer Unregistered.
func reason(err error) string {
	var le *limitError
	if errors.As(err, &le) {
		return le.reason
	}
	return err.Error()
}
