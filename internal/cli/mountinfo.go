package cli

import (
	"bufio"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// mrfsFSType is how an mrfs mount appears in /proc/self/mountinfo.
const mrfsFSType = "fuse.mrfs"

// mountAt returns the filesystem type and device ("0:39") of the topmost
// mount at dir; "" when dir is not a mount point. It reads mountinfo
// rather than stat-ing dir, which fails with ENOTCONN once the daemon is
// gone.
func mountAt(dir string) (fstype, dev string, err error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", "", err
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent major:minor root MOUNTPOINT options ... - FSTYPE source ...
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 || unescapeMountinfo(fields[4]) != abs {
			continue
		}
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) {
				fstype, dev = fields[i+1], fields[2] // later lines are mounted on top
				break
			}
		}
	}
	if err := sc.Err(); err != nil {
		return "", "", fmt.Errorf("read mountinfo: %w", err)
	}
	return fstype, dev, nil
}

// unescapeMountinfo undoes the kernel's octal escapes (\040 for a space).
func unescapeMountinfo(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// deadWait bounds how long clearDeadMount waits for a mount to answer.
const deadWait = 2 * time.Second

// clearDeadMount detaches the mrfs mount a daemon that died left at dir
// (every access to it fails with ENOTCONN), so that a new one mounts
// there: what a unit started again after its daemon's crash, or a user,
// finds. Any other mount at dir is left, and mounting over it fails as it
// would; so does one whose connection lives with nobody serving it.
func clearDeadMount(dir string, log *slog.Logger) error {
	if fstype, _, err := mountAt(dir); err != nil || fstype != mrfsFSType {
		return err
	}
	answer := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		answer <- unix.Statfs(dir, &st)
	}()
	select {
	case err := <-answer:
		if !errors.Is(err, unix.ENOTCONN) {
			return nil // a live mount: mounting over it says so
		}
	case <-time.After(deadWait):
		return fmt.Errorf("mount at %s: an mrfs mount is there and does not answer (its connection is held with nobody serving it)", dir)
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("mount at %s: clear the mount of a daemon that died: %w", dir, err)
	}
	log.Warn("cleared the mount a daemon that died left here", "mountpoint", dir)
	return nil
}
