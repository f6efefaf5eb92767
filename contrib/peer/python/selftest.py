"""Checks mrfs_peer against a live mount (tests/peers_test.go runs it).

usage: MRFS_TOKEN=... python3 selftest.py HOST:PORT PD DESC_FILE
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


peer, pd, desc = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
token = os.environ["MRFS_TOKEN"]
addr, rkey = int(desc["addr"], 0), int(desc["rkey"], 0)

with mrfs_peer.SoftPeer(peer, pd, token) as p:
    check("HELLO_OK names the PD of user.mrfs.pd", p.pd == int(desc["pd"]))
    p.write(addr + 100, rkey, b"soft transport")
    check("READ returns what WRITE put", p.read(addr + 100, rkey, 14) == b"soft transport")
    p.write(addr, rkey, bytes(8))
    check("FETCH_AND_ADD returns the old value", p.fetch_add(addr, rkey, 5) == 0)
    check("COMPARE_AND_SWAP returns the old value", p.compare_swap(addr, rkey, 5, 42) == 5)
    check("the atomics' word is in host order", p.read(addr, rkey, 8) == (42).to_bytes(8, sys.byteorder))
    big = bytes(range(256)) * 32
    p.write_desc(desc, 4096, big)
    check("write_desc and read_desc by the desc's regions", p.read_desc(desc, 4096, len(big)) == big)
    try:
        mrfs_peer.span(desc, int(desc["length"]), 1)
        check("a range past the buffer is refused", False)
    except ValueError:
        check("a range past the buffer is refused", True)
    try:
        p.read(addr, rkey ^ 1, 8)
        check("a wrong rkey fails", False)
    except mrfs_peer.CompletionError as e:
        check("a wrong rkey completes with IBV_WC_REM_ACCESS_ERR", e.status == 10)
    try:
        p.read(addr, rkey, 8)
        check("after an error the queue pair is in the error state", False)
    except mrfs_peer.CompletionError as e:
        check("after an error the queue pair flushes (IBV_WC_WR_FLUSH_ERR)", e.status == 5)

try:
    mrfs_peer.SoftPeer(peer, pd, "00" * 16)
    check("a wrong token is refused", False)
except mrfs_peer.RefusedError as e:
    check("a wrong token is refused with EACCES", e.errno == 13)
