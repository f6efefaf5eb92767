package mount

import (
	"fmt"
	"log/slog"
	"syscall"

	"mrfs/internal/config"
	"mrfs/verbs"
	"mrfs/verbs/multi"
	"mrfs/verbs/soft"
)

// ChooseProvider applies verbs.backend: auto takes rdma when it is built
// in and sees a device, else soft; the log says which and why.
func ChooseProvider(cfg config.Verbs, log *slog.Logger) (verbs.Provider, error) {
	softProvider := func() verbs.Provider {
		return soft.New(soft.Options{Devices: cfg.SoftDevices, MaxMR: cfg.SoftMaxMR, MaxMRSize: uint64(cfg.SoftMaxMRSize), MaxPD: cfg.SoftMaxPD,
			Present: softPresent(log)})
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

// openDevices opens what verbs.device or verbs.devices names: one
// device, or several joined (verbs/multi), the first one's keys being
// the files' lkey and rkey.
func openDevices(p verbs.Provider, cfg config.Verbs, log *slog.Logger) (verbs.Device, error) {
	names := cfg.Devices
	if cfg.AllDevices {
		devs, err := p.Devices()
		if err != nil {
			return nil, fmt.Errorf("list the devices of backend %s: %w", p.Name(), err)
		}
		if len(devs) == 0 {
			return nil, fmt.Errorf("backend %s has no device (verbs.devices = \"all\"): %w", p.Name(), syscall.ENODEV)
		}
		for _, d := range devs {
			names = append(names, d.Name)
		}
	}
	if names == nil {
		names = []string{cfg.Device}
	}
	var dev verbs.Device
	var err error
	if len(names) > 1 || cfg.AllDevices {
		// Joined even when "all" is one device, so that others may join.
		dev, err = multi.OpenJoined(p, names)
	} else {
		dev, err = multi.Open(p, names)
	}
	if err != nil {
		if len(names) == 1 && names[0] == "" {
			return nil, fmt.Errorf("open the first device of backend %s: %w", p.Name(), err)
		}
		return nil, fmt.Errorf("backend %s: %w", p.Name(), err)
	}
	if len(names) > 1 {
		log.Info("registering every buffer on each device; the first one's keys are the files' lkey and rkey", "devices", names)
	}
	return dev, nil
}
