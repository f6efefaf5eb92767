"""A peer of mrfs in pure Python: the soft transport (docs/PROTOCOL.md).

The soft transport carries a peer's one-sided operations (READ, WRITE,
compare-and-swap, fetch-and-add) over TCP to an mrfs mount on the soft
backend, whose daemon runs them against the registered memory as a NIC
would. It needs nothing but the standard library. On real NICs use
rdma_cm instead (docs/REMOTE.md).

    import json, mrfs_peer
    desc = json.loads(open("desc.json").read())   # the buffer's user.mrfs.desc
    with mrfs_peer.SoftPeer("10.0.0.5:7471", "/", token_hex) as p:
        p.write_desc(desc, 0, b"hello")

Errors: RefusedError (the daemon refused the connection: errno and its
message), CompletionError (an operation completed with a status other
than IBV_WC_SUCCESS; the connection is then in the error state, as an RC
queue pair: reconnect to go on), ProtocolError (the daemon's answer broke
the format).
"""

import errno as _errno
import socket
import struct

__all__ = ["SoftPeer", "RefusedError", "CompletionError", "ProtocolError", "span", "WC_STATUS"]

VERSION = 2
_HELLO, _HELLO_OK, _HELLO_ERR = 0x01, 0x02, 0x03
_READ, _WRITE, _CAS, _FADD = 0x10, 0x11, 0x12, 0x13
_COMPLETION = 0x20
_HEADER = struct.Struct(">BBHIQ")  # type, flags, reserved, body length, wr_id

# enum ibv_wc_status, as a requester of a one-sided operation sees it.
WC_STATUS = {
    0: "IBV_WC_SUCCESS",
    1: "IBV_WC_LOC_LEN_ERR",
    4: "IBV_WC_LOC_PROT_ERR",
    5: "IBV_WC_WR_FLUSH_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR",
    10: "IBV_WC_REM_ACCESS_ERR",
    11: "IBV_WC_REM_OP_ERR",
}


class RefusedError(OSError):
    """The daemon refused the connection (HELLO_ERR): errno and message."""


class CompletionError(Exception):
    """An operation completed with a status other than IBV_WC_SUCCESS."""

    def __init__(self, op, status):
        self.op, self.status = op, status
        super().__init__("%s completed with %s" % (op, WC_STATUS.get(status, "IBV_WC_STATUS(%d)" % status)))


class ProtocolError(Exception):
    """The daemon's answer does not follow docs/PROTOCOL.md."""


def span(desc, offset, length):
    """The parts of [addr+offset, +length) of a buffer's desc (its
    user.mrfs.desc, parsed JSON) as (iova, rkey, length) tuples, each
    within one of its regions. A range past the buffer is ValueError."""
    addr, size = int(desc["addr"], 0), int(desc["length"], 0)
    if offset < 0 or length < 0 or offset + length > size:
        raise ValueError("range %d+%d is past the buffer's %d bytes" % (offset, length, size))
    start, end = addr + offset, addr + offset + length
    parts = []
    for r in desc["regions"]:
        ra, rn = int(r["addr"], 0), int(r["length"], 0)
        lo, hi = max(ra, start), min(ra + rn, end)
        if lo < hi:
            parts.append((lo, int(r["rkey"], 0), hi - lo))
    if sum(n for _, _, n in parts) != length:
        raise ValueError("range %d+%d is not covered by the desc's regions" % (offset, length))
    return parts


def _target(peer, pd, token):
    """What every peer's connect takes from its arguments: the host
    (without an IPv6 address's brackets) and port of "HOST:PORT", the
    token's 16 bytes, the directory's path in bytes."""
    host, _, port = peer.rpartition(":")
    tok = bytes.fromhex(token.strip())
    if len(tok) != 16:
        raise ValueError("a token is 32 hex digits")
    return host.strip("[]"), port, tok, pd.encode()


class Peer:
    """What every peer has on top of its transport's write, read,
    max_message and close: use as a context manager (closed at its end),
    and write_desc and read_desc, a range of the buffer a desc names, each
    part with its region's key (of the regions _regions_of picks), in
    messages of at most max_message bytes."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _regions_of(self, desc):
        return desc

    def write_desc(self, desc, offset, data):
        """WRITE data at offset into the buffer a desc names."""
        done = 0
        for iova, rkey, n in span(self._regions_of(desc), offset, len(data)):
            for at in range(0, n, self.max_message):
                m = min(self.max_message, n - at)
                self.write(iova + at, rkey, data[done:done + m])
                done += m

    def read_desc(self, desc, offset, length):
        """READ length bytes at offset of the buffer a desc names."""
        out = bytearray()
        for iova, rkey, n in span(self._regions_of(desc), offset, length):
            for at in range(0, n, self.max_message):
                out += self.read(iova + at, rkey, min(self.max_message, n - at))
        return bytes(out)


class SoftPeer(Peer):
    """One connection to an mrfs mount's PD over the soft transport.

    peer is "HOST:PORT" (the mount's user.mrfs.remote without its
    "tcp "), pd the directory whose PD to join ("/" is the root), token
    that directory's user.mrfs.token (32 hex digits). Not safe for use by
    several threads at once.
    """

    def __init__(self, peer, pd, token, timeout=10.0):
        host, port, tok, path = _target(peer, pd, token)
        self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._wr = 0
        try:
            body = b"MRFS" + struct.pack(">HH", VERSION, len(path)) + tok + path
            self._send(_HELLO, 0, body)
            typ, _, body = self._recv()
            if typ == _HELLO_ERR:
                (err,) = struct.unpack_from(">I", body)
                msg = body[4:].decode(errors="replace")
                raise RefusedError(err, "%s (%s)" % (msg, _errno.errorcode.get(err, err)))
            if typ != _HELLO_OK or len(body) != 12:
                raise ProtocolError("expected HELLO_OK, got frame type 0x%02x" % typ)
            version, _, self.pd, self.max_message = struct.unpack(">HHII", body)
            if version != VERSION:
                raise ProtocolError("mrfs speaks version %d, this peer %d" % (version, VERSION))
        except BaseException:
            self._sock.close()
            raise

    def close(self):
        self._sock.close()

    def _send(self, typ, wr, body):
        self._sock.sendall(_HEADER.pack(typ, 0, 0, len(body), wr) + body)

    def _exactly(self, n):
        b = bytearray()
        while len(b) < n:
            chunk = self._sock.recv(n - len(b))
            if not chunk:
                raise ProtocolError("mrfs closed the connection")
            b += chunk
        return bytes(b)

    def _recv(self):
        typ, flags, res, n, wr = _HEADER.unpack(self._exactly(_HEADER.size))
        if flags or res:
            raise ProtocolError("non-zero flags or reserved field")
        return typ, wr, self._exactly(n)

    def _op(self, typ, name, body):
        self._wr += 1
        self._send(typ, self._wr, body)
        rtyp, wr, rbody = self._recv()
        if rtyp != _COMPLETION or wr != self._wr or len(rbody) < 8 or rbody[4] != typ:
            raise ProtocolError("expected the COMPLETION of %s" % name)
        (status,) = struct.unpack_from(">I", rbody)
        if status:
            raise CompletionError(name, status)
        return rbody[8:]

    def read(self, iova, rkey, length):
        """RDMA READ of length bytes at iova with rkey."""
        data = self._op(_READ, "READ", struct.pack(">QII", iova, rkey, length))
        if len(data) != length:
            raise ProtocolError("READ of %d bytes returned %d" % (length, len(data)))
        return data

    def write(self, iova, rkey, data):
        """RDMA WRITE of data at iova with rkey."""
        self._op(_WRITE, "WRITE", struct.pack(">QII", iova, rkey, 0) + bytes(data))

    def compare_swap(self, iova, rkey, compare, swap):
        """Atomic compare-and-swap of the 8-byte word at iova; returns its old value."""
        return self._old(self._op(_CAS, "COMPARE_AND_SWAP", struct.pack(">QIIQQ", iova, rkey, 0, compare, swap)))

    def fetch_add(self, iova, rkey, add):
        """Atomic fetch-and-add on the 8-byte word at iova; returns its old value."""
        return self._old(self._op(_FADD, "FETCH_AND_ADD", struct.pack(">QIIQ", iova, rkey, 0, add)))

    @staticmethod
    def _old(body):
        if len(body) != 8:
            raise ProtocolError("an atomic's completion carries no old value")
        return struct.unpack(">Q", body)[0]
