package buffer

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/internal/sysmem"
	"mrfs/store"
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

// admit decides whether length bytes of f may be registered for owner in
// place of a region of oldLen bytes, and charges them when so. In order:
//
//  1. a size that could never be registered (tooLarge, which the caller
//     has asked before mapping): EFBIG or EDQUOT;
//  2. the owner's quota (max_pinned_per_user) with what it holds: EDQUOT;
//  3. the budget with what is registered now: ENOSPC;
//  4. the pages the registration would add (those the file does not hold
//     yet) against what the store, the machine (MemAvailable) and the
//     daemon's memory cgroup have left: ENOSPC for the store, ENOMEM for
//     the others.
//
// Only the net change counts: the moment during a replacement when both
// regions exist is mrfs's own doing, not the user's.
func (m *Manager) admit(f store.File, length, oldLen uint64, owner uint32) error {
	newP, oldP := pageRound(length), pageRound(oldLen)
	budget, quota := m.opt.MaxPinned, m.opt.MaxPinnedPerUser
	m.mu.Lock()
	if held := m.user(owner).PinnedBytes; quota > 0 && newP > oldP && held-oldP+newP > quota {
		defer m.mu.Unlock()
		m.unuse(owner)
		return m.refuseLocked(limitPerUser, syscall.EDQUOT,
			fmt.Sprintf("max_pinned_per_user (%s) of uid %d reached", bytesize.Format(quota), owner),
			fmt.Sprintf("cannot pin %s for uid %d: it holds %s of its max_pinned_per_user (%s); free some of its buffers or raise buffers.max_pinned_per_user", bytesize.Format(length), owner, bytesize.Format(held), bytesize.Format(quota)),
			"value", quota, "uid", owner, "held", held, "request", length)
	}
	if budget > 0 && newP > oldP && m.pinned-oldP+newP > budget {
		defer m.mu.Unlock()
		m.unuse(owner)
		return m.refuseLocked(limitMaxPinned, syscall.ENOSPC,
			fmt.Sprintf("max_pinned (%s) reached", bytesize.Format(budget)),
			fmt.Sprintf("cannot pin %s: max_pinned (%s) would be passed with %s pinned; free buffers or raise buffers.max_pinned in the config", bytesize.Format(length), bytesize.Format(budget), bytesize.Format(m.pinned)),
			"value", budget, "pinned", m.pinned, "request", length)
	}
	m.chargeLocked(owner, oldLen, length)
	m.mu.Unlock()

	if err := m.admitMemory(f, length); err != nil {
		m.mu.Lock()
		m.chargeLocked(owner, length, oldLen)
		m.mu.Unlock()
		return err
	}
	return nil
}

// admitMemory checks that the pages a registration of length bytes of f
// adds exist somewhere: in the store, on the machine, in the cgroup.
func (m *Manager) admitMemory(f store.File, length uint64) error {
	_, held, err := f.Stat()
	if err != nil {
		return err
	}
	if held >= pageRound(length) {
		return nil // every page is there already: pinning allocates nothing
	}
	need := pageRound(length) - held
	if used, size, ok := m.store.Usage(); ok && used+need > size {
		return m.refuse(limitMaxPinned, syscall.ENOSPC,
			fmt.Sprintf("the store is full (max_pinned, %s)", bytesize.Format(size)),
			fmt.Sprintf("cannot pin %s: the backing store (its size is max_pinned, %s) holds %s, part of it in files not registered (grown past a limit); free buffers or raise buffers.max_pinned", bytesize.Format(length), bytesize.Format(size), bytesize.Format(used)),
			"value", size, "used", used, "request", length)
	}
	mem, err := m.memoryLeft(need)
	if err != nil {
		m.log.Debug("cannot read the memory left; pinning without checking it", "err", err)
		return nil
	}
	if need+memReserve > mem.Available {
		return m.refuse(limitMemAvail, syscall.ENOMEM,
			fmt.Sprintf("MemAvailable (%s) too low", bytesize.Format(mem.Available)),
			fmt.Sprintf("cannot pin %s: the machine has %s available (MemAvailable) and mrfs leaves %s of it; free memory or lower buffers.max_pinned", bytesize.Format(need), bytesize.Format(mem.Available), bytesize.Format(memReserve)),
			"available", mem.Available, "request", need)
	}
	if room, ok := mem.CgroupHeadroom(); ok && need+memReserve > room {
		return m.refuse(limitCgroup, syscall.ENOMEM,
			fmt.Sprintf("memory cgroup limit (%s) reached", bytesize.Format(mem.CgroupLimit)),
			fmt.Sprintf("cannot pin %s: the daemon's memory cgroup (%s) allows %s and uses %s; raise its limit or lower buffers.max_pinned", bytesize.Format(need), mem.Cgroup, bytesize.Format(mem.CgroupLimit), bytesize.Format(mem.CgroupUsage)),
			"value", mem.CgroupLimit, "usage", mem.CgroupUsage, "request", need)
	}
	m.mu.Lock()
	m.memSince += need
	m.mu.Unlock()
	return nil
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

// memoryLeft returns what the machine and the cgroup have left for a
// registration that adds need bytes of pages.
func (m *Manager) memoryLeft(need uint64) (sysmem.Memory, error) {
	m.mu.Lock()
	est, read, age := m.mem, !m.memAt.IsZero(), now().Sub(m.memAt)
	est.Available -= min(est.Available, m.memSince)
	est.CgroupUsage += m.memSince
	m.mu.Unlock()
	want := need + memReserve + memoryNear
	if room, limited := est.CgroupHeadroom(); read && age >= 0 && age < memoryFresh &&
		est.Available >= want && (!limited || room >= want) {
		return est, nil
	}
	mem, err := m.memory()
	if err != nil {
		return mem, err
	}
	m.mu.Lock()
	m.mem, m.memAt, m.memSince = mem, now(), 0
	m.mu.Unlock()
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
			return m.refuseLocked(limitMaxMR, err,
				fmt.Sprintf("device max_mr (%d) reached", m.attr.MaxMR),
				fmt.Sprintf("device %s refused a registration: its max_mr is %d and mrfs holds %d regions; free buffers or use a device with a larger max_mr", m.dev.Name(), m.attr.MaxMR, m.regions),
				"value", m.attr.MaxMR, "device", m.dev.Name())
		}
	}
	return err
}

// classifyMap names the limit behind a failed mmap: ENOMEM with the
// process's mappings at vm.max_map_count.
func (m *Manager) classifyMap(err error) error {
	if !errors.Is(err, syscall.ENOMEM) {
		return m.classifyFd(err)
	}
	limit, n := maxMapCount(), mapCount()
	if limit == 0 || n+16 < limit {
		return err
	}
	return m.refuse(limitMaxMapCount, err,
		fmt.Sprintf("vm.max_map_count (%d) reached", limit),
		fmt.Sprintf("cannot map a buffer: the daemon has %d mappings and vm.max_map_count is %d (each registered buffer is one); raise it with `sysctl vm.max_map_count=...`", n, limit),
		"value", limit)
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

func maxMapCount() int {
	b, err := os.ReadFile("/proc/sys/vm/max_map_count")
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

func mapCount() int {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return 0
	}
	return strings.Count(string(b), "\n")
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
