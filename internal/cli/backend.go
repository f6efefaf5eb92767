package cli

import (
	"errors"
	"fmt"
	"log/slog"

	"mrfs/internal/config"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// rdmaProvider opens the libibverbs backend; nil when the binary was
// built without it (the build tag rdma sets it).
var rdmaProvider func() (verbs.Provider, error)

var errNoRDMABuild = errors.New("the rdma backend is not built in: rebuild with `go build -tags rdma ./cmd/mrfs` (needs the libibverbs-dev package)")

// chooseProvider applies verbs.backend: auto takes rdma when it is built
// in and sees a device, else soft; the log says which and why.
func chooseProvider(cfg config.Verbs, log *slog.Logger) (verbs.Provider, error) {
	softProvider := func() verbs.Provider {
		return soft.New(soft.Options{MaxMR: cfg.SoftMaxMR})
	}
	switch cfg.Backend {
	case config.BackendSoft:
		log.Info("verbs backend: soft (configured)")
		return softProvider(), nil
	case config.BackendRDMA:
		if rdmaProvider == nil {
			return nil, errNoRDMABuild
		}
		return rdmaProvider()
	}
	if rdmaProvider == nil {
		log.Info("verbs backend: soft (auto: this binary has no rdma backend; build with -tags rdma)")
		return softProvider(), nil
	}
	p, err := rdmaProvider()
	if err != nil {
		log.Info("verbs backend: soft (auto: rdma unavailable)", "reason", err)
		return softProvider(), nil
	}
	devs, err := p.Devices()
	if err != nil || len(devs) == 0 {
		log.Info("verbs backend: soft (auto: no RDMA device found)", "err", err)
		return softProvider(), nil
	}
	log.Info("verbs backend: rdma (auto: found a device)", "device", devs[0].Name)
	return p, nil
}

func openDevice(p verbs.Provider, name string) (verbs.Device, error) {
	dev, err := p.Open(name)
	if err != nil {
		if name == "" {
			name = "the first device"
		}
		return nil, fmt.Errorf("open %s of backend %s: %w", name, p.Name(), err)
	}
	return dev, nil
}
