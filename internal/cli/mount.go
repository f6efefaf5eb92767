package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"mrfs/buffer"
	"mrfs/fs"
	"mrfs/internal/config"
	"mrfs/tree"
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
	mapReserve := testMapReserve(log)
	defaultMaxBuffers(&cfg.Buffers, mapReserve, log)
	st, budget, err := openStore(cfg.Buffers, log)
	if err != nil {
		dev.Close()
		return err
	}
	mx, err := startMetrics(cfg.Metrics, log)
	if err != nil {
		st.Close()
		dev.Close()
		return err
	}
	remote, err := bindRemote(cfg.Remote, prov.Name(), mx.remoteEvents(), log)
	if err != nil {
		mx.Close()
		st.Close()
		dev.Close()
		return err
	}
	pub := &publishing{next: mx.bufferEvents()}
	mgr := buffer.NewManager(dev, buffer.Options{
		Store:            st,
		MaxBuffers:       cfg.Buffers.MaxBuffers,
		MaxPinned:        budget,
		MaxPinnedPerUser: uint64(cfg.Buffers.MaxPinnedPerUser),
		Allowed:          cfg.Buffers.AllowedAccess,
		// The daemon's own descriptors beyond clients' opens: the store's
		// transient opens, the FUSE device, remote peers' sockets.
		FdReserve:         128 + remoteSockets(cfg.Remote),
		Events:            pub,
		PopulateThreshold: uint64(cfg.Buffers.PopulateThreshold),
		PopulateWorkers:   cfg.Buffers.PopulateWorkers,
		MaxRegionSize:     uint64(cfg.Buffers.MaxRegionSize),
		ChunkDelay:        chunkDelay(log),
		MapReserve:        mapReserve,
	}, log)
	mx.watch(mgr)
	// The root belongs to whoever mounts (a non-root user's own mount).
	tr, err := tree.New(mgr, tree.Options{
		DefaultSize:   uint64(cfg.Buffers.DefaultSize),
		DefaultAccess: cfg.Buffers.DefaultAccess,
		Umask:         cfg.Mount.Umask,
		Log:           log,
		Changed:       pub.changed,
	}, cfg.Buffers.DefaultAccess, tree.Owner{UID: uint32(os.Getuid()), GID: uint32(os.Getgid())}, 0o755)
	var srv *fs.Server
	if err == nil {
		// Peers may name the tree's directories from now on: by the time
		// the mount is visible, a peer never finds mrfs still mounting.
		remote.Serve(tr.Domain)
		srv, err = fs.Mount(dir, fs.Options{
			Tree:     tr,
			Backend:  prov.Name(),
			ZeroCopy: cfg.Mount.ZeroCopy,
			Log:      log,
			Remote:   remote.Where,
		}, fs.MountOptions{AllowOther: cfg.Mount.AllowOther, FsName: fsname, RequestLog: requestLog(cfg.Log, log)})
	}
	if err != nil {
		remote.Close()
		mgr.Close()
		dev.Close()
		st.Close()
		mx.Close()
		if errors.Is(err, fs.ErrNoPassthrough) {
			return fmt.Errorf("%w; mrfs needs it for zero-copy mmap: run as root on Linux >= 6.9, or set mount.zero_copy = false for the degraded mode (no mmap)", err)
		}
		return err
	}
	if err := pub.start(cfg.Publish, tr, dir, remote.Where, log); err != nil {
		log.Error("publish: cannot start; buffers are not published", "err", err)
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
	if err := svc.ready(dir, sigs); err != nil {
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
	// Published keys go first (peers must not find what is going), then
	// peers: their queue pairs live in the PDs, and no operation may
	// reach a region while it is deregistered.
	if err := pub.close(); err != nil {
		errs = append(errs, fmt.Errorf("publish: %w", err))
	}
	if err := remote.Close(); err != nil {
		errs = append(errs, err)
	}
	freed, err := mgr.Close()
	if err != nil {
		errs = append(errs, fmt.Errorf("deregister: %w", err))
	}
	pauseAfterTeardown(sigs, freed, log)
	if err := dev.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close device %s: %w", dev.Name(), err))
	}
	if err := st.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close the backing store: %w", err))
	}
	mx.Close()
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
	log.Info("teardown complete", freedAttrs(freed)...)
	return nil
}

// defaultMaxBuffers lowers buffers.max_buffers' default to what
// vm.max_map_count lets the daemon map: each registered buffer is one
// mapping, and a daemon out of mappings cannot grow its own heap. A value
// other than the default stays (one equal to it is taken for the
// default); the mapping limit is admitted anyway.
func defaultMaxBuffers(b *config.Buffers, mapReserve int, log *slog.Logger) {
	if b.MaxBuffers != config.Default().Buffers.MaxBuffers {
		return
	}
	if n, ok := buffer.MapHeadroom(mapReserve); ok && n < b.MaxBuffers {
		log.Info("max_buffers lowered from its default to what vm.max_map_count leaves the daemon (each registered buffer is one mapping)",
			"max_buffers", n, "default", b.MaxBuffers)
		b.MaxBuffers = n
	}
}

// freedAttrs are the log attributes of what Manager.Close freed.
func freedAttrs(f buffer.Freed) []any {
	return []any{"deregistered_regions", f.Regions, "deallocated_pds", f.PDs, "unpinned_bytes", f.UnpinnedBytes}
}

// pauseEnv names a test hook. Set to 1, the daemon stops between the
// buffers' teardown and the device's close: it logs "paused after
// teardown" and waits for another SIGINT or SIGTERM. Tests then look at
// what the kernel still holds for the live daemon; after the device's
// close, or the exit, the kernel would have released whatever mrfs left
// registered, and that would hide the leak.
const pauseEnv = "MRFS_TEST_PAUSE_AFTER_TEARDOWN"

// chunkDelayEnv is a test hook: a duration to pause after each chunk a big
// registration populates, so that tests can watch its progress and
// interrupt it. Logged at warn: it slows every big registration.
const chunkDelayEnv = "MRFS_TEST_CHUNK_DELAY"

// mapReserveEnv is a test hook: the mappings the daemon keeps for itself
// below vm.max_map_count, so that a test under emulation reaches the
// limit with a few thousand buffers rather than 64,000 (the sysctl is the
// machine's: tests never lower it). Logged at warn.
const mapReserveEnv = "MRFS_TEST_MAP_RESERVE"

func testMapReserve(log *slog.Logger) int {
	v := os.Getenv(mapReserveEnv)
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		log.Warn("ignoring a test hook that is not a positive count", "hook", mapReserveEnv, "value", v)
		return 0
	}
	log.Warn("test hook: the daemon keeps this many mappings below vm.max_map_count", "hook", mapReserveEnv, "reserve", n)
	return n
}

// publishDelayEnv is a test hook: a duration each publication pass waits
// before it writes to etcd, so that a removal not waited for is seen.
// Logged at warn.
const publishDelayEnv = "MRFS_TEST_PUBLISH_DELAY"

func chunkDelay(log *slog.Logger) time.Duration {
	return testDelay(log, chunkDelayEnv, "big registrations pause after each chunk")
}

// testDelay is the duration the test hook env sets, said at warn.
func testDelay(log *slog.Logger, env, what string) time.Duration {
	v := os.Getenv(env)
	if v == "" {
		return 0
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		log.Warn("ignoring a test hook that is not a duration", "hook", env, "value", v)
		return 0
	}
	log.Warn("test hook: "+what, "hook", env, "delay", d)
	return d
}

func pauseAfterTeardown(sigs <-chan os.Signal, freed buffer.Freed, log *slog.Logger) {
	if os.Getenv(pauseEnv) != "1" {
		return
	}
	log.Info("paused after teardown; send SIGINT or SIGTERM to go on", append([]any{"hook", pauseEnv}, freedAttrs(freed)...)...)
	<-sigs
}
