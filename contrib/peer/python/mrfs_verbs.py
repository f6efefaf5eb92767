"""A peer of mrfs in Python over rdma_cm, on pyverbs (rdma-core's own
bindings; Debian python3-pyverbs).

It connects to an mrfs mount's rdma_cm listener with the connect format of
docs/REMOTE.md (the PD's directory and its token in the private data),
gets a queue pair in that directory's PD, and posts one-sided READ, WRITE,
compare-and-swap and fetch-and-add, one at a time, waiting for each
completion. Its API is mrfs_peer.SoftPeer's (the soft transport), and so
are its errors; mrfs_peer.py must be beside it.

    import json, mrfs_verbs
    desc = json.load(open("desc.json"))   # the buffer's user.mrfs.desc
    with mrfs_verbs.VerbsPeer("10.0.0.5:7471", "/", token_hex) as p:
        p.write_desc(desc, 0, b"hello")

Errors: RefusedError (mrfs refused the connection: its errno and
message), CompletionError (an operation completed with a status other
than IBV_WC_SUCCESS; the queue pair is then in the error state: reconnect
to go on), ConnectionError (nothing of mrfs answered), TimeoutError (no
completion within the timeout), and pyverbs's own for local failures.
"""

import errno as _errno
import sys
import time

import pyverbs.cm_enums as ce
import pyverbs.enums as e
from pyverbs.cmid import CMID, AddrInfo, CMEvent, CMEventChannel, ConnParam
from pyverbs.cq import CQ
from pyverbs.mr import MR
from pyverbs.qp import QP, QPCap, QPInitAttr
from pyverbs.wr import SGE, SendWR

from mrfs_peer import CompletionError, Peer, ProtocolError, RefusedError, _target, span  # noqa: F401 (re-exported)

__all__ = ["VerbsPeer", "RefusedError", "CompletionError", "ProtocolError", "span"]

VERSION = 2
MAX_PRIVATE = 56  # bytes of private data a connect request carries over IB and RoCE
HEADER = 22  # "MRFS", the version, the token's 16 bytes, the path's length
MAX_MESSAGE = 1 << 31  # the largest RDMA message (the IB specification, rxe)


def _device(data):
    """The device an accept's private data names: "MRFS", the version,
    the name's length and the name; "" when it names none."""
    if len(data) < 6 or data[:4] != b"MRFS" or data[4] != VERSION or 6 + data[5] > len(data):
        return ""
    return data[6:6 + data[5]].decode(errors="replace")


def _refused(data):
    """The error a reject's private data says: "MRFS", the version, an
    errno (big endian 16 bits), the message's length and the message."""
    if len(data) < 8 or data[:4] != b"MRFS" or data[4] != VERSION:
        return ConnectionRefusedError(_errno.ECONNREFUSED, "rejected: nothing listens there, or not mrfs")
    err = int.from_bytes(data[5:7], "big")
    msg = data[8:8 + data[7]].decode(errors="replace")
    return RefusedError(err, "%s (%s)" % (msg, _errno.errorcode.get(err, err)))


class VerbsPeer(Peer):
    """One rdma_cm connection to an mrfs mount's PD.

    peer is "HOST:PORT" (the mount's user.mrfs.remote without its
    "rdma_cm "), pd the directory whose PD to join ("/" is the root; at
    most 34 bytes), token that directory's user.mrfs.token (32 hex
    digits). timeout bounds address and route resolution and every
    completion; connecting waits as long as rdma_cm does. device is the
    name of mrfs's device the connection came through (from the accept):
    on a mount of several devices only its keys work here, and
    read_desc/write_desc pick them. Not safe for use by several threads
    at once.
    """

    def __init__(self, peer, pd, token, timeout=10.0):
        host, port, tok, path = _target(peer, pd, token)
        if len(path) > MAX_PRIVATE - HEADER:
            raise ValueError("directory %r is %d bytes; a connect request carries at most %d"
                             % (pd, len(path), MAX_PRIVATE - HEADER))
        self.timeout, self.device, self.max_message = timeout, "", MAX_MESSAGE
        self._ch = self._id = self._cq = self._qp = self._mr = None
        self._connected, self._broken, self._wr = False, False, 0
        ms = int(timeout * 1000)
        try:
            self._ch = CMEventChannel()
            self._id = CMID(creator=self._ch)
            self._id.resolve_addr(AddrInfo(dst=host, dst_service=port, port_space=ce.RDMA_PS_TCP), ms)
            self._expect(ce.RDMA_CM_EVENT_ADDR_RESOLVED)
            self._id.resolve_route(ms)
            self._expect(ce.RDMA_CM_EVENT_ROUTE_RESOLVED)
            # A queue pair of our own, not the CMID's: pyverbs posts
            # atomics only on a QP object. rdma_cm gives its attributes
            # at every step, as it would for its own.
            self._cq = CQ(self._id.context, 16)
            cap = QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            self._qp = QP(self._id.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap))
            self._grow(64 << 10)
            self._to(e.IBV_QPS_INIT)
            # data_len: without it ConnParam drops the private data, and
            # mrfs refuses a request that names no directory. Initiator
            # depth 1: this side issues READs and atomics, one at a time.
            param = ConnParam(resources=0, depth=1, retry=7, rnr_retry=7, qp_num=self._qp.qp_num,
                              data_len=MAX_PRIVATE)
            param.set_private_data(b"MRFS" + bytes([VERSION]) + tok + bytes([len(path)]) + path)
            self._id.connect(param)
            typ, what, data = self._event()
            if typ == ce.RDMA_CM_EVENT_REJECTED:
                raise _refused(data)
            # Its QP is not the CMID's, so rdma_cm reports the reply
            # (CONNECT_RESPONSE), and the QP is readied here.
            if typ != ce.RDMA_CM_EVENT_CONNECT_RESPONSE:
                raise ConnectionError(_errno.ECONNREFUSED, "connect to mrfs at %s: %s" % (peer, what))
            self.device = _device(data)
            self._to(e.IBV_QPS_RTR)
            self._to(e.IBV_QPS_RTS)
            self._id.establish()
            self._connected = True
        except BaseException:
            self.close()
            raise

    def close(self):
        """Disconnects, then frees the QP, the local buffer, the CQ, the
        CMID (and with it the device) and the event channel."""
        if self._connected:
            self._connected = False
            self._id.disconnect()
        for name in ("_qp", "_mr", "_cq", "_id", "_ch"):
            obj = getattr(self, name)
            if obj is not None:
                setattr(self, name, None)
                obj.close()

    def _event(self):
        """The next rdma_cm event's type, name and private data; it is
        acknowledged (the private data goes with it)."""
        ev = CMEvent(self._ch)
        try:
            return ev.event_type, ev.event_str(), ev.private_data
        finally:
            ev.close()

    def _expect(self, want):
        typ, what, _ = self._event()
        if typ != want:
            raise ConnectionError(_errno.EHOSTUNREACH, "rdma_cm said %s" % what)

    def _to(self, state):
        attr, mask = self._id.init_qp_attr(state)
        self._qp.modify(attr, mask)

    def _grow(self, n):
        """Makes the registered local buffer at least n bytes."""
        if self._mr is not None and self._mr.length >= n:
            return
        if self._mr is not None:
            self._mr.close()
            self._mr = None
        # Local write: READs and atomics land here.
        self._mr = MR(self._id.pd, max((n + 4095) & ~4095, 4096), e.IBV_ACCESS_LOCAL_WRITE)

    def _post(self, name, opcode, length, iova, rkey, atomic=None):
        """Posts one operation on length bytes of the local buffer and
        waits for its completion."""
        if self._qp is None:
            raise ConnectionError(_errno.ENOTCONN, "%s: the connection is closed" % name)
        if self._broken:
            raise ConnectionError(_errno.EIO, "%s: an earlier operation timed out; connect again" % name)
        self._wr += 1
        wr = SendWR(wr_id=self._wr, opcode=opcode, num_sge=1, sg=[SGE(self._mr.buf, length, self._mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        if atomic is None:
            wr.set_wr_rdma(rkey, iova)
        else:
            wr.set_wr_atomic(rkey, iova, *atomic)
        try:
            self._qp.post_send(wr)
        finally:
            wr.close()  # (pyverbs frees a SendWR's list only here)
        deadline, pause = time.monotonic() + self.timeout, 1e-5
        while True:
            n, wcs = self._cq.poll()
            if n:
                break
            if time.monotonic() > deadline:
                self._broken = True
                raise TimeoutError(_errno.ETIMEDOUT, "%s at 0x%x: no completion within %gs" % (name, iova, self.timeout))
            # Polled, with short sleeps: the emulated NIC needs the CPU too.
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if wcs[0].status != e.IBV_WC_SUCCESS:
            raise CompletionError(name, wcs[0].status)

    def read(self, iova, rkey, length):
        """RDMA READ of length bytes at iova with rkey."""
        self._grow(length)
        self._post("RDMA READ", e.IBV_WR_RDMA_READ, length, iova, rkey)
        return self._mr.read(length, 0) if length else b""

    def write(self, iova, rkey, data):
        """RDMA WRITE of data at iova with rkey."""
        data = bytes(data)
        self._grow(len(data))
        if data:
            self._mr.write(data, len(data))
        self._post("RDMA WRITE", e.IBV_WR_RDMA_WRITE, len(data), iova, rkey)

    def compare_swap(self, iova, rkey, compare, swap):
        """Atomic compare-and-swap of the 8-byte word at iova; returns its
        old value (the word is in the target's byte order)."""
        self._post("ATOMIC_CMP_AND_SWP", e.IBV_WR_ATOMIC_CMP_AND_SWP, 8, iova, rkey, (compare, swap))
        return self._old()

    def fetch_add(self, iova, rkey, add):
        """Atomic fetch-and-add on the 8-byte word at iova; returns its old value."""
        self._post("ATOMIC_FETCH_AND_ADD", e.IBV_WR_ATOMIC_FETCH_AND_ADD, 8, iova, rkey, (add, 0))
        return self._old()

    def _old(self):
        return int.from_bytes(self._mr.read(8, 0), sys.byteorder)

    def _regions_of(self, desc):
        """desc with the regions of this connection's device, when it
        lists several devices' (its "devices")."""
        devices = desc.get("devices")
        if not devices or not self.device:
            return desc
        for d in devices:
            if d.get("device") == self.device:
                return dict(desc, regions=d["regions"])
        raise ValueError("the desc has no regions of device %r" % self.device)
