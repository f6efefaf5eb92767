package mount

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/fs"
	"mrfs/fuseconn"
	"mrfs/journal"
	"mrfs/store"
	"mrfs/tree"
)

// An upgrade in place (DESIGN, Restart) executes the new program in this
// process with the FUSE connection, the store's root and the saved state
// kept open across the exec, named by the environment below; the new
// program finds them (takeInherited) and adopts the mount instead of
// making one.
const (
	envState = "MRFS_RESTART_STATE_FD" // a memfd of restartState, as JSON
	envStore = "MRFS_RESTART_STORE_FD" // the tmpfs store's root
	// envBack is the program before's executable, open: a program that
	// fails to take the mount over executes it again (FallBack).
	envBack = "MRFS_RESTART_BACK_FD"
	// envBackArgs is the program before's arguments, as a JSON list.
	envBackArgs = "MRFS_RESTART_BACK_ARGS"
	// envFailed is why the program an upgrade executed gave the mount
	// back (set for the program before, executed again).
	envFailed = "MRFS_RESTART_FAILED"
)

// upgradeDrain bounds the wait for the requests under way when an
// upgrade holds new ones.
const upgradeDrain = 10 * time.Second

// restartState is what one program of the daemon hands the next.
type restartState struct {
	Tree     tree.State     `json:"tree"`
	Kernel   fs.KernelState `json:"kernel"`
	Restarts int            `json:"restarts"`
}

// inherited is what an earlier program of this process handed over.
type inherited struct {
	conn  int
	init  []byte
	store int
	state restartState
	// failed is why a later program gave the mount back to this one.
	failed string
	// crashed: the daemon before died; state is what its journal says
	// (no kernel's view), backing the kernel's backing ids.
	crashed bool
	backing map[uint64]int32
	done    map[uint64]bool
	// lost are what the journal held that no restart takes back (pools).
	lost []string
}

// back is what FallBack hands the program before, while this one has
// not taken the mount over: copies of what it was handed (the originals
// go to the store and go-fuse, which close them on a failure).
type back struct {
	exe, conn, store int // descriptors, closed on exec
	args             []string
	init, state      []byte
}

var handed struct {
	sync.Mutex // guards: the fields below
	taken      bool
	in         *inherited
	back       *back
}

// Restarted says whether this program was executed by an upgrade in
// place: it adopts a mount rather than making one (and is not to go to
// the background again).
func Restarted() bool {
	takeFdStore()
	handed.Lock()
	defer handed.Unlock()
	return handed.in != nil || os.Getenv(envState) != "" || os.Getenv(envJournal) != ""
}

// takeInherited takes what an earlier program handed over, or nil when
// this program is the mount's first; it clears the environment of it.
// It keeps what FallBack needs until served.
func takeInherited() (*inherited, error) {
	handed.Lock()
	defer handed.Unlock()
	if handed.taken {
		return handed.in, nil
	}
	handed.taken = true
	sv, stv, bv, failed := os.Getenv(envState), os.Getenv(envStore), os.Getenv(envBack), os.Getenv(envFailed)
	args := os.Getenv(envBackArgs)
	if os.Getenv(envJournal) != "" {
		in, err := takeCrashed()
		handed.in = in
		return in, err
	}
	if sv == "" {
		return nil, nil
	}
	for _, k := range []string{envState, envStore, envBack, envBackArgs, envFailed} {
		os.Unsetenv(k)
	}
	conn, init, ok, err := fuseconn.Inherited()
	if err == nil && !ok {
		err = fmt.Errorf("no FUSE connection was handed over")
	}
	sfd, err2 := strconv.Atoi(sv)
	stfd, err3 := strconv.Atoi(stv)
	if err := errors.Join(err, err2, err3); err != nil {
		return nil, fmt.Errorf("adopt the mount of the program before: %w", err)
	}
	unix.CloseOnExec(stfd)
	f := os.NewFile(uintptr(sfd), "restart-state")
	defer f.Close()
	raw, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("adopt the mount of the program before: read its state: %w", err)
	}
	in := &inherited{conn: conn, init: init, store: stfd, failed: failed}
	handed.in = in
	if bv != "" {
		handed.back, err = keepBack(bv, args, in, raw)
		if err != nil {
			return nil, err
		}
	}
	if err := json.Unmarshal(raw, &in.state); err != nil {
		return nil, fmt.Errorf("adopt the mount of the program before: its state: %w", err)
	}
	return in, nil
}

// takeCrashed takes what a keeper kept of a daemon that died: the
// connection, the store's root and the journal, from which it recovers
// the namespace.
func takeCrashed() (*inherited, error) {
	jv, stv, rv := os.Getenv(envJournal), os.Getenv(envStore), os.Getenv(envRestarts)
	for _, k := range []string{envJournal, envStore, envRestarts} {
		os.Unsetenv(k)
	}
	conn, init, ok, err := fuseconn.Inherited()
	if err == nil && !ok {
		err = fmt.Errorf("no FUSE connection was kept")
	}
	jfd, err2 := strconv.Atoi(jv)
	stfd, err3 := strconv.Atoi(stv)
	restarts, err4 := strconv.Atoi(rv)
	if err := errors.Join(err, err2, err3, err4); err != nil {
		return nil, fmt.Errorf("take over the mount of a daemon that died: %w", err)
	}
	unix.CloseOnExec(stfd)
	f := os.NewFile(uintptr(jfd), "journal")
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("take over the mount of a daemon that died: its journal: %w", err)
	}
	rec, err := journal.Recover(f, fi.Size())
	if err != nil {
		return nil, fmt.Errorf("take over the mount of a daemon that died: its journal: %w", err)
	}
	return &inherited{conn: conn, init: init, store: stfd, crashed: true, backing: rec.Backing, done: rec.Done,
		lost: rec.Lost, state: restartState{Tree: rec.Tree, Restarts: restarts}}, nil
}

// keepBack keeps copies of what in was handed, for FallBack.
func keepBack(exe, args string, in *inherited, state []byte) (*back, error) {
	b := &back{exe: -1, conn: -1, store: -1, init: in.init, state: state}
	fd, err := strconv.Atoi(exe)
	if err == nil {
		err = json.Unmarshal([]byte(args), &b.args)
	}
	if err == nil {
		unix.CloseOnExec(fd)
		b.exe = fd
		if b.conn, err = unix.FcntlInt(uintptr(in.conn), unix.F_DUPFD_CLOEXEC, 0); err == nil {
			b.store, err = unix.FcntlInt(uintptr(in.store), unix.F_DUPFD_CLOEXEC, 0)
		}
	}
	if err != nil {
		b.close()
		return nil, fmt.Errorf("keep the program before (%s=%q) to fall back to: %w", envBack, exe, err)
	}
	return b, nil
}

func (b *back) close() {
	for _, fd := range []int{b.exe, b.conn, b.store} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}

// served says the mount was taken over: no falling back from here on.
func served() {
	handed.Lock()
	defer handed.Unlock()
	if handed.back != nil {
		handed.back.close()
		handed.back = nil
	}
}

// FallBack, in a program an upgrade executed that failed (cause) before
// it took the mount over, executes the program before it again with what
// it was handed: that program adopts the mount as the upgrade left it,
// and says cause in upgrade_error. It returns only when there is no
// program to fall back to, or executing it failed; then the mount ends
// with this process.
func FallBack(cause error) error {
	_, err := takeInherited()
	handed.Lock()
	b := handed.back
	handed.back = nil
	handed.Unlock()
	if b == nil {
		return err
	}
	defer b.close()
	fmt.Fprintf(os.Stderr, "mrfs: the upgraded program failed, the program before takes the mount back: %v\n", cause)
	return execHandover(b.conn, b.init, b.store, b.state, fmt.Sprintf("/proc/self/fd/%d", b.exe), b.args,
		envFailed+"="+strings.ReplaceAll(cause.Error(), "\n", "; "))
}

// execHandover executes path (with args) in this process with the connection conn
// (its INIT init), the store's root store and the state kept open for it
// (takeInherited), and extra in its environment.
func execHandover(conn int, init []byte, store int, state []byte, path string, args []string, extra ...string) error {
	mfd, err := unix.MemfdCreate("mrfs-restart-state", 0)
	if err != nil {
		return fmt.Errorf("memfd_create: %w", err)
	}
	defer unix.Close(mfd)
	if _, err := unix.Pwrite(mfd, state, 0); err != nil {
		return fmt.Errorf("write the state: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(store), unix.F_SETFD, 0); err != nil {
		return fmt.Errorf("keep the store open: %w", err)
	}
	defer unix.CloseOnExec(store)
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "MRFS_RESTART_") {
			env = append(env, kv)
		}
	}
	env = append(env, fmt.Sprintf("%s=%d", envState, mfd), fmt.Sprintf("%s=%d", envStore, store))
	return fuseconn.Exec(conn, init, path, args, append(env, extra...))
}

// life is the daemon's side of fs.Life, and the one upgrade at a time.
type life struct {
	started  time.Time
	restarts int
	exe      string // the program's path when it started

	mu      sync.Mutex // guards: running, lastErr
	running bool
	lastErr string
}

func (l *life) get() fs.Life {
	l.mu.Lock()
	defer l.mu.Unlock()
	return fs.Life{Started: l.started, Restarts: l.restarts, UpgradeError: l.lastErr}
}

// startUpgrade checks binary and starts the upgrade (upgrade) off the
// request that asked for it, which must end before the requests are
// held. An upgrade that fails leaves the mount serving, and says why in
// the log and the stats.
func (p *parts) startUpgrade(binary string, log *slog.Logger) error {
	if binary == "" {
		binary = p.life.exe
	}
	if !strings.HasPrefix(binary, "/") {
		return fmt.Errorf("upgrade: %q is not an absolute path: %w", binary, syscall.EINVAL)
	}
	if err := unix.Access(binary, unix.X_OK); err != nil {
		return fmt.Errorf("upgrade: %s: %w", binary, err)
	}
	l := &p.life
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.running {
		return fmt.Errorf("upgrade: one is under way: %w", syscall.EBUSY)
	}
	l.running = true
	go func() {
		err := p.upgrade(binary, log)
		log.Error("upgrade failed; the mount goes on as it was", "binary", binary, "err", err)
		l.mu.Lock()
		l.running, l.lastErr = false, err.Error()
		l.mu.Unlock()
	}()
	return nil
}

// upgrade hands the mount to binary, executed in this process: requests
// are held and those under way finish; the namespace and what the kernel
// holds are saved; the connection, the store's root and the state stay
// open across the exec. It returns only on failure, with requests let
// through again.
func (p *parts) upgrade(binary string, log *slog.Logger) error {
	ls, ok := p.store.(store.Lasting)
	if !ok {
		return fmt.Errorf("the %s store dies with the process: every buffer would be lost: %w", p.store.Kind(), syscall.EOPNOTSUPP)
	}
	if err := p.srv.Pause(upgradeDrain); err != nil {
		return err
	}
	defer p.srv.Resume()
	time.Sleep(upgradeHold(log))
	st, err := p.tree.State()
	if err != nil {
		return err
	}
	sfd, err := ls.Handover()
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	// This program, kept open: the next one falls back to it if it fails
	// to take the mount over (the file at its path may be the new one).
	exe, err := unix.Open("/proc/self/exe", unix.O_RDONLY, 0)
	if err != nil {
		return fmt.Errorf("keep this program to fall back to: %w", err)
	}
	defer unix.Close(exe)
	args, err := json.Marshal(os.Args)
	if err != nil {
		return err
	}
	return p.srv.Handover(p.tree, func(h fs.Handover) error {
		state, err := json.Marshal(restartState{Tree: st, Kernel: h.Kernel, Restarts: p.life.restarts + 1})
		if err != nil {
			return err
		}
		log.Info("upgrading in place", "binary", binary, "buffers", len(st.Nodes), "kernel_nodes", len(h.Kernel.Nodes),
			"kernel_handles", len(h.Kernel.Handles), "state_bytes", len(state))
		return execHandover(h.Conn, h.Init, sfd, state, binary, os.Args,
			fmt.Sprintf("%s=%d", envBack, exe), envBackArgs+"="+string(args))
	})
}
