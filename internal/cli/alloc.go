package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/sys/unix"
	"golang.org/x/term"

	"mrfs/internal/bytesize"
	"mrfs/internal/config"
)

// exitInterrupted is the status of a command stopped by SIGINT, as a
// shell reports a process killed by it.
const exitInterrupted = 128 + int(syscall.SIGINT)

// cmdAlloc creates FILE on an mrfs mount, or resizes it, to SIZE bytes
// and waits until it is registered, showing the registration's progress
// (user.mrfs.state) as a bar on a terminal. Ctrl-C stops the
// registration: the daemon gets a FUSE INTERRUPT and leaves the file as
// it was.
func cmdAlloc(args []string, stdout, stderr io.Writer) error {
	f := flag.NewFlagSet("alloc", flag.ContinueOnError)
	access := f.String("access", "", "access flags to register with (as user.mrfs.access: local_write,remote_read,...), set before the resize; default: the file's")
	progress := f.String("progress", "auto", "`auto|bar|plain|none`: a bar on a terminal (auto), plain lines, or nothing")
	pos, err := parse(f, args, 2)
	if err != nil {
		return err
	}
	size, err := config.ParseSize(pos[0])
	if err != nil {
		return usageError("alloc: SIZE %q: %v", pos[0], err)
	}
	switch *progress {
	case "auto":
		*progress = "plain"
		if file, ok := stderr.(*os.File); ok && term.IsTerminal(int(file.Fd())) {
			*progress = "bar"
		}
	case "bar", "plain", "none":
	default:
		return usageError("alloc: --progress %q: want auto, bar, plain or none", *progress)
	}
	path := pos[1]
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("alloc: open %s: %w", path, err)
	}
	defer unix.Close(fd)
	if _, err := getxattrString(path, "user.mrfs.state"); err != nil {
		return fmt.Errorf("alloc: %s is not a buffer of an mrfs mount (%w)", path, err)
	}
	if *access != "" {
		if err := unix.Setxattr(path, "user.mrfs.access", []byte(*access), 0); err != nil {
			return fmt.Errorf("alloc: set access %q on %s: %w", *access, path, err)
		}
	}

	start := time.Now()
	show := newAllocProgress(*progress, stderr, path, uint64(size))
	interrupted, err := resize(fd, path, uint64(size), show)
	show.finish()
	switch {
	case errors.Is(err, unix.EINTR):
		fmt.Fprintf(stderr, "mrfs: alloc: interrupted; %s is unchanged\n", path)
		return exitStatus(exitInterrupted)
	case err != nil:
		return fmt.Errorf("alloc: resize %s to %s: %w", path, bytesize.Format(uint64(size)), err)
	}
	st, _ := getxattrString(path, "user.mrfs.state")
	fmt.Fprintf(stdout, "%s: %s %s in %s\n", path, bytesize.Format(uint64(size)), st, time.Since(start).Round(time.Millisecond))
	if interrupted {
		return exitStatus(exitInterrupted) // it finished before the interrupt took
	}
	return nil
}

// resize grows the file to size through ftruncate on a thread of its
// own, showing the registration's progress; a Ctrl-C interrupts the
// FUSE request (interrupted), and the daemon leaves the file as it was.
func resize(fd int, path string, size uint64, show *allocProgress) (interrupted bool, err error) {
	done := make(chan error, 1)
	tid := make(chan int, 1)
	var stopping atomic.Bool // the user interrupted: EINTR is final
	go func() {
		// The FUSE request is the calling thread's: a signal to that
		// thread is what makes the kernel send FUSE INTERRUPT.
		runtime.LockOSThread()
		tid <- unix.Gettid()
		for {
			// Any signal that reaches the thread interrupts the request,
			// and the daemon then stops the registration, leaving the
			// buffer as it was: unless the user asked, go on.
			err := unix.Ftruncate(fd, int64(size))
			if !errors.Is(err, unix.EINTR) || stopping.Load() {
				done <- err
				return
			}
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)

	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			if st, err := getxattrString(path, "user.mrfs.state"); err == nil {
				show.state(st)
			}
			continue
		case <-sigs:
			if !interrupted {
				interrupted = true
				stopping.Store(true)
				show.note("interrupting: the daemon stops and leaves " + path + " as it was")
				// SIGURG is harmless to Go (its preemption signal) and
				// wakes the thread's FUSE request.
				_ = unix.Tgkill(os.Getpid(), <-tid, unix.SIGURG)
			}
			continue
		case err = <-done:
		}
		break
	}
	return interrupted, err
}

func getxattrString(path, name string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Getxattr(path, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

var registeringRe = regexp.MustCompile(`^registering ([0-9]+)/([0-9]+)$`)

// allocProgress shows how far a registration has come.
type allocProgress struct {
	mode  string // bar, plain or none
	out   io.Writer
	path  string
	total uint64
	bar   *progressbar.ProgressBar
	last  time.Time // of the last plain line
}

func newAllocProgress(mode string, out io.Writer, path string, total uint64) *allocProgress {
	p := &allocProgress{mode: mode, out: out, path: path, total: total}
	if mode == "bar" {
		p.bar = progressbar.NewOptions64(int64(total),
			progressbar.OptionSetWriter(out),
			progressbar.OptionSetDescription("registering "+path),
			progressbar.OptionShowBytes(true),
			progressbar.OptionSetWidth(30),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish())
	}
	return p
}

// state takes a reading of user.mrfs.state.
func (p *allocProgress) state(st string) {
	m := registeringRe.FindStringSubmatch(st)
	if m == nil {
		return
	}
	done, _ := strconv.ParseUint(m[1], 10, 64)
	switch p.mode {
	case "bar":
		_ = p.bar.Set64(int64(done))
	case "plain":
		if time.Since(p.last) >= time.Second {
			p.last = time.Now()
			fmt.Fprintf(p.out, "%s: registering %s of %s\n", p.path, bytesize.Format(done), bytesize.Format(p.total))
		}
	}
}

func (p *allocProgress) note(msg string) {
	if p.mode == "bar" {
		_ = p.bar.Clear()
	}
	fmt.Fprintln(p.out, strings.TrimSpace(msg))
}

func (p *allocProgress) finish() {
	if p.mode == "bar" {
		_ = p.bar.Finish()
	}
}
