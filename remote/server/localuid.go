package server

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"

	"mrfs/remote/gate"
)

// peerOf is c's peer for the gate: its address, and, for a connection
// from this machine (loopback, or the host's own address), the uid that
// owns the peer's socket, which the kernel lists in /proc/net/tcp: the
// gate counts a local peer's failures by uid (every local user shares
// 127.0.0.0/8).
func peerOf(c net.Conn) gate.Peer {
	ra, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return gate.Peer{}
	}
	p := gate.Peer{Addr: ra.AddrPort().Addr()}
	la, ok := c.LocalAddr().(*net.TCPAddr)
	if !ok {
		return p
	}
	remote, local := ra.AddrPort(), la.AddrPort()
	if !remote.Addr().Unmap().IsLoopback() && remote.Addr().Unmap() != local.Addr().Unmap() {
		return p
	}
	p.UID, p.HasUID = socketOwner(remote, local)
	return p
}

// socketOwner is the uid of the local TCP socket bound to from and
// connected to to, as /proc/net/tcp and tcp6 list it.
func socketOwner(from, to netip.AddrPort) (uint32, bool) {
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		six := table == "/proc/net/tcp6"
		if !six && !(from.Addr().Unmap().Is4() && to.Addr().Unmap().Is4()) {
			continue // an IPv6 socket is in tcp6 only
		}
		want := procSocket(from, six) + " " + procSocket(to, six)
		f, err := os.Open(table)
		if err != nil {
			continue
		}
		uid, ok := findOwner(f, want)
		f.Close()
		if ok {
			return uid, true
		}
	}
	return 0, false
}

// findOwner scans a /proc/net/tcp table for the socket whose local and
// remote addresses are want and returns its uid (the eighth field).
func findOwner(f *os.File, want string) (uint32, bool) {
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := bytes.Fields(sc.Bytes())
		if len(fields) < 8 || string(fields[1])+" "+string(fields[2]) != want {
			continue
		}
		uid, err := strconv.ParseUint(string(fields[7]), 10, 32)
		return uint32(uid), err == nil
	}
	return 0, false
}

// procSocket writes ap as /proc/net/tcp (six: tcp6) writes addresses:
// each 32-bit word of the address in the host's (little-endian) order, in
// hex, then the port.
func procSocket(ap netip.AddrPort, six bool) string {
	var b []byte
	if a := ap.Addr(); six {
		s := a.As16()
		b = s[:]
	} else {
		s := a.Unmap().As4()
		b = s[:]
	}
	var out []byte
	for i := 0; i < len(b); i += 4 {
		out = fmt.Appendf(out, "%02X%02X%02X%02X", b[i+3], b[i+2], b[i+1], b[i])
	}
	return fmt.Sprintf("%s:%04X", out, ap.Port())
}
