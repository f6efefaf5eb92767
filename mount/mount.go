// Package mount is the life of one mrfs mount, as one readable sequence
// (Run): the verbs backend and its device, the backing store, metrics,
// remote access, the buffer manager, the tree, the FUSE server,
// publication; then readiness, the wait for a stop, and the teardown in
// DESIGN.md's order. internal/cli parses the command line and the
// configuration, and runs the service around it (logging, readiness
// pipes, systemd).
package mount

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/fs"
	"mrfs/internal/config"
	"mrfs/internal/gcpace"
	"mrfs/publish"
	"mrfs/source"
	"mrfs/store"
	"mrfs/tree"
	"mrfs/verbs"
)

// Options are one mount's.
type Options struct {
	Config config.Config // validated
	Dir    string        // the mount point, absolute
	FsName string        // the source mount(8) shows ("" for mrfs)
	Log    *slog.Logger
	// Signals are the stop signals, subscribed to before Run so that one
	// that comes while mounting tears down what was made.
	Signals chan os.Signal
	// Ready is called once the mount is up (it checks that the mount
	// answers, and tells whoever waits); Stopping when the teardown
	// starts. Either may be nil.
	Ready    func(dir string, sigs chan os.Signal) error
	Stopping func()
}

// parts are what a mount is made of, in the order they are made; the
// teardown closes them in the order DESIGN.md gives.
type parts struct {
	prov   verbs.Provider
	dev    verbs.Device
	store  store.Store
	mx     *mountMetrics
	remote *remoteAccess
	pub    *publishing
	mgr    *buffer.Manager
	tree   *tree.Tree
	watch  *deviceWatch
	srv    *fs.Server
	life   life
	// adopted: the store was handed over by an upgrade.
	adopted bool
	// journal: the namespace's changes, for a keeper (nil: none).
	journal *journaling
}

// Run mounts, serves until a stop signal or an unmount from outside, and
// tears down.
func Run(opt Options) error {
	cfg, log := opt.Config, opt.Log
	p, err := start(opt)
	if err != nil {
		return err
	}
	defer gcpace.Start(gcHeadroom(log), log)()
	unmounted := make(chan struct{})
	go func() {
		p.srv.Wait()
		close(unmounted)
	}()
	primary := p.dev.Name()
	where := func() publish.Where { return p.remote.Published(primary) }
	if err := p.pub.start(cfg.Publish, p.tree, opt.Dir, where, log); err != nil {
		log.Error("publish: cannot start; buffers are not published", "err", err)
	}
	if !cfg.Mount.ZeroCopy {
		log.Warn("zero copy is off (mount.zero_copy = false): reads and writes go through the daemon and mmap fails with ENODEV")
	}
	log.Info("mounted", "mountpoint", opt.Dir, "backend", p.prov.Name(), "device", p.dev.Name(),
		"zero_copy", cfg.Mount.ZeroCopy, "pid", os.Getpid())

	var errs []error
	ready := func(string, chan os.Signal) error { return nil }
	if opt.Ready != nil {
		ready = opt.Ready
	}
	if err := ready(opt.Dir, opt.Signals); err != nil {
		errs = append(errs, err)
	} else {
		select {
		case sig := <-opt.Signals:
			log.Info("shutting down", "signal", sig.String())
		case <-unmounted:
			log.Info("unmounted from outside; shutting down")
		}
	}
	if opt.Stopping != nil {
		opt.Stopping()
	}
	return p.teardown(opt, unmounted, errs)
}

// start makes the mount's parts; on a failure it closes what it made.
func start(opt Options) (_ *parts, err error) {
	cfg, log := opt.Config, opt.Log
	p := &parts{life: life{started: time.Now()}}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	if p.life.exe, err = os.Executable(); err != nil {
		return nil, fmt.Errorf("the daemon's own program: %w", err)
	}
	// An upgrade in place executed this program: the mount, its store and
	// its namespace are taken over, not made.
	if err := takeFdStore(); err != nil {
		log.Warn("systemd's file descriptor store", "err", err)
	}
	inh, err := takeInherited()
	if err != nil {
		return nil, err
	}
	p.adopted = inh != nil
	keeper := keeperFd()
	if keeper >= 0 || fdStore() {
		if p.journal, err = newJournaling(); err != nil {
			return nil, err
		}
		p.journal.dieAt = testDieAtDone(log)
	}
	if p.prov, err = ChooseProvider(cfg.Verbs, log); err != nil {
		return nil, err
	}
	if p.dev, err = openDevices(p.prov, cfg.Verbs, log); err != nil {
		return nil, err
	}
	mapReserve := testMapReserve(log)
	defaultMaxBuffers(&cfg.Buffers, mapReserve, log)
	st, budget, err := openStore(cfg.Buffers, inh, log)
	if err != nil {
		return nil, err
	}
	p.store = st
	if p.mx, err = startMetrics(cfg.Metrics, log); err != nil {
		return nil, err
	}
	if p.remote, err = bindRemote(cfg.Remote, p.prov.Name(), p.mx.remoteEvents(), log); err != nil {
		return nil, err
	}
	p.pub = &publishing{next: p.mx.bufferEvents()}
	mopt := managerOptions(cfg, budget, st, p.pub, mapReserve, log)
	if p.journal != nil {
		mopt.OnKept = p.journal.j.Kept
	}
	mopt.Reopen = func(k buffer.KeptSource) (buffer.Source, error) {
		return source.Reopen(k.Path, k.Dev, k.Ino, k.Writable)
	}
	p.mgr = buffer.NewManager(p.dev, mopt, log)
	p.mx.watch(p.mgr)
	topt := tree.Options{
		DefaultSize:   uint64(cfg.Buffers.DefaultSize),
		DefaultAccess: cfg.Buffers.DefaultAccess,
		Umask:         cfg.Mount.Umask,
		Log:           log,
		Changed:       p.pub.changed,
	}
	if p.journal != nil {
		topt.Journal = p.journal.j
	}
	if inh != nil {
		p.life.restarts = inh.state.Restarts
		if inh.failed != "" {
			p.life.lastErr = "the upgraded program failed, this one took the mount back: " + inh.failed
		}
		p.tree, err = tree.Restore(p.mgr, topt, inh.state.Tree)
	} else {
		// The root belongs to whoever mounts (a non-root user's own mount).
		p.tree, err = tree.New(p.mgr, topt, cfg.Buffers.DefaultAccess, tree.Owner{UID: uint32(os.Getuid()), GID: uint32(os.Getgid())}, 0o755)
	}
	if err != nil {
		return nil, err
	}
	if p.journal != nil {
		if err := p.journal.start(p.tree, log); err != nil {
			return nil, err
		}
	}
	root := p.tree.Root()
	p.watch = watchDevices(p.prov, p.dev, cfg.Verbs, p.remote, func() { p.pub.changed(root) }, log)
	// Peers may name the tree's directories from now on: by the time the
	// mount is visible, a peer never finds mrfs still mounting.
	p.remote.Serve(p.tree.Domain)
	fopt := fs.Options{
		Tree:     p.tree,
		Backend:  p.prov.Name(),
		ZeroCopy: cfg.Mount.ZeroCopy,
		Log:      log,
		Remote:   p.remote.Where,
		Gone:     p.watch.Gone,
		Upgrade:  func(binary string) error { return p.startUpgrade(binary, log) },
		Life:     p.life.get,
		OnLookup: testLookupHold(log),
		OnDone:   testHoldReply(log),
	}
	if p.journal != nil {
		fopt.OnBacking = p.journal.j.Backing
		if p.journal.dieAt != "" {
			fopt.OnDone = p.journal.dieAfter
		}
		fopt.OnServe = func(conn int, init []byte) { p.handOver(keeper, conn, init, log) }
	}
	mo := fs.MountOptions{AllowOther: cfg.Mount.AllowOther, FsName: opt.FsName, RequestLog: requestLog(cfg.Log, log)}
	if inh != nil {
		if err := testAdoptFail(log); err != nil {
			return nil, err
		}
		p.srv, err = fs.Adopt(opt.Dir, fopt, mo, fs.Handover{Conn: inh.conn, Init: inh.init, Kernel: inh.state.Kernel,
			Restarts: p.life.restarts, Crashed: inh.crashed, Backing: inh.backing, Done: inh.done})
		switch {
		case err == nil && inh.crashed:
			log.Warn("took over the mount of a daemon that died: its buffers and names are kept; keys are new", "restarts", p.life.restarts)
			for _, l := range inh.lost {
				log.Warn("left out of the mount taken over (the daemon that died could not keep it): its names go", "node", l)
			}
		case err == nil:
			served()
			log.Info("upgraded in place: the mount, its buffers and its names are kept; keys are new", "restarts", p.life.restarts)
		}
	} else {
		p.srv, err = fs.Mount(opt.Dir, fopt, mo)
	}

	if err == nil && p.journal != nil {
		if _, _, ok := p.srv.Connection(); !ok {
			log.Warn("the connection was made by fusermount and dies with this daemon: a crash ends the mount")
		}
	}
	if errors.Is(err, fs.ErrNoPassthrough) {
		return nil, fmt.Errorf("%w; mrfs needs it for zero-copy mmap: run as root on Linux >= 6.9, or set mount.zero_copy = false for the degraded mode (no mmap)", err)
	}
	return p, err
}

// managerOptions are the buffer manager's for [buffers].
func managerOptions(c config.Config, budget uint64, st store.Store, ev buffer.Events, mapReserve int, log *slog.Logger) buffer.Options {
	cfg := c.Buffers
	return buffer.Options{
		Store:            st,
		MaxBuffers:       cfg.MaxBuffers,
		MaxPinned:        budget,
		MaxPinnedPerUser: uint64(cfg.MaxPinnedPerUser),
		Allowed:          cfg.AllowedAccess,
		// The daemon's own descriptors beyond clients' opens: the store's
		// transient opens, the FUSE device, remote peers' sockets.
		FdReserve:         128 + remoteSockets(c.Remote),
		Events:            ev,
		PopulateThreshold: uint64(cfg.PopulateThreshold),
		PopulateWorkers:   cfg.PopulateWorkers,
		MaxRegionSize:     uint64(cfg.MaxRegionSize),
		ChunkDelay:        chunkDelay(log),
		MapReserve:        mapReserve,
	}
}

// handOver hands the keeper (keeper >= 0) or systemd's store what a
// daemon started after this one dies takes the mount over with; a mount
// it cannot take over dies with this daemon, as the log says.
func (p *parts) handOver(keeper, conn int, init []byte, log *slog.Logger) {
	ls, lasting := p.store.(store.Lasting)
	if !lasting {
		log.Warn("this mount cannot outlive its daemon (the memfd store): a crash ends it")
		return
	}
	sfd, err := ls.Handover()
	if err == nil {
		jfd := int(p.journal.f.Fd())
		if keeper >= 0 {
			err = handToKeeper(keeper, conn, init, sfd, jfd, p.life.restarts)
		} else {
			err = handToFdStore(conn, init, !p.adopted, sfd, jfd, p.life.restarts)
		}
		unix.Close(sfd)
	}
	if err != nil {
		log.Error("a crash would end this mount", "err", err)
	}
}

// close closes what start made, when it failed.
func (p *parts) close() {
	p.journal.close()
	p.watch.Close()
	if p.remote != nil {
		p.remote.Close()
	}
	if p.mgr != nil && p.adopted {
		// The store's files are the mount's, which the program before
		// takes back (FallBack).
		p.mgr.Leave()
	} else if p.mgr != nil {
		p.mgr.Close()
	}
	if p.dev != nil {
		p.dev.Close()
	}
	if p.store != nil {
		p.store.Close()
	}
	p.mx.Close()
}

// teardown follows DESIGN.md's order: published keys first (peers must
// not find what is going), then peers (their queue pairs live in the
// PDs, and no operation may reach a region while it is deregistered),
// every region deregistered and every PD deallocated, the device
// closed, then the unmount.
func (p *parts) teardown(opt Options, unmounted <-chan struct{}, errs []error) error {
	if p.journal != nil && fdStore() {
		// A mount torn down is not to be taken over: systemd keeps
		// nothing of it (with FileDescriptorStorePreserve= it would
		// pass it to the next start).
		if err := dropFdStore(p.life.restarts); err != nil {
			errs = append(errs, err)
		}
	}
	p.watch.Close() // no device leaves or joins from here on
	if err := p.pub.close(); err != nil {
		errs = append(errs, fmt.Errorf("publish: %w", err))
	}
	if err := p.remote.Close(); err != nil {
		errs = append(errs, err)
	}
	freed, err := p.mgr.Close()
	if err != nil {
		errs = append(errs, fmt.Errorf("deregister: %w", err))
	}
	pauseAfterTeardown(opt.Signals, freed, opt.Log)
	if err := p.dev.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close device %s: %w", p.dev.Name(), err))
	}
	if err := p.store.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close the backing store: %w", err))
	}
	p.mx.Close()
	p.journal.close()
	select {
	case <-unmounted:
	default:
		if err := p.srv.Unmount(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("teardown: %w", err)
	}
	opt.Log.Info("teardown complete", freedAttrs(freed)...)
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
