package mount

import (
	"encoding/json"
	"errors"
	"fmt"
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
}

// Restarted says whether this program was executed by an upgrade in
// place: it adopts a mount rather than making one (and is not to go to
// the background again).
func Restarted() bool { return os.Getenv(envState) != "" }

// takeInherited takes what an earlier program handed over, or nil when
// this program is the mount's first; it clears the environment of it.
func takeInherited() (*inherited, error) {
	sv, stv := os.Getenv(envState), os.Getenv(envStore)
	if sv == "" {
		return nil, nil
	}
	os.Unsetenv(envState)
	os.Unsetenv(envStore)
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
	in := &inherited{conn: conn, init: init, store: stfd}
	if err := json.NewDecoder(f).Decode(&in.state); err != nil {
		return nil, fmt.Errorf("adopt the mount of the program before: its state: %w", err)
	}
	return in, nil
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
	st, err := p.tree.State()
	if err != nil {
		return err
	}
	sfd, err := ls.Handover()
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	if _, err := unix.FcntlInt(uintptr(sfd), unix.F_SETFD, 0); err != nil {
		return fmt.Errorf("keep the store open: %w", err)
	}
	mfd, err := unix.MemfdCreate("mrfs-restart-state", 0)
	if err != nil {
		return fmt.Errorf("memfd_create: %w", err)
	}
	defer unix.Close(mfd)
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, envState+"=") && !strings.HasPrefix(kv, envStore+"=") {
			env = append(env, kv)
		}
	}
	env = append(env, fmt.Sprintf("%s=%d", envState, mfd), fmt.Sprintf("%s=%d", envStore, sfd))
	return p.srv.Handover(p.tree, func(h fs.Handover) error {
		state, err := json.Marshal(restartState{Tree: st, Kernel: h.Kernel, Restarts: p.life.restarts + 1})
		if err != nil {
			return err
		}
		if _, err := unix.Pwrite(mfd, state, 0); err != nil {
			return fmt.Errorf("write the state: %w", err)
		}
		log.Info("upgrading in place", "binary", binary, "buffers", len(st.Nodes), "kernel_nodes", len(h.Kernel.Nodes),
			"kernel_handles", len(h.Kernel.Handles), "state_bytes", len(state))
		return fuseconn.Exec(h.Conn, h.Init, binary, os.Args, env)
	})
}
