"""Checks a Python peer against a live mount: mrfs_peer's SoftPeer
(tests/peers_test.go runs it), or with --verbs mrfs_verbs's VerbsPeer on
an RDMA device (tests/vm/guest/peers_test.go runs it on Soft-RoCE).

usage: MRFS_TOKEN=... python3 selftest.py [--verbs] HOST:PORT PD DESC_FILE
The buffer must have remote read, write and atomic access and be at
least 8 KiB. Prints one line per check; exits 1 at the first failure.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mrfs_peer  # noqa: E402


def check(what, cond):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        sys.exit(1)


args = sys.argv[1:]
verbs = args[:1] == ["--verbs"]
if verbs:
    import mrfs_verbs  # noqa: E402 (pyverbs: only where there is RDMA)
    args, connect, marker = args[1:], mrfs_verbs.VerbsPeer, b"rdma_cm peer in Python"
else:
    connect, marker = mrfs_peer.SoftPeer, b"soft transport"
peer, pd, desc = args[0], args[1], json.load(open(args[2]))
token = os.environ["MRFS_TOKEN"]
addr, rkey = int(desc["addr"], 0), int(desc["rkey"], 0)

with connect(peer, pd, token) as p:
    if verbs:
        print("     through mrfs's device", p.device)
        check("the accept names mrfs's device", p.device == desc["device"])
        p.write(addr, rkey, b"")
        check("WRITE and READ of zero bytes", p.read(addr, rkey, 0) == b"")
    else:
        check("HELLO_OK names the PD of user.mrfs.pd", p.pd == int(desc["pd"]))
    p.write(addr + 100, rkey, marker)
    check("READ returns what WRITE put", p.read(addr + 100, rkey, len(marker)) == marker)
    p.write(addr, rkey, bytes(8))
    check("FETCH_AND_ADD returns the old value", p.fetch_add(addr, rkey, 5) == 0)
    check("COMPARE_AND_SWAP returns the old value", p.compare_swap(addr, rkey, 5, 42) == 5)
    check("a COMPARE_AND_SWAP that does not match swaps nothing", p.compare_swap(addr, rkey, 5, 7) == 42)
    check("the atomics' word is in host order", p.read(addr, rkey, 8) == (42).to_bytes(8, sys.byteorder))
    big = bytes(range(256)) * 32
    p.write_desc(desc, 4096, big)
    check("write_desc and read_desc by the desc's regions", p.read_desc(desc, 4096, len(big)) == big)
    try:
        p.read_desc(desc, int(desc["length"]), 1)
        check("a range past the buffer is refused", False)
    except ValueError:
        check("a range past the buffer is refused", True)
    try:
        p.read(addr, rkey ^ 1, 8)
        check("a wrong rkey fails", False)
    except mrfs_peer.CompletionError as e:
        print("    ", e)
        check("a wrong rkey completes with IBV_WC_REM_ACCESS_ERR", e.status == 10)
    try:
        p.read(addr, rkey, 8)
        check("after an error the queue pair is in the error state", False)
    except mrfs_peer.CompletionError as e:
        check("after an error the queue pair flushes (IBV_WC_WR_FLUSH_ERR)", e.status == 5)

refusals = [("a wrong token", pd, "00" * 16, 13)]
if verbs:
    refusals.append(("an unknown directory", "nosuchdir", token, 2))
for what, d, tok, errno in refusals:
    try:
        connect(peer, d, tok).close()
        check(what + " is refused", False)
    except mrfs_peer.RefusedError as e:
        print("    ", e)
        check("%s is refused with errno %d" % (what, errno), e.errno == errno)
