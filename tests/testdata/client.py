#!/usr/bin/env python3
"""mrfs test client in Python: the same protocol as client.c.

    client.py [--hold] PATH SIZE

Opens PATH with O_CREAT|O_RDWR, ftruncates it to SIZE, maps it MAP_SHARED,
fills the mapping with the test pattern, writes b"mrfs" at offset 0 with
os.pwrite (and checks the mapping shows it), reads user.mrfs.rkey with
os.getxattr and prints "rkey=<value>" and "addr=0x<mapping address>". With
--hold it prints "ready" and serves "check" (answers "ok" or "bad <offset>")
and "quit" on stdin.
"""
import ctypes
import mmap
import os
import sys

HEADER = b"mrfs"


def expected(size):
    data = bytearray((i * 131 + (i >> 12) + 7) & 0xFF for i in range(size))
    data[0:4] = HEADER
    return bytes(data)


def main(argv):
    hold = False
    if argv and argv[0] == "--hold":
        hold = True
        argv = argv[1:]
    if len(argv) != 2:
        print("usage: client.py [--hold] PATH SIZE", file=sys.stderr)
        return 2
    path, size = argv[0], int(argv[1], 0)
    if size < 4:
        print("SIZE must be at least 4", file=sys.stderr)
        return 2

    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    want = expected(size)
    m[4:size] = want[4:]
    m[0:4] = bytes(4)
    if os.pwrite(fd, HEADER, 0) != 4:
        print("short pwrite", file=sys.stderr)
        return 1
    if m[0:4] != HEADER:
        print("pwrite not visible through the mapping", file=sys.stderr)
        return 3

    rkey = os.getxattr(path, "user.mrfs.rkey").decode()
    anchor = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(anchor)
    print("rkey=" + rkey)
    print("addr=0x%x" % addr)
    sys.stdout.flush()

    if hold:
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd == "check":
                got = m[:]
                if got == want:
                    print("ok", flush=True)
                else:
                    bad = next(i for i in range(size) if got[i] != want[i])
                    print("bad %d" % bad, flush=True)

    del anchor
    m.close()
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
