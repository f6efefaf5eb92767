package sdnotify

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// listen plays systemd's end: a unixgram socket at addr.
func listen(t *testing.T, addr string) *net.UnixConn {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// recv is one datagram's text and the descriptors it carried.
func recv(t *testing.T, c *net.UnixConn) (string, []int) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second)) // fail, not hang, when nothing comes
	buf, oob := make([]byte, 4096), make([]byte, 1024)
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	var fds []int
	msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
	for _, m := range msgs {
		r, err := unix.ParseUnixRights(&m)
		if err != nil {
			t.Fatal(err)
		}
		fds = append(fds, r...)
	}
	return string(buf[:n]), fds
}

func TestSdNotify(t *testing.T) {
	// A path, and an abstract name (@...), as systemd may give either.
	for _, addr := range []string{filepath.Join(t.TempDir(), "notify"), "@mrfs-test-" + t.Name()} {
		c := listen(t, addr)
		t.Setenv("NOTIFY_SOCKET", addr)
		if err := Notify("READY=1\nSTATUS=x"); err != nil {
			t.Fatalf("%s: %v", addr, err)
		}
		if got, _ := recv(t, c); got != "READY=1\nSTATUS=x" {
			t.Errorf("%s: got %q", addr, got)
		}
	}
	t.Setenv("NOTIFY_SOCKET", "")
	if err := Notify("READY=1"); err != nil {
		t.Errorf("without NOTIFY_SOCKET: %v, want nothing done", err)
	}
	t.Setenv("NOTIFY_SOCKET", "vsock:2:1234")
	if err := Notify("READY=1"); err == nil || !strings.Contains(err.Error(), "AF_UNIX") {
		t.Errorf("vsock NOTIFY_SOCKET: %v", err)
	}
	t.Setenv("NOTIFY_SOCKET", filepath.Join(t.TempDir(), "absent"))
	if err := Notify("READY=1"); err == nil {
		t.Errorf("absent socket: no error")
	}
}

// TestNotifyFds: descriptors go with the datagram (FDSTORE=1), and are
// the same files on the manager's side.
func TestNotifyFds(t *testing.T) {
	addr := filepath.Join(t.TempDir(), "notify")
	c := listen(t, addr)
	t.Setenv("NOTIFY_SOCKET", addr)
	f, err := os.CreateTemp(t.TempDir(), "kept")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := Notify("FDSTORE=1\nFDNAME=kept", int(f.Fd()), int(f.Fd())); err != nil {
		t.Fatal(err)
	}
	got, fds := recv(t, c)
	if got != "FDSTORE=1\nFDNAME=kept" || len(fds) != 2 {
		t.Fatalf("got %q with %d descriptors, want FDSTORE=1 with 2", got, len(fds))
	}
	var a, b unix.Stat_t
	for _, fd := range fds {
		if err := unix.Fstat(fd, &a); err != nil {
			t.Fatal(err)
		}
		if err := unix.Fstat(int(f.Fd()), &b); err != nil {
			t.Fatal(err)
		}
		if a.Ino != b.Ino || a.Dev != b.Dev {
			t.Errorf("descriptor %d is inode %d, want %d", fd, a.Ino, b.Ino)
		}
		unix.Close(fd)
	}
}

func TestStoreMax(t *testing.T) {
	for _, c := range []struct {
		notify, fdstore string
		want            int
	}{{"/run/x", "8", 8}, {"", "8", 0}, {"/run/x", "", 0}, {"/run/x", "x", 0}, {"/run/x", "-1", 0}} {
		t.Setenv("NOTIFY_SOCKET", c.notify)
		t.Setenv("FDSTORE", c.fdstore)
		if got := StoreMax(); got != c.want {
			t.Errorf("NOTIFY_SOCKET=%q FDSTORE=%q: %d, want %d", c.notify, c.fdstore, got, c.want)
		}
	}
}

// TestListened runs this test binary as systemd runs a service: with
// descriptors at 3 on and LISTEN_PID its own pid (a shell that executes
// it sets it), and checks what Listened gives in that process.
func TestListened(t *testing.T) {
	if os.Getenv("SDNOTIFY_TEST_CHILD") != "" {
		got := Listened()
		for _, k := range []string{"LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"} {
			if v, ok := os.LookupEnv(k); ok {
				t.Errorf("%s=%q left in the environment", k, v)
			}
		}
		if len(got) != 2 || len(got["a"]) != 2 || len(got["b"]) != 1 || got["a"][0] != 3 || got["b"][0] != 4 || got["a"][1] != 5 {
			t.Fatalf("Listened: %v, want a: [3 5], b: [4]", got)
		}
		for _, fd := range []int{3, 4, 5} {
			if flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil || flags&unix.FD_CLOEXEC == 0 {
				t.Errorf("fd %d: flags %#x, %v: want close-on-exec", fd, flags, err)
			}
		}
		if again := Listened(); again != nil {
			t.Errorf("Listened again: %v, want nil", again)
		}
		return
	}
	var files []*os.File
	for range 3 {
		f, err := os.Open(os.DevNull)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files = append(files, f)
	}
	for _, pid := range []string{"$$", "1"} {
		cmd := exec.Command("/bin/sh", "-c", `LISTEN_PID=`+pid+` exec "$0" "$@"`, os.Args[0], "-test.run", "^TestListened$")
		cmd.Env = append(os.Environ(), "SDNOTIFY_TEST_CHILD=1", "LISTEN_FDS=3", "LISTEN_FDNAMES=a:b:a")
		cmd.ExtraFiles = files
		out, err := cmd.CombinedOutput()
		switch {
		case pid == "$$" && err != nil:
			t.Errorf("as the service: %v\n%s", err, out)
		case pid == "1" && err == nil:
			t.Errorf("with another process's LISTEN_PID: the descriptors were taken\n%s", out)
		}
	}
}
