// Package rdmacm is mrfs's RDMA transport for remote peers: an rdma_cm
// listener that gives each connection an RC queue pair in the PD of the
// directory the peer names, and a client that connects and performs
// one-sided operations. The NIC checks every operation (rkey, PD,
// access, range) itself; mrfs only sets the QP up and tears it down.
//
// The listener and the client need the rdma build (-tags rdma); the
// private data format in this file is pure Go and built always, so that
// it is tested everywhere.
package rdmacm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"

	"mrfs/remote"
)

// Private data of a connect request: "MRFS", the version, the PD's token
// (16 bytes), the length of the path, the path of the PD directory
// relative to the mount's root. Over IB and RoCE the request carries 56
// bytes of private data and the receiver sees them all, zero-padded,
// hence the explicit length. Version 2 added the token.
//
// Private data of a reject: "MRFS", the version, an errno (big endian
// uint16), the length of a message and the message (for people).
//
// Private data of an accept: "MRFS", the version, the length of a name
// and the name of mrfs's device the connection came through, whose keys
// the peer must use when buffers are registered on several devices
// (desc's devices). A peer that ignores it works with one device.
const (
	magic       = "MRFS"
	version     = 2
	connectHdr  = len(magic) + 1 + tokenSize + 1
	tokenSize   = len(remote.Token{})
	rejectHdr   = len(magic) + 4
	maxConnect  = 56 // ibv.MaxPrivateConnect
	maxReject   = 148
	maxAccept   = 196                     // ibv.MaxPrivateAccept
	MaxDirBytes = maxConnect - connectHdr // the longest directory a peer can name
)

// ErrPrivateData matches a malformed connect request or reject.
var ErrPrivateData = errors.New("malformed rdma_cm private data")

// errVersion matches, beside ErrPrivateData, a connect request of another
// version: an mrfs peer, not a failing one.
var errVersion = errors.New("another version")

// encodeConnect is the private data naming dir, with its PD's token.
func encodeConnect(dir string, tok remote.Token) ([]byte, error) {
	if len(dir) > MaxDirBytes {
		return nil, fmt.Errorf("directory %q is %d bytes; a connect request carries at most %d: %w", dir, len(dir), MaxDirBytes, syscall.ENAMETOOLONG)
	}
	b := make([]byte, 0, connectHdr+len(dir))
	b = append(b, magic...)
	b = append(b, version)
	b = append(b, tok[:]...)
	b = append(b, byte(len(dir)))
	return append(b, dir...), nil
}

// decodeConnect reads the directory a connect request names and the
// token it presents.
func decodeConnect(b []byte) (dir string, tok remote.Token, err error) {
	if len(b) < len(magic)+1 || string(b[:len(magic)]) != magic {
		return "", tok, fmt.Errorf("%w: no mrfs header (%d bytes)", ErrPrivateData, len(b))
	}
	if v := b[len(magic)]; v != version {
		return "", tok, fmt.Errorf("%w: %w: version %d, this mrfs speaks %d", ErrPrivateData, errVersion, v, version)
	}
	if len(b) < connectHdr {
		return "", tok, fmt.Errorf("%w: no token (%d bytes)", ErrPrivateData, len(b))
	}
	copy(tok[:], b[len(magic)+1:])
	n := int(b[connectHdr-1])
	if connectHdr+n > len(b) {
		return "", tok, fmt.Errorf("%w: path of %d bytes in %d bytes of private data", ErrPrivateData, n, len(b))
	}
	dir = string(b[connectHdr : connectHdr+n])
	for _, c := range []byte(dir) {
		if c == 0 {
			return "", tok, fmt.Errorf("%w: NUL in the path", ErrPrivateData)
		}
	}
	return dir, tok, nil
}

// encodeAccept is the private data of an accept through device.
func encodeAccept(device string) []byte {
	b := make([]byte, 0, len(magic)+2+len(device))
	b = append(b, magic...)
	b = append(b, version, byte(len(device)))
	return append(b, device...)
}

// decodeAccept reads the device an accept names; ok is false when the
// private data names none (an mrfs before several devices, or another
// program).
func decodeAccept(b []byte) (device string, ok bool) {
	h := len(magic) + 2
	if len(b) < h || string(b[:len(magic)]) != magic || b[len(magic)] != version {
		return "", false
	}
	n := int(b[h-1])
	if n == 0 || h+n > len(b) {
		return "", false
	}
	return string(b[h : h+n]), true
}

// encodeReject is the private data of a reject for errno with msg,
// cut to what a reject carries.
func encodeReject(errno syscall.Errno, msg string) []byte {
	if len(msg) > maxReject-rejectHdr {
		msg = msg[:maxReject-rejectHdr]
	}
	b := make([]byte, 0, rejectHdr+len(msg))
	b = append(b, magic...)
	b = append(b, version)
	b = binary.BigEndian.AppendUint16(b, uint16(errno))
	b = append(b, byte(len(msg)))
	return append(b, msg...)
}

// decodeReject reads a reject's errno and message; ok is false when the
// private data is not mrfs's (a reject by the kernel or another program).
func decodeReject(b []byte) (errno syscall.Errno, msg string, ok bool) {
	if len(b) < rejectHdr || string(b[:len(magic)]) != magic || b[len(magic)] != version {
		return 0, "", false
	}
	errno = syscall.Errno(binary.BigEndian.Uint16(b[len(magic)+1:]))
	n := int(b[len(magic)+3])
	if rejectHdr+n > len(b) {
		n = len(b) - rejectHdr
	}
	return errno, string(b[rejectHdr : rejectHdr+n]), true
}
