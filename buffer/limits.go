package buffer

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/internal/sysmem"
	"mrfs/verbs"
)

// The limits, each checked in one place of this file, named as the log,
// user.mrfs.state and the metrics name them.
type limitKind string

const (
	limitMaxBuffers  limitKind = "max_buffers"
	limitMaxPinned   limitKind = "max_pinned"
	limitPerUser     limitKind = "max_pinned_per_user"
	limitMemAvail    limitKind = "MemAvailable"
	limitCgroup      limitKind = "memory cgroup"
	limitMemlock     limitKind = "RLIMIT_MEMLOCK"
	limitMaxMR       limitKind = "max_mr"
	limitNoFile      limitKind = "RLIMIT_NOFILE"
	limitMaxMapCount limitKind = "vm.max_map_count"
	limitStore       limitKind = "store"
	limitMaxPD       limitKind = "max_pd"
	limitPoolFull    limitKind = "pool"
	limitPoolAccess  limitKind = "pool access"
	limitPoolReopen  limitKind = "pool reopen"
	// limitCut keys the log of writes taken back past a quota.
	limitCut limitKind = "writes past max_pinned_per_user"
)

// limitError is a refusal because of a limit: the errno (or the device's
// error), and a short reason for Info.Reason.
type limitError struct {
	kind   limitKind
	reason string // e.g. "max_pinned (1 GiB) reached"
	err    error
}

func (e *limitError) Error() string { return e.reason + ": " + e.err.Error() }
func (e *limitError) Unwrap() error { return e.err }

// warnEvery bounds how often one kind of limit is logged.
const warnEvery = time.Minute

// now is the clock of the limit log, for tests.
var now = time.Now

// refuseLocked reports a refusal by kind: counted for the metrics, and
// logged at warn with how to raise the limit, once per kind per minute.
// It returns the error for the caller. Callers hold m.mu.
func (m *Manager) refuseLocked(kind limitKind, err error, reason, advice string, args ...any) error {
	m.events.LimitHit(string(kind))
	if t := now(); t.Sub(m.warned[kind]) >= warnEvery || m.warned[kind].IsZero() {
		m.warned[kind] = t
		m.log.Warn(advice, append([]any{"limit", string(kind)}, args...)...)
	}
	return &limitError{kind: kind, reason: reason, err: err}
}

// refuse is refuseLocked for callers without m.mu.
func (m *Manager) refuse(kind limitKind, err error, reason, advice string, args ...any) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.refuseLocked(kind, err, reason, advice, args...)
}

// memReserve is memory that admission leaves to everything else on the
// machine (or in the cgroup), so that pinning up to the edge does not
// make the kernel reclaim or kill.
const memReserve = 32 << 20

// tooLarge is admission's first step: a size that could never be
// registered, past the whole budget (max_pinned), is EFBIG (a file past
// the maximum size); past the owner's whole quota, EDQUOT. (A size past
// the device's max_mr_size is registered in several regions.) registerLocked asks it before it maps the size:
// mapping 900 TB fails with ENOMEM, which would name no limit.
func (m *Manager) tooLarge(length uint64, owner uint32) error {
	newP := pageRound(length)
	budget, quota := m.opt.MaxPinned, m.opt.MaxPinnedPerUser
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case budget > 0 && newP > budget:
		return m.refuseLocked(limitMaxPinned, syscall.EFBIG,
			fmt.Sprintf("%s is past max_pinned (%s)", bytesize.Format(length), bytesize.Format(budget)),
			fmt.Sprintf("cannot pin %s: it is more than max_pinned (%s) allows at all; raise buffers.max_pinned in the config", bytesize.Format(length), bytesize.Format(budget)),
			"value", budget, "request", length)
	case quota > 0 && newP > quota:
		return m.refuseLocked(limitPerUser, syscall.EDQUOT,
			fmt.Sprintf("%s is past max_pinned_per_user (%s)", bytesize.Format(length), bytesize.Format(quota)),
			fmt.Sprintf("cannot pin %s for uid %d: it is more than max_pinned_per_user (%s) allows; raise buffers.max_pinned_per_user in the config", bytesize.Format(length), owner, bytesize.Format(quota)),
			"value", quota, "uid", owner, "request", length)
	}
	return nil
}

// refusal is admission's answer before it is told: a limit, the errno,
// the reason for Info.Reason, the advice for the log, and how many bytes
// short the request is.
type refusal struct {
	kind   limitKind
	errno  syscall.Errno
	reason string
	advice string
	args   []any
	short  uint64
}

// releaseWait bounds how long admission waits for unlinked files to be
// released when their memory would make room: the kernel sends FUSE's
// RELEASE after a client's close returns, so an `rm` followed at once by
// a `truncate` can find the removed file's memory still there.
const releaseWait = 500 * time.Millisecond

// admit decides whether b's file may hold held+add bytes of the store
// (what it holds now, and the most the operation may add) and charges
// them to b's owner when so, in one step under m.mu: concurrent requests
// see each other's charges, so they can never pass together a bound each
// would pass alone.
// grows says the operation adds memory or registers more; otherwise
// (pages that exist already, a client's unseen writes) the charge is
// taken without a check. In order:
//
//  1. the owner's quota (max_pinned_per_user) with what it is charged:
//     EDQUOT;
//  2. the budget (max_pinned) with every charge: ENOSPC;
//  3. the pages to add against what the store has left, against what the
//     machine (MemAvailable) and the daemon's memory cgroup have left:
//     ENOSPC for the store, ENOMEM for the others.
//
// A refusal that unlinked files still held open would lift once released
// waits for them briefly (releaseWait); one of the budget or the store
// first charges what clients wrote unseen, and takes back what they
// wrote past their quotas (chargeUnseen), and asks again: a user inside
// its quota is not refused for another's writes past its own.
func (m *Manager) admit(b *Buffer, held, add uint64, grows bool) error {
	deadline := time.Now().Add(releaseWait)
	unseen := false
	m.mu.Lock()
	defer m.mu.Unlock()
	for {
		r := m.admitLocked(b, held, add, grows)
		if r == nil {
			return nil
		}
		if (r.kind == limitStore || r.kind == limitMaxPinned) && !unseen {
			unseen = true
			m.mu.Unlock()
			m.chargeUnseen(b)
			m.mu.Lock()
			continue
		}
		if m.releasingLocked(r, b) && m.waitReleaseLocked(deadline) {
			continue
		}
		return m.refuseLocked(r.kind, r.errno, r.reason, r.advice, r.args...)
	}
}

// releasingLocked says whether the memory of orphans other than b would
// lift r (b's own goes only when its caller closes it).
func (m *Manager) releasingLocked(r *refusal, b *Buffer) bool {
	own := uint64(0)
	if b.orphan {
		own = b.charge.Load()
	}
	switch r.kind {
	case limitPerUser:
		u := m.users[b.owner]
		return u != nil && u.Orphaned-min(own, u.Orphaned) >= r.short
	case limitMaxPinned, limitStore, limitMemAvail, limitCgroup:
		return m.orphaned-min(own, m.orphaned) >= r.short
	}
	return false
}

// admitLocked is admit's one attempt. Callers hold m.mu and b.mu.
func (m *Manager) admitLocked(b *Buffer, held, add uint64, grows bool) *refusal {
	want := held + add
	need := want - min(want, b.charge.Load())
	budget, quota := m.opt.MaxPinned, m.opt.MaxPinnedPerUser
	owner := b.owner
	u := m.user(owner)
	defer m.unuse(owner)
	if grows && quota > 0 && u.Charged+need > quota {
		return &refusal{kind: limitPerUser, errno: syscall.EDQUOT, short: u.Charged + need - quota,
			reason: fmt.Sprintf("max_pinned_per_user (%s) of uid %d reached", bytesize.Format(quota), owner),
			advice: fmt.Sprintf("cannot give uid %d %s more: it holds %s of its max_pinned_per_user (%s)%s; free some of its buffers or raise buffers.max_pinned_per_user",
				owner, bytesize.Format(need), bytesize.Format(u.Charged), bytesize.Format(quota), orphanNote(u.Orphaned)),
			args: []any{"value", quota, "uid", owner, "held", u.Charged, "request", need}}
	}
	if grows && budget > 0 && m.charged+need > budget {
		return &refusal{kind: limitMaxPinned, errno: syscall.ENOSPC, short: m.charged + need - budget,
			reason: fmt.Sprintf("max_pinned (%s) reached", bytesize.Format(budget)),
			advice: fmt.Sprintf("cannot pin %s more: max_pinned (%s) would be passed with %s held%s; free buffers or raise buffers.max_pinned in the config",
				bytesize.Format(need), bytesize.Format(budget), bytesize.Format(m.charged), orphanNote(m.orphaned)),
			args: []any{"value", budget, "held", m.charged, "request", need}}
	}
	// Only the pages to add need room: those a client made unseen are in
	// the store already.
	if add > 0 {
		if used, size, ok := m.store.Usage(); ok && used+add > size {
			return &refusal{kind: limitStore, errno: syscall.ENOSPC, short: used + add - size,
				reason: fmt.Sprintf("the store is full (%s)", bytesize.Format(size)),
				advice: fmt.Sprintf("cannot add %s: the backing store (max_pinned, %s) holds %s while %s is charged: clients wrote the rest through zero-copy opens, not charged yet; free buffers or raise buffers.max_pinned",
					bytesize.Format(add), bytesize.Format(size), bytesize.Format(used), bytesize.Format(m.charged)),
				args: []any{"value", size, "used", used, "charged", m.charged, "request", add}}
		}
		if r := m.memoryLocked(add); r != nil {
			return r
		}
	}
	m.setChargeLocked(b, b.charge.Load()+need)
	// Until settled, the pages admitted count as taken from the memory
	// left, however the readings come (memoryLeftLocked).
	b.reserved += add
	m.inflight += add
	m.memSince += add
	return nil
}

// orphanNote says how much of a charge is unlinked files still open.
func orphanNote(n uint64) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(" (%s of it in unlinked files still open)", bytesize.Format(n))
}

// storeFull names the store behind a failure to make pages (a population
// that faulted, an mlock that could not fault n bytes in) when the store
// has no room left: pages clients wrote unseen took it. own says the
// pages are the store's (not a source's): then a fault (EFAULT) or ENOSPC
// is the store's refusal even if it has room by now, as writes past a
// quota are taken back at their writer's close. Any other failure passes
// through.
func (m *Manager) storeFull(err error, n uint64, own bool) error {
	used, size, ok := m.store.Usage()
	refused := own && (verbs.Errno(err) == syscall.EFAULT || verbs.Errno(err) == syscall.ENOSPC)
	if g, _ := m.store.Grain(); !refused && (!ok || used+min(n, g) <= size) {
		return err
	}
	return m.refuse(limitStore, syscall.ENOSPC,
		fmt.Sprintf("the store is full (%s)", bytesize.Format(size)),
		fmt.Sprintf("cannot make the pages of %s: the backing store (max_pinned, %s) is full; clients wrote past what is charged through zero-copy opens; free buffers or raise buffers.max_pinned", bytesize.Format(n), bytesize.Format(size)),
		"value", size, "used", used, "err", err)
}

// fill makes n bytes of pages admitted for b (a fallocate). The store can
// have filled since the admission, with pages clients wrote unseen: then
// what they wrote past their quotas is taken back and fill tried once
// more, as a registration does, and a store still full is named.
func (m *Manager) fill(b *Buffer, n uint64, fill func() error) error {
	err := fill()
	if n == 0 || !errors.Is(err, syscall.ENOSPC) {
		return err
	}
	m.chargeUnseen(b)
	if err = fill(); errors.Is(err, syscall.ENOSPC) {
		return m.storeFull(err, n, true)
	}
	return err
}

// Reading the memory left (meminfo, the process's cgroup, mountinfo) costs
// about as much as the rest of a small buffer's registration, so a reading
// is reused for memoryFresh, less what was admitted since. Within
// memoryNear of a limit every admission reads afresh: there the answer
// must be today's, and the refusals are as exact as without reuse.
const (
	memoryFresh = 100 * time.Millisecond
	memoryNear  = 64 << 20
)

// memoryLocked checks that need bytes of new pages fit in what the
// machine and the daemon's memory cgroup have left, beyond memReserve.
// Callers hold m.mu, so that admissions see each other's pages
// (memSince) between readings.
func (m *Manager) memoryLocked(need uint64) *refusal {
	mem, err := m.memoryLeftLocked(need)
	if err != nil {
		m.log.Debug("cannot read the memory left; pinning without checking it", "err", err)
		return nil
	}
	if need+memReserve > mem.Available {
		return &refusal{kind: limitMemAvail, errno: syscall.ENOMEM, short: need + memReserve - mem.Available,
			reason: fmt.Sprintf("MemAvailable (%s) too low", bytesize.Format(mem.Available)),
			advice: fmt.Sprintf("cannot pin %s: the machine has %s available (MemAvailable) and mrfs leaves %s of it; free memory or lower buffers.max_pinned", bytesize.Format(need), bytesize.Format(mem.Available), bytesize.Format(memReserve)),
			args:   []any{"available", mem.Available, "request", need}}
	}
	if room, ok := mem.CgroupHeadroom(); ok && need+memReserve > room {
		return &refusal{kind: limitCgroup, errno: syscall.ENOMEM, short: need + memReserve - room,
			reason: fmt.Sprintf("memory cgroup limit (%s) reached", bytesize.Format(mem.CgroupLimit)),
			advice: fmt.Sprintf("cannot pin %s: the daemon's memory cgroup (%s) allows %s and uses %s; raise its limit or lower buffers.max_pinned", bytesize.Format(need), mem.Cgroup, bytesize.Format(mem.CgroupLimit), bytesize.Format(mem.CgroupUsage)),
			args:   []any{"value", mem.CgroupLimit, "usage", mem.CgroupUsage, "request", need}}
	}
	return nil
}

// memoryLeftLocked returns what the machine and the cgroup have left for
// a registration that adds need bytes of pages. Callers hold m.mu.
func (m *Manager) memoryLeftLocked(need uint64) (sysmem.Memory, error) {
	est, read, age := m.mem, !m.memAt.IsZero(), now().Sub(m.memAt)
	est.Available -= min(est.Available, m.memSince)
	est.CgroupUsage += m.memSince
	want := need + memReserve + memoryNear
	if room, limited := est.CgroupHeadroom(); read && age >= 0 && age < memoryFresh &&
		est.Available >= want && (!limited || room >= want) {
		return est, nil
	}
	mem, err := m.memory()
	if err != nil {
		return mem, err
	}
	// Pages admitted but maybe not made yet are not in the reading.
	m.mem, m.memAt, m.memSince = mem, now(), m.inflight
	mem.Available -= min(mem.Available, m.inflight)
	mem.CgroupUsage += m.inflight
	return mem, nil
}

// classifyLocked turns a device refusal that is a known limit into a
// limitError (same errno) that names it, and passes any other through.
// Callers hold m.mu.
func (m *Manager) classifyLocked(err error, length uint64) error {
	switch verbs.Errno(err) {
	case syscall.ENOMEM, syscall.EPERM:
		lim := verbs.MemlockLimit()
		if lim == 0 {
			return err // not RLIMIT_MEMLOCK (unlimited, or CAP_IPC_LOCK)
		}
		return m.refuseLocked(limitMemlock, err,
			fmt.Sprintf("RLIMIT_MEMLOCK (%s) reached", bytesize.Format(lim)),
			fmt.Sprintf("cannot pin %s: RLIMIT_MEMLOCK is %s; raise it with `ulimit -l` (LimitMEMLOCK= in a systemd unit) or run with CAP_IPC_LOCK", bytesize.Format(length), bytesize.Format(lim)),
			"value", lim)
	case syscall.EINVAL:
		// EINVAL from reg_mr is the device's region pool being full only
		// when mrfs holds max_mr regions (rxe, soft); anything else (a
		// size the device refuses) is the device's own answer.
		if m.attr.MaxMR > 0 && m.regions >= m.attr.MaxMR {
			dev := m.dev.Name()
			var de *verbs.DeviceError
			if errors.As(err, &de) {
				dev = de.Device // of several, the one that refused
			}
			return m.refuseLocked(limitMaxMR, err,
				fmt.Sprintf("device max_mr (%d) reached", m.attr.MaxMR),
				fmt.Sprintf("device %s refused a registration: its max_mr is %d and mrfs holds %d regions; free buffers or use a device with a larger max_mr", dev, m.attr.MaxMR, m.regions),
				"value", m.attr.MaxMR, "device", dev)
		}
	}
	return err
}

// classifyFd names RLIMIT_NOFILE behind EMFILE or ENFILE.
func (m *Manager) classifyFd(err error) error {
	if !errors.Is(err, syscall.EMFILE) && !errors.Is(err, syscall.ENFILE) {
		return err
	}
	var rl unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &rl)
	return m.refuse(limitNoFile, err,
		fmt.Sprintf("RLIMIT_NOFILE (%d) reached", rl.Cur),
		fmt.Sprintf("out of file descriptors: RLIMIT_NOFILE is %d and clients hold %d open buffers; raise it with `ulimit -n` (LimitNOFILE= in a systemd unit)", rl.Cur, m.Stats().OpenFds),
		"value", rl.Cur)
}

// isLimit says whether err is a refusal by limit kind.
func isLimit(err error, kind limitKind) bool {
	var le *limitError
	return errors.As(err, &le) && le.kind == kind
}

// reason is the Info.Reason for an error that left a registration short
// of the file.
func reason(err error) string {
	var le *limitError
	if errors.As(err, &le) {
		return le.reason
	}
	return err.Error()
}
