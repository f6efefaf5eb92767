package cli

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// lifeStats is the part of user.mrfs.stats an upgrade watches.
type lifeStats struct {
	PID          int    `json:"pid"`
	Started      string `json:"started"`
	Restarts     int    `json:"restarts"`
	UpgradeError string `json:"upgrade_error"`
}

func readLife(dir string) (lifeStats, error) {
	var l lifeStats
	raw, err := getxattr(dir, "user.mrfs.stats")
	if err != nil {
		return l, fmt.Errorf("%s is not the root of a running mrfs mount (no user.mrfs.stats): %w", dir, err)
	}
	if err := json.Unmarshal(raw, &l); err != nil {
		return l, fmt.Errorf("%s: bad user.mrfs.stats: %w", dir, err)
	}
	return l, nil
}

// cmdUpgrade asks the daemon of a mount to execute a new program in its
// place (user.mrfs.upgrade) and waits until that program serves the
// mount, or the daemon says why it did not.
func cmdUpgrade(args []string, stdout io.Writer) error {
	f := flag.NewFlagSet("upgrade", flag.ContinueOnError)
	binary := f.String("binary", "", "the program to run (`PATH`; default: the daemon's own path, as it is on disk now)")
	timeout := f.Duration("timeout", time.Minute, "how long to wait for the new program to serve")
	pos, err := parse(f, args, 1)
	if err != nil {
		return err
	}
	dir := pos[0]
	before, err := readLife(dir)
	if err != nil {
		return err
	}
	path := *binary
	if path != "" {
		if path, err = filepath.Abs(path); err != nil {
			return err
		}
	}
	if err := unix.Setxattr(dir, "user.mrfs.upgrade", []byte(path), 0); err != nil {
		if errors.Is(err, unix.EPERM) {
			return fmt.Errorf("upgrade %s: only root or the mount's owner may: %w", dir, err)
		}
		return fmt.Errorf("upgrade %s: %w", dir, err)
	}
	deadline := time.Now().Add(*timeout)
	for {
		time.Sleep(50 * time.Millisecond)
		now, err := readLife(dir)
		switch {
		case err != nil:
			return fmt.Errorf("upgrade %s: %w", dir, err)
		case now.Restarts > before.Restarts && now.UpgradeError != "" && now.UpgradeError != before.UpgradeError:
			return fmt.Errorf("upgrade %s: %s (pid %d serves on, as before the upgrade; keys are new)", dir, now.UpgradeError, now.PID)
		case now.Restarts > before.Restarts:
			fmt.Fprintf(stdout, "%s: upgraded in place: pid %d, started %s, %d restarts; names, buffers and open files are kept, keys are new\n",
				dir, now.PID, now.Started, now.Restarts)
			return nil
		case now.UpgradeError != "" && now.UpgradeError != before.UpgradeError:
			return fmt.Errorf("upgrade %s: the daemon did not upgrade, and serves on: %s", dir, now.UpgradeError)
		case time.Now().After(deadline):
			return fmt.Errorf("upgrade %s: no new program serves after %s", dir, *timeout)
		}
	}
}
