package mount

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"mrfs/internal/bytesize"
	"mrfs/internal/config"
	"mrfs/internal/sysmem"
	"mrfs/store"
)

// openStore resolves the pinning budget (buffers.max_pinned, a size or a
// share of the memory the daemon may use) and makes the backing store: a
// private tmpfs of that size, or memfds where the daemon may not make
// one (no CAP_SYS_ADMIN: the degraded mode), which the log says.
func openStore(cfg config.Buffers, inh *inherited, log *slog.Logger) (store.Store, uint64, error) {
	mem, err := sysmem.Read()
	if err != nil {
		return nil, 0, fmt.Errorf("read the memory the daemon may use: %w", err)
	}
	budget := cfg.MaxPinned.Resolve(mem.Limit(), uint64(os.Getpagesize()))
	if cfg.MaxPinned.Percent != 0 && budget == 0 {
		return nil, 0, fmt.Errorf("buffers.max_pinned %s of %s is less than a page", cfg.MaxPinned, bytesize.Format(mem.Limit()))
	}
	of := "buffers.max_pinned"
	if cfg.MaxPinned.Percent != 0 {
		of = fmt.Sprintf("%s of %s", cfg.MaxPinned, bytesize.Format(mem.Limit()))
		if mem.Cgroup != "" {
			of += " (the memory cgroup's limit)"
		}
	}
	topt := store.TmpfsOptions{Size: budget, Files: uint64(cfg.MaxBuffers), Huge: cfg.HugePages}
	if inh != nil && inh.crashed {
		// What the dead daemon made and had not named, or removed and
		// not freed: no one will.
		keep := map[uint64]bool{}
		for _, n := range inh.state.Tree.Nodes {
			if n.File != nil {
				keep[n.File.File] = true
			}
		}
		n, bytes, err := store.Sweep(inh.store, func(id uint64) bool { return keep[id] })
		if err != nil {
			return nil, 0, fmt.Errorf("backing store: %w", err)
		}
		if n > 0 {
			log.Info("backing store: removed the files of the daemon that died that no name holds", "files", n, "bytes", bytes)
		}
	}
	if inh != nil {
		s, err := store.AdoptTmpfs(inh.store, topt)
		if err != nil {
			return nil, 0, fmt.Errorf("backing store: %w", err)
		}
		log.Info("backing store: the private tmpfs of the program before", "max_pinned", sizeOrNone(budget), "from", of)
		return s, budget, nil
	}
	s, err := store.NewTmpfs(topt)
	switch {
	case err == nil:
		log.Info("backing store: a private tmpfs", "max_pinned", sizeOrNone(budget), "from", of, "huge_pages", cfg.HugePages)
	case errors.Is(err, store.ErrNoTmpfs):
		log.Warn("backing store: memfds, since the daemon cannot make a private tmpfs (it needs CAP_SYS_ADMIN); the budget is enforced only on what the daemon sees, and huge_pages does not apply",
			"max_pinned", sizeOrNone(budget), "err", err)
		s = store.NewMemfd()
	default:
		return nil, 0, fmt.Errorf("backing store: %w", err)
	}
	return s, budget, nil
}

func sizeOrNone(n uint64) string {
	if n == 0 {
		return "none"
	}
	return bytesize.Format(n)
}
