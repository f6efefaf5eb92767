package cli

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"mrfs/internal/config"
	"mrfs/mount"
)

func cmdMount(args []string, stderr io.Writer) (err error) {
	f := flag.NewFlagSet("mount", flag.ContinueOnError)
	cfgPath := f.String("config", "", "config `FILE` (default: built-in defaults)")
	backend := f.String("backend", "", "verbs backend `auto|rdma|soft` (overrides the config)")
	device := f.String("device", "", "device `NAME` (overrides the config)")
	opts := f.String("o", "", "mount `OPTIONS`, comma-separated, as mount(8) takes them: config keys (backend=soft,allow_other,buffers.max_pinned=1GiB) and generic ones; see mrfs(8)")
	daemon := f.Bool("daemon", false, "go to the background once the mount is ready (exit 0), or exit with the error; the log goes to log.output")
	f.BoolVar(daemon, "d", false, "short for --daemon")
	keeper := f.Bool("keeper", false, "run the daemon under a small parent that holds the mount and starts the daemon again if it dies (DESIGN, Restart); with --daemon, the keeper goes to the background")
	defer func() {
		// A program an upgrade executed that cannot take the mount over
		// gives it back to the program before.
		if err != nil && mount.Restarted() {
			if ferr := mount.FallBack(err); ferr != nil {
				err = fmt.Errorf("%w; and the program before could not take the mount back: %w", err, ferr)
			}
		}
	}()
	pos, err := parse(f, args, 1)
	if err != nil {
		return err
	}
	// Absolute: a daemon in the background works in /.
	dir, err := filepath.Abs(pos[0])
	if err != nil {
		return err
	}
	cfg, err := config.Load(*cfgPath)
	if err != nil {
		return err
	}
	fsname, err := applyMountOptions(&cfg, *opts)
	if err != nil {
		return err
	}
	if *backend != "" {
		cfg.Verbs.Backend = *backend
	}
	if *device != "" {
		cfg.Verbs.Device = *device
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if *keeper {
		if *daemon && os.Getenv(readyFDEnv) == "" {
			return daemonize(append([]string{"mount"}, args...), stderr)
		}
		return keep(args, dir, cfg.Log, *daemon, stderr)
	}
	// A program an upgrade executed in place is the daemon already, and
	// so is one a keeper started again: in the background with nobody
	// waiting for it to be ready.
	restarted := mount.Restarted()
	if *daemon && os.Getenv(readyFDEnv) == "" && !restarted {
		return daemonize(append([]string{"mount"}, args...), stderr)
	}
	svc, err := newService(cfg.Log, stderr, *daemon)
	if err != nil {
		return err
	}
	defer func() { svc.close(err) }()
	if !restarted {
		if err := clearDeadMount(dir, svc.log); err != nil {
			return err
		}
	}

	// Subscribe before anything is pinned or mounted: a signal that comes
	// while mounting is then handled by the teardown, instead of killing
	// the daemon with its mount and regions left behind.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	return mount.Run(mount.Options{Config: cfg, Dir: dir, FsName: fsname, Log: svc.log, Signals: sigs,
		Ready: svc.ready, Stopping: svc.stopping})
}

// keep runs `mrfs mount` with args but --keeper under a keeper
// (mount.Keep), which exits as the daemon does. In the background (the
// child of daemonize), the keeper has the readiness pipe and the log, as
// a daemon would, and its first daemon (in the background too) reports
// ready to the keeper, which then reports it on.
func keep(args []string, dir string, cfg config.Log, background bool, stderr io.Writer) (err error) {
	child := []string{"mount"}
	for _, a := range args {
		if a != "--keeper" && a != "-keeper" {
			child = append(child, a)
		}
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	log := slog.New(slog.NewTextHandler(stderr, nil))
	var first mount.FirstStart
	if background {
		// (A log that goes nowhere is the daemon's to warn of: once.)
		svc, err := newService(cfg, io.Discard, true)
		if err != nil {
			return err
		}
		defer func() { svc.close(err) }()
		log = svc.log
		r, w, err := os.Pipe()
		if err != nil {
			return fmt.Errorf("keeper: %w", err)
		}
		first = mount.FirstStart{Files: []*os.File{w}, Env: []string{readyFDEnv + "=4"}}
		relayed := make(chan struct{})
		defer func() { <-relayed }() // before svc.close, which reads isReady
		go func() {
			defer close(relayed)
			defer r.Close()
			// Until the first daemon is ready or gone: it closes its end.
			if msg, _ := io.ReadAll(r); !bytes.Equal(msg, []byte(readyMsg)) {
				return
			}
			if err := svc.ready(dir, make(chan os.Signal, 1)); err != nil {
				log.Error("keeper: the daemon is ready but the keeper cannot say so", "err", err)
			}
		}()
	}
	code, err := mount.Keep(child, sigs, log, first)
	if err != nil {
		return err
	}
	if code != 0 {
		return exitStatus(code)
	}
	return nil
}
