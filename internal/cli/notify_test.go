package cli

import (
	"net"
	"path/filepath"
	"strings"
	"testing"
)

// listenNotify plays systemd's end: a unixgram socket at addr.
func listenNotify(t *testing.T, addr string) *net.UnixConn {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func recv(t *testing.T, c *net.UnixConn) string {
	t.Helper()
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

func TestSdNotify(t *testing.T) {
	// A path, and an abstract name (@...), as systemd may give either.
	for _, addr := range []string{filepath.Join(t.TempDir(), "notify"), "@mrfs-test-" + t.Name()} {
		c := listenNotify(t, addr)
		t.Setenv("NOTIFY_SOCKET", addr)
		if err := sdNotify("READY=1\nSTATUS=x"); err != nil {
			t.Fatalf("%s: %v", addr, err)
		}
		if got := recv(t, c); got != "READY=1\nSTATUS=x" {
			t.Errorf("%s: got %q", addr, got)
		}
	}
	t.Setenv("NOTIFY_SOCKET", "")
	if err := sdNotify("READY=1"); err != nil {
		t.Errorf("without NOTIFY_SOCKET: %v, want nothing done", err)
	}
	t.Setenv("NOTIFY_SOCKET", "vsock:2:1234")
	if err := sdNotify("READY=1"); err == nil || !strings.Contains(err.Error(), "AF_UNIX") {
		t.Errorf("vsock NOTIFY_SOCKET: %v", err)
	}
	t.Setenv("NOTIFY_SOCKET", filepath.Join(t.TempDir(), "absent"))
	if err := sdNotify("READY=1"); err == nil {
		t.Errorf("absent socket: no error")
	}
}
