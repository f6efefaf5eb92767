package cli

import (
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"mrfs/internal/config"
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
	c.SetReadDeadline(time.Now().Add(10 * time.Second)) // fail, not hang, when nothing comes
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

// A stop signal that came while mounting: ready reports nothing and
// leaves the signal for the teardown. Without one, ready checks that the
// mount answers as FUSE before it reports.
func TestReadyWithPendingSignal(t *testing.T) {
	addr := filepath.Join(t.TempDir(), "notify")
	c := listenNotify(t, addr)
	t.Setenv("NOTIFY_SOCKET", addr)
	svc, err := newService(config.Default().Log, io.Discard, false)
	if err != nil {
		t.Fatal(err)
	}
	defer svc.close(nil)
	sigs := make(chan os.Signal, 1)
	sigs <- syscall.SIGTERM
	if err := svc.ready(t.TempDir(), sigs); err != nil || svc.isReady {
		t.Errorf("ready with a pending signal: %v, ready %v; want quiet, not ready", err, svc.isReady)
	}
	if len(sigs) != 1 {
		t.Errorf("the pending signal was not left for the teardown")
	}
	select {
	case <-sigs:
	default:
	}
	if err := svc.ready(t.TempDir(), sigs); err == nil || !strings.Contains(err.Error(), "not a FUSE mount") {
		t.Errorf("ready on a plain directory: %v", err)
	}
	c.SetReadDeadline(time.Now())
	if n, _ := c.Read(make([]byte, 64)); n > 0 {
		t.Errorf("READY=1 was sent for a mount that is not ready")
	}
}
