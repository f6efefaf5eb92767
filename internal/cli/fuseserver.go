package cli

import (
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// fuseServers finds the processes serving the FUSE connection of the
// mount whose device is dev ("0:39" in mountinfo): those holding a
// /dev/fuse descriptor whose fdinfo says "fuse_connection: N" for that
// device. Recent kernels show it (6.18 does); on others nothing is found
// and nobody is waited for. It returns a pidfd for each, which keeps naming that
// process after it exits, when its pid may be reused.
func fuseServers(dev string) []int {
	major, minor, ok := strings.Cut(dev, ":")
	maj, err1 := strconv.ParseUint(major, 10, 32)
	mnr, err2 := strconv.ParseUint(minor, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return nil
	}
	conn := strconv.FormatUint(maj<<20|mnr, 10) // the kernel's dev_t
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pidfds []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		fds, err := os.ReadDir("/proc/" + p.Name() + "/fd")
		if err != nil {
			continue // gone, or not ours to see
		}
		for _, fd := range fds {
			if link, _ := os.Readlink("/proc/" + p.Name() + "/fd/" + fd.Name()); link != "/dev/fuse" ||
				!servesConn(p.Name(), fd.Name(), conn) {
				continue
			}
			pidfd, err := unix.PidfdOpen(pid, 0)
			if err != nil {
				break
			}
			if !servesConn(p.Name(), fd.Name(), conn) { // the pid was reused meanwhile
				unix.Close(pidfd)
				break
			}
			pidfds = append(pidfds, pidfd)
			break
		}
	}
	return pidfds
}

func servesConn(pid, fd, conn string) bool {
	b, err := os.ReadFile("/proc/" + pid + "/fdinfo/" + fd)
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && k == "fuse_connection" && strings.TrimSpace(v) == conn {
			return true
		}
	}
	return false
}

// waitExited waits until each process of pidfds has exited, and closes
// the pidfds.
func waitExited(pidfds []int) {
	for _, fd := range pidfds {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(pfd, -1); err != unix.EINTR {
				break
			}
		}
		unix.Close(fd)
	}
}
