package mount

import (
	"errors"
	"log/slog"
	"slices"
	"sync"
	"syscall"
	"time"

	"mrfs/internal/config"
	"mrfs/verbs"
	"mrfs/verbs/multi"
)

// deviceWatch follows a mount's devices as they come and go (verbs/multi
// joins them): once a second it lists the backend's devices. One of the
// mount's that is no longer listed leaves: the connections that came
// through it close, every region and PD loses its part there, and its
// keys leave desc and etcd; the others are untouched. One that is listed
// again, or any new one with verbs.devices = "all", joins: every region
// is registered on it and its keys published.
type deviceWatch struct {
	prov   verbs.Provider
	dev    *multi.Device          // nil: one device, only listed
	want   func(name string) bool // a device the configuration takes
	remote *remoteAccess
	// changed republishes every buffer (their keys changed).
	changed func()
	log     *slog.Logger

	stop, done chan struct{}

	// guards: gone, refused.
	mu      sync.Mutex
	gone    map[string]bool // the mount's devices that left
	refused map[string]bool // devices present that failed to join (said once)
}

// watchInterval is how often devices are listed.
const watchInterval = time.Second

// watchDevices starts watching dev's devices. With one device (not
// joined) it only lists them, which lets the rdma backend's librdmacm
// close what it holds of devices that went away (verbs/ibv Names); nil
// when the backend cannot list them cheaply.
func watchDevices(prov verbs.Provider, dev verbs.Device, cfg config.Verbs, remote *remoteAccess, changed func(), log *slog.Logger) *deviceWatch {
	md, _ := dev.(*multi.Device)
	if _, ok := prov.(verbs.Lister); !ok && md == nil {
		return nil
	}
	var configured []string
	if md != nil {
		configured = md.Names()
	}
	w := &deviceWatch{
		prov: prov, dev: md, remote: remote, changed: changed, log: log,
		want: func(name string) bool { return cfg.AllDevices || slices.Contains(configured, name) },
		stop: make(chan struct{}), done: make(chan struct{}),
		gone: map[string]bool{}, refused: map[string]bool{},
	}
	go w.run()
	return w
}

func (w *deviceWatch) run() {
	defer close(w.done)
	t := time.NewTicker(watchInterval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
			w.check()
		}
	}
}

// Close stops watching (before the teardown closes the device).
func (w *deviceWatch) Close() {
	if w == nil {
		return
	}
	close(w.stop)
	<-w.done
}

// Gone is the mount's devices that left and have not come back, sorted.
func (w *deviceWatch) Gone() []string {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]string, 0, len(w.gone))
	for n := range w.gone {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// check compares the devices listed with the mount's.
func (w *deviceWatch) check() {
	var names []string
	var err error
	if l, ok := w.prov.(verbs.Lister); ok {
		names, err = l.Names()
	} else {
		var infos []verbs.DeviceInfo
		infos, err = w.prov.Devices()
		for _, in := range infos {
			names = append(names, in.Name)
		}
	}
	if err != nil {
		// No answer is no news: a device is gone when it is not listed.
		w.log.Debug("list devices", "err", err)
		return
	}
	if w.dev == nil {
		return
	}
	joined := w.dev.Names()
	for _, n := range joined {
		if !slices.Contains(names, n) {
			w.leave(n)
		}
	}
	for _, n := range names {
		if w.want(n) && !slices.Contains(joined, n) {
			w.join(n)
		}
	}
	w.mu.Lock()
	for n := range w.refused {
		if !slices.Contains(names, n) {
			delete(w.refused, n) // when it is back, it is tried anew
		}
	}
	w.mu.Unlock()
}

func (w *deviceWatch) leave(name string) {
	closed := w.remote.CloseDevice(name)
	err := w.dev.Detach(name)
	w.mu.Lock()
	known := w.gone[name]
	w.gone[name] = true
	w.mu.Unlock()
	if errors.Is(err, syscall.EBUSY) {
		if !known {
			w.log.Error("device is gone and it is the mount's last: every buffer keeps its dead keys until it comes back or the mount is remounted",
				"device", name)
		}
		return
	}
	if err != nil {
		w.log.Warn("device is gone; closing it failed", "device", name, "err", err)
	}
	w.log.Warn("device is gone: its keys are withdrawn, every buffer stays registered on the others",
		"device", name, "closed_connections", closed, "devices", w.dev.Names())
	w.changed()
}

func (w *deviceWatch) join(name string) {
	w.mu.Lock()
	refused := w.refused[name]
	w.mu.Unlock()
	if refused {
		return
	}
	start := time.Now()
	dev, err := w.prov.Open(name)
	if err == nil {
		err = w.dev.Attach(dev)
	}
	w.mu.Lock()
	if err != nil {
		w.refused[name] = true
	} else {
		delete(w.gone, name)
	}
	w.mu.Unlock()
	if err != nil {
		w.log.Error("device is here but cannot join: buffers are not registered on it (it is tried again when it comes back)",
			"device", name, "err", err)
		return
	}
	w.log.Info("device joined: every buffer is registered on it", "device", name,
		"took", time.Since(start).Round(time.Millisecond), "devices", w.dev.Names())
	w.changed()
}
