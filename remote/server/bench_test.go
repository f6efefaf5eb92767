package server_test

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"mrfs/remote/client"
	"mrfs/remote/gate"
)

// BenchmarkRemote compares the soft protocol's WRITE and READ (one
// operation at a time, loopback) with a plain TCP exchange of the same
// bytes in the same run: the client sends a 16-byte request plus the
// payload (or asks for it) and waits for the answer, as a round trip of
// the soft protocol does, but nothing is checked or copied into a
// registered buffer. ns/op is the latency of one operation; MB/s its
// throughput.
func BenchmarkRemote(b *testing.B) {
	for _, size := range []int{4 << 10, 1 << 20} {
		name := "4KiB"
		if size == 1<<20 {
			name = "1MiB"
		}
		b.Run("soft-write-"+name, func(b *testing.B) { benchSoft(b, size, true) })
		b.Run("tcp-write-"+name, func(b *testing.B) { benchTCP(b, size, true) })
		b.Run("soft-read-"+name, func(b *testing.B) { benchSoft(b, size, false) })
		b.Run("tcp-read-"+name, func(b *testing.B) { benchTCP(b, size, false) })
	}
}

func benchSoft(b *testing.B, size int, write bool) {
	e := setup(b, gate.Policy{MaxMessage: 2 << 20})
	buf, err := e.mgr.Create(e.doms["/"], uint64(size), 0)
	if err != nil {
		b.Fatal(err)
	}
	info := buf.Info()
	c, err := client.Dial(context.Background(), e.addr, "/", e.tok("/"))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	data := make([]byte, size)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for b.Loop() {
		if write {
			err = c.Write(uint64(info.Addr), info.RKey, data)
		} else {
			err = c.Read(data, uint64(info.Addr), info.RKey)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
}

// benchTCP: a server that, per request header (16 bytes: op, length),
// reads length bytes and answers 16 bytes (write), or answers 16 bytes
// plus length bytes (read).
func benchTCP(b *testing.B, size int, write bool) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	go func() {
		s, err := ln.Accept()
		if err != nil {
			return
		}
		defer s.Close()
		hdr := make([]byte, 16)
		payload := make([]byte, 2<<20)
		for {
			if _, err := io.ReadFull(s, hdr); err != nil {
				return
			}
			n := int(binary.BigEndian.Uint32(hdr[4:]))
			if hdr[0] == 'W' {
				if _, err := io.ReadFull(s, payload[:n]); err != nil {
					return
				}
				if _, err := s.Write(hdr); err != nil {
					return
				}
			} else {
				bufs := net.Buffers{hdr, payload[:n]}
				if _, err := bufs.WriteTo(s); err != nil {
					return
				}
			}
		}
	}()
	c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	data := make([]byte, size)
	hdr := make([]byte, 16)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for b.Loop() {
		hdr[0] = 'R'
		if write {
			hdr[0] = 'W'
		}
		binary.BigEndian.PutUint32(hdr[4:], uint32(size))
		if write {
			bufs := net.Buffers{hdr, data}
			if _, err := bufs.WriteTo(c); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, hdr); err != nil {
				b.Fatal(err)
			}
		} else {
			if _, err := c.Write(hdr); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, hdr); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, data); err != nil {
				b.Fatal(err)
			}
		}
	}
}
