package server

import (
	"net"
	"testing"
	"time"

	"mrfs/remote/proto"
)

// HelloWaiting tells a connection whose first frame has arrived whole
// from one that sent nothing or only part of it, without taking a byte.
func TestHelloWaiting(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	hello, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: proto.Version, Path: "/dir"})
	for _, c := range []struct {
		name string
		sent []byte
		want bool
	}{
		{"nothing", nil, false},
		{"part of the header", hello[:5], false},
		{"the header", hello[:proto.HeaderSize], false},
		{"all but a byte", hello[:len(hello)-1], false},
		{"the hello", hello, true},
		{"the hello and more", append(hello, 1, 2, 3), true},
	} {
		peer, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c2, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		peer.Write(c.sent)
		p := pendingConn{c2}
		// Bytes written on loopback are queued at once; wait for them
		// anyway where they are expected, never for the answer.
		for deadline := time.Now().Add(5 * time.Second); c.want && !p.HelloWaiting() && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		if got := p.HelloWaiting(); got != c.want {
			t.Errorf("%s: HelloWaiting %v, want %v", c.name, got, c.want)
		}
		if c.want {
			c2.SetReadDeadline(time.Now().Add(5 * time.Second))
			if f, err := proto.ReadHello(c2); err != nil || f.Path != "/dir" {
				t.Errorf("%s: the hello after peeking: %+v, %v", c.name, f, err)
			}
		}
		peer.Close()
		c2.Close()
	}
}
