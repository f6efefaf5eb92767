package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"mrfs/buffer"
	"mrfs/fs"
	"mrfs/internal/config"
)

func cmdMount(args []string, stderr io.Writer) (err error) {
	f := flag.NewFlagSet("mount", flag.ContinueOnError)
	cfgPath := f.String("config", "", "config `FILE` (default: built-in defaults)")
	backend := f.String("backend", "", "verbs backend `auto|rdma|soft` (overrides the config)")
	device := f.String("device", "", "device `NAME` (overrides the config)")
	opts := f.String("o", "", "mount `OPTIONS`, comma-separated, as mount(8) takes them: config keys (backend=soft,allow_other,buffers.max_pinned=1GiB) and generic ones; see mrfs(8)")
	daemon := f.Bool("daemon", false, "go to the background once the mount is ready (exit 0), or exit with the error; the log goes to log.output")
	f.BoolVar(daemon, "d", false, "short for --daemon")
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
	if *daemon && os.Getenv(readyFDEnv) == "" {
		return daemonize(append([]string{"mount"}, args...), stderr)
	}
	svc, err := newService(cfg.Log, stderr, *daemon)
	if err != nil {
		return err
	}
	defer func() { svc.close(err) }()
	log := svc.log

	// Subscribe before anything is pinned or mounted: a signal that comes
	// while mounting is then handled by the teardown below, instead of
	// killing the daemon with its mount and regions left behind.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)

	prov, err := chooseProvider(cfg.Verbs, log)
	if err != nil {
		return err
	}
	dev, err := openDevice(prov, cfg.Verbs.Device)
	if err != nil {
		return err
	}
	remote, err := bindRemote(cfg.Remote, prov.Name(), log)
	if err != nil {
		dev.Close()
		return err
	}
	mgr := buffer.NewManager(dev, buffer.Options{
		MaxBuffers: cfg.Buffers.MaxBuffers,
		MaxPinned:  uint64(cfg.Buffers.MaxPinned),
		Allowed:    cfg.Buffers.AllowedAccess,
	}, log)
	srv, err := fs.Mount(dir, fs.Options{
		Manager:       mgr,
		Backend:       prov.Name(),
		ZeroCopy:      cfg.Mount.ZeroCopy,
		Umask:         cfg.Mount.Umask,
		DefaultSize:   uint64(cfg.Buffers.DefaultSize),
		DefaultAccess: cfg.Buffers.DefaultAccess,
		Log:           log,
		Remote:        remote.Where,
	}, fs.MountOptions{AllowOther: cfg.Mount.AllowOther, FsName: fsname})
	if err != nil {
		remote.Close()
		mgr.Close()
		dev.Close()
		if errors.Is(err, fs.ErrNoPassthrough) {
			return fmt.Errorf("%w; mrfs needs it for zero-copy mmap: run as root on Linux >= 6.9, or set mount.zero_copy = false for the degraded mode (no mmap)", err)
		}
		return err
	}
	if !cfg.Mount.ZeroCopy {
		log.Warn("zero copy is off (mount.zero_copy = false): reads and writes go through the daemon and mmap fails with ENODEV")
	}
	log.Info("mounted", "mountpoint", dir, "backend", prov.Name(), "device", dev.Name(),
		"zero_copy", cfg.Mount.ZeroCopy, "pid", os.Getpid())

	unmounted := make(chan struct{})
	go func() {
		srv.Wait()
		close(unmounted)
	}()
	var errs []error
	if err := remote.start(srv.Domain); err != nil {
		errs = append(errs, err)
	} else if err := svc.ready(dir, sigs); err != nil {
		errs = append(errs, err)
	} else {
		select {
		case sig := <-sigs:
			log.Info("shutting down", "signal", sig.String())
		case <-unmounted:
			log.Info("unmounted from outside; shutting down")
		}
	}
	svc.stopping()

	// DESIGN.md's order: every region deregistered and every PD
	// deallocated, the device closed, then the unmount.
	st := mgr.Stats()
	// Peers go first: their queue pairs live in the PDs, and no operation
	// may reach a region while it is deregistered.
	if err := remote.Close(); err != nil {
		errs = append(errs, err)
	}
	if err := mgr.Close(); err != nil {
		errs = append(errs, fmt.Errorf("deregister: %w", err))
	}
	if err := dev.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close device %s: %w", dev.Name(), err))
	}
	select {
	case <-unmounted:
	default:
		if err := srv.Unmount(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("teardown: %w", err)
	}
	log.Info("teardown complete", "deregistered_buffers", st.Buffers, "deallocated_pds", st.PDs,
		"unpinned_bytes", st.PinnedBytes)
	return nil
}
