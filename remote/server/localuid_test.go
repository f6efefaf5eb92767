package server

import (
	"net"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// A connection from this machine carries the uid that owns the peer's
// socket (from /proc/net/tcp): the gate counts a local peer's failures by
// it. Here the peer is another user's process.
func TestPeerOfLocalConnection(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("connecting as another uid needs root (setpriv)")
	}
	for _, network := range []string{"tcp4", "tcp6"} {
		addr := "127.0.0.1:0"
		if network == "tcp6" {
			addr = "[::1]:0"
		}
		ln, err := net.Listen(network, addr)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		port := ln.Addr().(*net.TCPAddr).Port
		host := ln.Addr().(*net.TCPAddr).IP.String()
		// The client holds its socket open until we close ours.
		client := exec.Command("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
			`import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); s.recv(1)`, host, strconv.Itoa(port))
		if err := client.Start(); err != nil {
			t.Fatal(err)
		}
		ln.(*net.TCPListener).SetDeadline(time.Now().Add(30 * time.Second))
		c, err := ln.Accept()
		if err != nil {
			client.Process.Kill()
			t.Fatal(err)
		}
		p := peerOf(c)
		c.Close()
		client.Wait()
		if !p.HasUID || p.UID != 65534 || !p.Addr.IsLoopback() {
			t.Errorf("%s: peer %+v, want loopback owned by uid 65534", network, p)
		}
	}
}
