package mount

import (
	"fmt"
	"log/slog"

	"mrfs/internal/config"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// ChooseProvider applies verbs.backend: auto takes rdma when it is built
// in and sees a device, else soft; the log says which and why.
func ChooseProvider(cfg config.Verbs, log *slog.Logger) (verbs.Provider, error) {
	softProvider := func() verbs.Provider {
		return soft.New(soft.Options{MaxMR: cfg.SoftMaxMR, MaxMRSize: uint64(cfg.SoftMaxMRSize), MaxPD: cfg.SoftMaxPD})
	}
	switch cfg.Backend {
	case config.BackendSoft:
		log.Info("verbs backend: soft (configured)")
		return softProvider(), nil
	case config.BackendRDMA:
		p, err := rdmaProvider()
		if err == nil {
			log.Info("verbs backend: rdma (configured)")
		}
		return p, err
	}
	if !rdmaBuilt {
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
