package cli

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// fuseServers finds the processes serving the FUSE connection of the
// mount whose device is dev ("0:39" in mountinfo): those holding a
// /dev/fuse descriptor whose fdinfo says "fuse_connection: N" for that
// device. Recent kernels show it (6.18 does, 6.12 does not); where none
// does, the mount's own daemon is found by the pid its user.mrfs.stats
// names (statsServer). It returns a pidfd for each, which keeps naming
// that process after it exits, when its pid may be reused.
func fuseServers(dir, dev string) []int {
	if pidfds := connServers(dev); len(pidfds) > 0 {
		return pidfds
	}
	// A daemon that hangs would hang the xattr read too: then unmount
	// without waiting for it, as on a kernel that names no server.
	found := make(chan []int, 1)
	go func() { found <- statsServer(dir) }()
	select {
	case pidfds := <-found:
		return pidfds
	case <-time.After(statsWait):
		return nil
	}
}

// statsWait bounds how long umount asks a daemon for its pid.
const statsWait = 5 * time.Second

// connServers finds the servers of dev through fdinfo's fuse_connection.
func connServers(dev string) []int {
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
		serves := func(fd string) bool { return servesConn(p.Name(), fd, conn) }
		if fd, ok := fuseFd(p.Name(), serves); ok {
			if pidfd, ok := openChecked(pid, func() bool { return serves(fd) }); ok {
				pidfds = append(pidfds, pidfd)
			}
		}
	}
	return pidfds
}

// statsServer finds the daemon of the mrfs mount at dir by the pid in its
// user.mrfs.stats, if that process holds a /dev/fuse descriptor. A
// daemon that no longer answers gives none: nobody is waited for. (A
// daemon in another pid namespace names a pid of its own; the process
// of that number here is waited for only if it, too, serves FUSE.)
func statsServer(dir string) []int {
	raw, err := getxattr(dir, "user.mrfs.stats")
	if err != nil {
		return nil
	}
	var st struct {
		PID int `json:"pid"`
	}
	if json.Unmarshal(raw, &st) != nil || st.PID <= 0 {
		return nil
	}
	pid := strconv.Itoa(st.PID)
	holdsFuse := func() bool {
		_, ok := fuseFd(pid, func(string) bool { return true })
		return ok
	}
	if !holdsFuse() {
		return nil
	}
	if pidfd, ok := openChecked(st.PID, holdsFuse); ok {
		return []int{pidfd}
	}
	return nil
}

// fuseFd returns the first /dev/fuse descriptor of pid that ok accepts.
func fuseFd(pid string, ok func(fd string) bool) (string, bool) {
	fds, err := os.ReadDir("/proc/" + pid + "/fd")
	if err != nil {
		return "", false // gone, or not ours to see
	}
	for _, fd := range fds {
		if link, _ := os.Readlink("/proc/" + pid + "/fd/" + fd.Name()); link == "/dev/fuse" && ok(fd.Name()) {
			return fd.Name(), true
		}
	}
	return "", false
}

// openChecked opens a pidfd of pid and checks again that it is still the
// process it was (still does what still says): the pid may have been
// reused before the pidfd named it.
func openChecked(pid int, still func() bool) (int, bool) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, false
	}
	if !still() {
		unix.Close(pidfd)
		return -1, false
	}
	return pidfd, true
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
