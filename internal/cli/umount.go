package cli

import (
	"errors"
	"flag"
	"fmt"
	"os/exec"
	"time"

	"golang.org/x/sys/unix"
)

// cmdUmount unmounts and waits until the daemon has torn down and exited
// (not with --lazy, where it serves until the last open file is closed);
// it also clears the mount of a daemon that was killed (the kernel then
// answers ENOTCONN for every access).
func cmdUmount(args []string) error {
	f := flag.NewFlagSet("umount", flag.ContinueOnError)
	lazy := f.Bool("lazy", false, "detach now even if files are open or mapped; they keep working until closed")
	pos, err := parse(f, args, 1)
	if err != nil {
		return err
	}
	dir := pos[0]
	// Only mrfs mounts: a typo must not unmount something else.
	fstype, dev, err := mountAt(dir)
	switch {
	case err != nil:
		return fmt.Errorf("unmount %s: %w", dir, err)
	case fstype == "":
		return fmt.Errorf("unmount %s: not a mount point", dir)
	case fstype != mrfsFSType:
		return fmt.Errorf("unmount %s: a %s mount, not mrfs; use umount(8)", dir, fstype)
	}
	var servers []int // the daemon, found before its device number can be reused
	if !*lazy {
		servers = fuseServers(dir, dev)
	}
	if err := unmount(dir, *lazy); err != nil {
		for _, fd := range servers {
			unix.Close(fd)
		}
		return err
	}
	waitExited(servers)
	return nil
}

// busyWait is how long a busy mount is retried before the unmount fails.
const busyWait = time.Second

func unmount(dir string, lazy bool) error {
	flags := 0
	if lazy {
		flags = unix.MNT_DETACH
	}
	err := unix.Unmount(dir, flags)
	// A file closed a moment ago may still hold the mount: a child of a
	// process that had it open, between its fork and its exec; the last
	// command of a script. Such holders go within milliseconds.
	for deadline := time.Now().Add(busyWait); errors.Is(err, unix.EBUSY) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		err = unix.Unmount(dir, flags)
	}
	if errors.Is(err, unix.EPERM) {
		// Not root: a user mount is unmounted by the setuid helper.
		for _, helper := range []string{"fusermount3", "fusermount"} {
			if path, lerr := exec.LookPath(helper); lerr == nil {
				args := []string{"-u"}
				if lazy {
					args = append(args, "-z")
				}
				if out, herr := exec.Command(path, append(args, dir)...).CombinedOutput(); herr != nil {
					return fmt.Errorf("unmount %s: %s: %s", dir, helper, out)
				}
				return nil
			}
		}
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("unmount %s: a process still has a file open or mapped (still after %v); close it, or use --lazy", dir, busyWait)
	case errors.Is(err, unix.EINVAL):
		return fmt.Errorf("unmount %s: not a mount point", dir)
	}
	return fmt.Errorf("unmount %s: %w", dir, err)
}
