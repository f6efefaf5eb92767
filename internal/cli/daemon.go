package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/internal/config"
	"mrfs/internal/sdnotify"
)

// readyFDEnv names the descriptor on which a daemon's child reports that
// its mount is ready; its presence makes `mrfs mount --daemon` the child.
const readyFDEnv = "MRFS_READY_FD"

// readyMsg is what the child writes on that descriptor (as to systemd).
const readyMsg = "READY=1\n"

// daemonize starts `mrfs argv...` again, from the same binary, in a new
// session, and waits until the child's mount is ready (nil: the caller
// exits 0 and the child serves on) or the child exits first (its status:
// its error is on the stderr both share). A Go program cannot fork
// without exec, so the child is a fresh run of the command line that
// finds readyFDEnv set; it reports readiness on a pipe and closes it.
func daemonize(argv []string, stderr io.Writer) error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("daemon: %w", err)
	}
	defer r.Close()
	// /proc/self/exe is this very binary even if its file was replaced.
	cmd := &exec.Cmd{Path: "/proc/self/exe", Args: append([]string{os.Args[0]}, argv...)}
	// NOTIFY_SOCKET is this process's: a service manager would refuse
	// the child's notifications (not its main pid).
	cmd.Env = append(slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "NOTIFY_SOCKET=") || strings.HasPrefix(kv, readyFDEnv+"=")
	}), readyFDEnv+"=3")
	cmd.ExtraFiles = []*os.File{w} // fd 3
	cmd.Stderr = stderr            // until ready; stdin and stdout are /dev/null
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}

	// Ctrl-C or a stop while mounting reaches the child, which tears
	// down what it has set up and does not report ready (the hangup of a
	// terminal too: the child, in its own session, handles only these).
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	if err := cmd.Start(); err != nil {
		signal.Stop(sigs)
		w.Close()
		return fmt.Errorf("daemon: start %s: %w", os.Args[0], err)
	}
	w.Close()
	forward := func(s os.Signal) {
		if s == syscall.SIGHUP {
			s = syscall.SIGTERM
		}
		_ = cmd.Process.Signal(s)
	}
	done, forwarded := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(forwarded)
		for {
			select {
			case s := <-sigs:
				forward(s)
			case <-done:
				// A signal that came as the child got ready still
				// reaches it: nothing arrives after signal.Stop.
				for {
					select {
					case s := <-sigs:
						forward(s)
					default:
						return
					}
				}
			}
		}
	}()
	defer func() {
		signal.Stop(sigs)
		close(done)
		<-forwarded
	}()

	msg, _ := io.ReadAll(r) // until the child is ready or gone
	if bytes.Equal(msg, []byte(readyMsg)) {
		return nil // cmd is not waited for: the child outlives this process
	}
	err = cmd.Wait()
	var ee *exec.ExitError
	switch {
	case err == nil:
		// A signal stopped it cleanly before it was ready.
		fmt.Fprintln(stderr, "mrfs: the daemon stopped before its mount was ready")
		return exitStatus(exitFailure)
	case errors.As(err, &ee) && ee.ExitCode() > 0:
		return exitStatus(ee.ExitCode())
	}
	return fmt.Errorf("daemon: %w before its mount was ready", err)
}

// service is the daemon's side of its supervisor: systemd's
// notifications in the foreground; in the background (the child of
// daemonize), the readiness pipe, the detachment from the starting
// process's stderr and the log's last line.
type service struct {
	log        *slog.Logger
	sink       *logSink
	background bool
	readyPipe  *os.File // the child's fd 3 until ready; nil in the foreground
	isReady    bool
}

// newService opens the log and, in a daemon's child (background), takes
// over the readiness pipe. A program in the background without one (an
// upgrade's, or one a keeper started again) has nobody waiting for it,
// but logs as a daemon in the background does.
func newService(cfg config.Log, stderr io.Writer, background bool) (*service, error) {
	s := &service{background: background}
	if fd, ok := os.LookupEnv(readyFDEnv); background && ok {
		n, err := strconv.Atoi(fd)
		if err != nil || n < 3 {
			return nil, fmt.Errorf("daemon: %s=%q is not a descriptor", readyFDEnv, fd)
		}
		os.Unsetenv(readyFDEnv)
		unix.CloseOnExec(n) // not for fusermount3
		s.readyPipe = os.NewFile(uintptr(n), "ready")
	}
	sink, err := openLog(cfg, stderr, s.background)
	if err != nil {
		if s.readyPipe != nil {
			s.readyPipe.Close()
		}
		return nil, err
	}
	s.sink, s.log = sink, sink.log
	return s, nil
}

// ready is called once the mount is up: it checks that the mount
// answers (a statfs served by this daemon), then tells whoever waits.
// A stop signal that came while mounting (in sigs) means it is not ready:
// it is put back for the caller, which tears down.
func (s *service) ready(dir string, sigs chan os.Signal) error {
	select {
	case sig := <-sigs:
		select {
		case sigs <- sig:
		default: // another one is queued
		}
		return nil
	default:
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("the mount at %s does not answer: %w", dir, err)
	}
	if st.Type != unix.FUSE_SUPER_MAGIC {
		return fmt.Errorf("%s is not a FUSE mount after mounting (statfs type %#x)", dir, st.Type)
	}
	s.isReady = true
	if !s.background {
		if err := sdnotify.Notify("READY=1\nSTATUS=serving " + dir); err != nil {
			s.log.Warn("systemd notification failed", "err", err)
		}
		return nil
	}
	// Off the starting process's stderr (it may be a terminal, or a pipe
	// that mount(8)'s caller reads until EOF) and out of its working
	// directory (which it may want to unmount): the mount point and every
	// path mrfs keeps are absolute.
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("daemon: %w", err)
	}
	out := s.sink.file
	if out == nil {
		null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("daemon: %w", err)
		}
		defer null.Close()
		out = null
	}
	for _, fd := range []int{1, 2} {
		if err := unix.Dup3(int(out.Fd()), fd, 0); err != nil {
			return fmt.Errorf("daemon: redirect fd %d: %w", fd, err)
		}
	}
	if s.readyPipe == nil {
		return nil
	}
	_, err := s.readyPipe.WriteString(readyMsg)
	s.readyPipe.Close()
	s.readyPipe = nil
	if err != nil {
		return fmt.Errorf("daemon: report readiness: %w", err)
	}
	return nil
}

// stopping is called when the teardown starts.
func (s *service) stopping() {
	if !s.background && s.isReady {
		if err := sdnotify.Notify("STOPPING=1"); err != nil {
			s.log.Warn("systemd notification failed", "err", err)
		}
	}
}

// close ends the log. In the background, nobody sees the exit status or
// the error once the starting process is gone: the log's last line
// says them.
func (s *service) close(err error) {
	if s.background && s.isReady {
		if err != nil {
			s.log.Error("daemon exiting", "status", exitCode(err), "err", err)
		} else {
			s.log.Info("daemon exiting", "status", exitOK)
		}
	}
	if s.readyPipe != nil {
		s.readyPipe.Close() // not ready: the starting process reports the error
	}
	s.sink.Close()
}
