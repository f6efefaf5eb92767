package mount

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/fuseconn"
)

// A keeper (`mrfs mount --keeper`, DESIGN, Restart) is a small parent
// that runs the daemon and holds what a daemon restarted after a crash
// takes over: the daemon sends it, over a socket named by envKeeper, the
// FUSE connection, a memfd of its INIT, the store's root and the journal
// (a memfd the daemon writes as the namespace changes), each time a
// program of the daemon takes the mount. When the daemon dies, the keeper
// starts it again with them (envJournal instead of envState).
const (
	envKeeper   = "MRFS_KEEPER_FD"
	envJournal  = "MRFS_RESTART_JOURNAL_FD"
	envRestarts = "MRFS_RESTART_COUNT"
)

// keptSet is what the daemon hands the keeper: the descriptors, in the
// order of keptNames, and how many restarts the mount had survived.
type keptSet struct {
	fds      []int
	restarts int
}

// keptNames are a kept set's descriptors, in order.
var keptNames = []string{"connection", "init", "store", "journal"}

// keptMsg is the data of the keeper's message.
type keptMsg struct {
	Restarts int `json:"restarts"`
}

// crashLoop: a daemon that dies this many times within crashWindow of
// its start is not started again (the keeper lets the mount go).
const (
	crashLoop   = 5
	crashWindow = 10 * time.Second
)

// FirstStart is what only the first daemon a keeper starts is given: its
// Files at descriptor 4 on (3 is the keeper's socket) and more
// environment (a background mount's readiness pipe: a daemon started
// again after a crash has no one waiting for it).
type FirstStart struct {
	Files []*os.File
	Env   []string
}

// Keep runs the daemon, this program with args, as its child and keeps
// what the daemon hands it. A daemon killed by a signal, or whose Go
// runtime died (exit status 2), is started again when the keeper holds
// its mount, and takes the mount over; a stop signal (sigs) goes to the
// daemon, whose exit ends the keeper: code is its exit status. Keep
// closes first's files once the first daemon has them.
func Keep(args []string, sigs <-chan os.Signal, log *slog.Logger, first FirstStart) (code int, err error) {
	closeFirst := func() {
		for _, f := range first.Files {
			f.Close()
		}
		first.Files = nil
	}
	defer closeFirst()
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("keeper: socketpair: %w", err)
	}
	mine, theirs := sp[0], os.NewFile(uintptr(sp[1]), "keeper")
	defer unix.Close(mine)
	defer theirs.Close()
	var held *keptSet
	defer func() { held.close() }()
	var crashes []time.Time
	for {
		cmd := exec.Command("/proc/self/exe", args...)
		cmd.Args[0] = os.Args[0] // ps shows mrfs, not /proc/self/exe
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.ExtraFiles = []*os.File{theirs}
		cmd.Env = append(os.Environ(), envKeeper+"=3")
		var copies []*os.File // the child's, at 4 on: closed once it has them
		if held != nil {
			for i, fd := range held.fds {
				c, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
				if err != nil {
					return 0, fmt.Errorf("keeper: %w", err)
				}
				copies = append(copies, os.NewFile(uintptr(c), keptNames[i]))
			}
			cmd.ExtraFiles = append(cmd.ExtraFiles, copies...)
			cmd.Env = append(cmd.Env, fuseconn.Env(4, 5)...)
			cmd.Env = append(cmd.Env, envStore+"=6", envJournal+"=7", envRestarts+"="+strconv.Itoa(held.restarts+1))
		} else {
			cmd.ExtraFiles = append(cmd.ExtraFiles, first.Files...)
			cmd.Env = append(cmd.Env, first.Env...)
		}
		err := cmd.Start()
		for _, c := range copies {
			c.Close()
		}
		closeFirst()
		if err != nil {
			return 0, fmt.Errorf("keeper: start the daemon: %w", err)
		}
		started, restart := time.Now(), held != nil
		var handed bool
		var st syscall.WaitStatus
		held, handed, st, err = keepWhile(cmd, mine, held, sigs, log)
		if err != nil {
			return 0, err
		}
		// A daemon started again that fails before it takes the mount
		// over is tried again, as a crash is.
		failedRestart := restart && !handed && st.ExitStatus() != 0
		if !st.Signaled() && st.ExitStatus() != 2 && !failedRestart {
			return st.ExitStatus(), nil
		}
		if held == nil {
			return 0, fmt.Errorf("keeper: the daemon died (%s) before it handed the mount over", statusString(st))
		}
		if time.Since(started) < crashWindow {
			crashes = append(crashes, started)
		} else {
			crashes = nil
		}
		if len(crashes) >= crashLoop {
			return 0, fmt.Errorf("keeper: the daemon died %d times within %s of its start (last: %s); the mount goes", len(crashes), crashWindow, statusString(st))
		}
		log.Warn("keeper: the daemon died; starting another to take the mount over", "status", statusString(st),
			"pid", cmd.Process.Pid, "restarts", held.restarts+1)
	}
}

// stuckExit is how long a daemon whose main thread has exited may take
// for its other threads: one stuck in a request to its own mount (the
// kernel drops a name under its directory's lock, which a LOOKUP waiting
// for that very daemon holds) leaves only once another daemon answers.
const stuckExit = time.Second

// keepWhile takes the sets the daemon cmd hands over (sock) while it
// runs, passes stop signals on, and reaps it. It returns the last set,
// whether cmd handed one (sets still queued when the daemon died are
// read before it returns), and how it ended. A daemon dying (its main
// thread gone) that has not ended stuckExit later is taken as ended, by
// its main thread's status: its other threads may wait for the next
// daemon; it is reaped when they are done.
func keepWhile(cmd *exec.Cmd, sock int, held *keptSet, sigs <-chan os.Signal, log *slog.Logger) (_ *keptSet, handed bool, _ syscall.WaitStatus, _ error) {
	pidfd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return held, false, 0, fmt.Errorf("keeper: pidfd_open: %w", err)
	}
	defer unix.Close(pidfd)
	// Stop signals go to the daemon, whose exit ends the poll.
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case sig := <-sigs:
				log.Info("keeper: passing a stop signal to the daemon", "signal", sig.String())
				cmd.Process.Signal(sig)
			case <-done:
				return
			}
		}
	}()
	var dying time.Time           // when its main thread was first seen gone
	var stuck *syscall.WaitStatus // its status, taken as the end
	for exited := false; !exited; {
		fds := []unix.PollFd{{Fd: int32(sock), Events: unix.POLLIN}, {Fd: int32(pidfd), Events: unix.POLLIN}}
		if _, err := unix.Poll(fds, int(stuckExit/4/time.Millisecond)); err != nil && !errors.Is(err, unix.EINTR) {
			return held, handed, 0, fmt.Errorf("keeper: poll: %w", err)
		}
		exited = fds[1].Revents != 0
		if st, ok := mainThreadEnded(cmd.Process.Pid); !exited && ok {
			if dying.IsZero() {
				dying = time.Now()
			}
			if time.Since(dying) >= stuckExit {
				exited, stuck = true, &st
			}
		}
		// After the exit, every set still queued is read (the last one
		// counts), without waiting.
		for fds[0].Revents != 0 || exited {
			set, err := recvKept(sock)
			if errors.Is(err, unix.EAGAIN) {
				break
			}
			if err != nil {
				log.Error("keeper: a set the daemon handed over is refused", "err", err)
				continue
			}
			held.close()
			held, handed = set, true
			log.Debug("keeper: holding the mount", "restarts", set.restarts)
			if !exited {
				break
			}
		}
	}
	if stuck != nil {
		log.Warn("keeper: the daemon died, and a thread of it waits in a request to its own mount: the next daemon answers it",
			"status", statusString(*stuck), "pid", cmd.Process.Pid)
		go cmd.Wait()
		return held, handed, *stuck, nil
	}
	cmd.Wait()
	log.Info("keeper: the daemon ended", "status", cmd.ProcessState.String(), "pid", cmd.Process.Pid)
	return held, handed, cmd.ProcessState.Sys().(syscall.WaitStatus), nil
}

// mainThreadEnded says whether process pid's main thread has ended (a
// zombie while other threads live on) and its exit status, from
// /proc/PID/stat (exit_code, the 52nd field, as wait(2) gives it).
func mainThreadEnded(pid int) (syscall.WaitStatus, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:])) // from the 3rd field, the state
	if len(f) < 50 || f[0] != "Z" {
		return 0, false
	}
	code, err := strconv.Atoi(f[49])
	return syscall.WaitStatus(code), err == nil
}

// statusString says how a daemon ended, as os.ProcessState does.
func statusString(st syscall.WaitStatus) string {
	if st.Signaled() {
		return "signal: " + st.Signal().String()
	}
	return "exit status " + strconv.Itoa(st.ExitStatus())
}

// recvKept reads one set from sock, without waiting (EAGAIN: none).
func recvKept(sock int) (*keptSet, error) {
	buf := make([]byte, 512)
	oob := make([]byte, unix.CmsgSpace(len(keptNames)*4))
	n, oobn, _, _, err := unix.Recvmsg(sock, buf, oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, err
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			if r, err := unix.ParseUnixRights(&m); err == nil {
				fds = append(fds, r...)
			}
		}
	}
	set := &keptSet{fds: fds}
	var msg keptMsg
	if err := json.Unmarshal(buf[:n], &msg); err != nil || len(fds) != len(keptNames) {
		set.close()
		return nil, fmt.Errorf("%d descriptors and %q: want %d and the restarts", len(fds), buf[:n], len(keptNames))
	}
	set.restarts = msg.Restarts
	return set, nil
}

func (s *keptSet) close() {
	if s == nil {
		return
	}
	for _, fd := range s.fds {
		unix.Close(fd)
	}
}

// keeperFd is the socket to this daemon's keeper, or -1 without one.
func keeperFd() int {
	fd, err := strconv.Atoi(os.Getenv(envKeeper))
	if err != nil {
		return -1
	}
	return fd
}

// handToKeeper sends the keeper (its socket fd) what a later daemon
// takes the mount over with: the connection conn, its INIT, the store's
// root store and the journal journal, and the restarts survived.
func handToKeeper(fd, conn int, init []byte, store, journal, restarts int) error {
	initFd, err := fuseconn.InitFile(init)
	if err != nil {
		return fmt.Errorf("hand the mount to the keeper: %w", err)
	}
	defer unix.Close(initFd)
	msg, err := json.Marshal(keptMsg{Restarts: restarts})
	if err != nil {
		return err
	}
	if err := unix.Sendmsg(fd, msg, unix.UnixRights(conn, initFd, store, journal), nil, 0); err != nil {
		return fmt.Errorf("hand the mount to the keeper: %w", err)
	}
	return nil
}
