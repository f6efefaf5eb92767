package cli

import (
	"fmt"
	"net"
	"os"
	"strings"
)

// sdNotify tells the service manager about the daemon's state, as
// sd_notify(3) does: one datagram of newline-separated VAR=VALUE
// assignments ("READY=1") to the AF_UNIX socket named by $NOTIFY_SOCKET
// (a leading @ names an abstract socket, which Go's net package maps).
// Without $NOTIFY_SOCKET there is no manager listening and nothing to do.
//
// These few lines stand in for a library (coreos/go-systemd's daemon
// package would do): the protocol is small, stable and documented, and
// a dependency would bring more than the one call mrfs makes.
func sdNotify(state string) error {
	addr := os.Getenv("NOTIFY_SOCKET")
	if addr == "" {
		return nil
	}
	if !strings.HasPrefix(addr, "/") && !strings.HasPrefix(addr, "@") {
		return fmt.Errorf("notify the service manager: NOTIFY_SOCKET=%q is not an AF_UNIX socket; mrfs supports only those", addr)
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		return fmt.Errorf("notify the service manager: %w", err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(state)); err != nil {
		return fmt.Errorf("notify the service manager of %q: %w", state, err)
	}
	return nil
}
