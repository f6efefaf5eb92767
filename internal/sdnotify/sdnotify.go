// Package sdnotify speaks systemd's side of a service: notifications
// (sd_notify(3): READY=1, STOPPING=1, and descriptors for its file
// descriptor store) and the descriptors it passes a service at start
// (sd_listen_fds_with_names(3)).
//
// These few lines stand in for a library (coreos/go-systemd's daemon
// package would do): the protocol is small, stable and documented, and a
// dependency would bring more than the calls mrfs makes.
package sdnotify

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Notify sends state, newline-separated VAR=VALUE assignments
// ("READY=1"), in one datagram to the AF_UNIX socket named by
// $NOTIFY_SOCKET (a leading @ names an abstract socket), with fds attached (SCM_RIGHTS) if any. Without
// $NOTIFY_SOCKET there is no manager listening and nothing to do.
func Notify(state string, fds ...int) error {
	addr := os.Getenv("NOTIFY_SOCKET")
	if addr == "" {
		return nil
	}
	if !strings.HasPrefix(addr, "/") && !strings.HasPrefix(addr, "@") {
		return fmt.Errorf("notify the service manager: NOTIFY_SOCKET=%q is not an AF_UNIX socket; mrfs supports only those", addr)
	}
	sock, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("notify the service manager: %w", err)
	}
	defer unix.Close(sock)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	// x/sys/unix takes a leading @ for an abstract name, as systemd does.
	if err := unix.Sendmsg(sock, []byte(state), oob, &unix.SockaddrUnix{Name: addr}, 0); err != nil {
		return fmt.Errorf("notify the service manager of %q: %w", strings.ReplaceAll(state, "\n", " "), err)
	}
	return nil
}

// StoreMax is how many descriptors the service manager's store keeps for
// this service ($FDSTORE, set by systemd >= 254 from
// FileDescriptorStoreMax=), 0 without one or without $NOTIFY_SOCKET.
func StoreMax() int {
	if os.Getenv("NOTIFY_SOCKET") == "" {
		return 0
	}
	n, err := strconv.Atoi(os.Getenv("FDSTORE"))
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// Listened are the descriptors the service manager passed this process
// at its start, by name (a name may have several), close-on-exec. It
// clears $LISTEN_PID, $LISTEN_FDS and $LISTEN_FDNAMES, so that a program
// this one executes does not take them too: nil when they are not this
// process's.
func Listened() map[string][]int {
	pid, n, names := os.Getenv("LISTEN_PID"), os.Getenv("LISTEN_FDS"), os.Getenv("LISTEN_FDNAMES")
	for _, k := range []string{"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} {
		os.Unsetenv(k)
	}
	count, err := strconv.Atoi(n)
	if pid != strconv.Itoa(os.Getpid()) || err != nil || count <= 0 {
		return nil
	}
	named := strings.Split(names, ":")
	out := map[string][]int{}
	for i := range count {
		fd := 3 + i // SD_LISTEN_FDS_START
		unix.CloseOnExec(fd)
		name := "unknown" // as sd_listen_fds_with_names names one without
		if i < len(named) && names != "" {
			name = named[i]
		}
		out[name] = append(out[name], fd)
	}
	return out
}
