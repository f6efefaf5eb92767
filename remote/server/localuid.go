package server

import (
	"encoding/binary"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"

	"mrfs/remote/gate"
)

// peerOf is c's peer for the gate: its address, and, for a connection
// from this machine (loopback, or the host's own address), the uid that
// owns the peer's socket, which the kernel tells through sock_diag: the
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
// connected to to. One exact sock_diag query per family (the kernel looks
// the socket up by its addresses, not by a walk of every socket, as a
// read of /proc/net/tcp would: a local peer making thousands of
// connections must not make each accept slower).
func socketOwner(from, to netip.AddrPort) (uint32, bool) {
	if from.Addr().Unmap().Is4() && to.Addr().Unmap().Is4() {
		if uid, ok := diagOwner(unix.AF_INET, from, to); ok {
			return uid, true
		}
	}
	return diagOwner(unix.AF_INET6, from, to)
}

// The kernel's struct inet_diag_req_v2 and inet_diag_msg (linux/inet_diag.h):
// x/sys has no types for them.
const (
	diagReqLen   = 56            // inet_diag_req_v2
	diagUIDAt    = 4 + 48 + 12   // idiag_uid in inet_diag_msg
	diagMsgLen   = diagUIDAt + 8 // up to idiag_inode
	diagNoCookie = ^uint32(0)    // INET_DIAG_NOCOOKIE
	allStates    = ^uint32(0)
)

// diagOwner asks sock_diag for the TCP socket of family bound to from and
// connected to to, and returns its owner's uid.
func diagOwner(family int, from, to netip.AddrPort) (uint32, bool) {
	s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return 0, false
	}
	defer unix.Close(s)
	req := make([]byte, unix.NLMSG_HDRLEN+diagReqLen)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.SOCK_DIAG_BY_FAMILY)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST)
	binary.NativeEndian.PutUint32(req[8:], 1) // seq
	r := req[unix.NLMSG_HDRLEN:]
	r[0], r[1] = byte(family), unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(r[4:], allStates)
	id := r[8:]
	binary.BigEndian.PutUint16(id[0:], from.Port())
	binary.BigEndian.PutUint16(id[2:], to.Port())
	putAddr(id[4:20], from.Addr(), family)
	putAddr(id[20:36], to.Addr(), family)
	binary.NativeEndian.PutUint32(id[40:], diagNoCookie)
	binary.NativeEndian.PutUint32(id[44:], diagNoCookie)
	if err := unix.Sendto(s, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, false
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(s, buf, 0)
	if err != nil || n < unix.NLMSG_HDRLEN+diagMsgLen {
		return 0, false // NLMSG_ERROR (ENOENT: no such socket) is shorter
	}
	if binary.NativeEndian.Uint16(buf[4:]) != unix.SOCK_DIAG_BY_FAMILY {
		return 0, false
	}
	return binary.NativeEndian.Uint32(buf[unix.NLMSG_HDRLEN+diagUIDAt:]), true
}

// putAddr writes a as sock_diag does: 4 bytes in network order for
// AF_INET, 16 for AF_INET6 (an IPv4 address IPv4-mapped).
func putAddr(dst []byte, a netip.Addr, family int) {
	if family == unix.AF_INET {
		b := a.Unmap().As4()
		copy(dst, b[:])
		return
	}
	b := a.As16()
	copy(dst, b[:])
}
