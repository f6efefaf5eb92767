package rdmacm

import (
	"errors"
	"strings"
	"syscall"
	"testing"

	"mrfs/remote"
)

func TestConnectRoundTrip(t *testing.T) {
	tok := remote.Token{1, 2, 3, 15: 0xff}
	for _, dir := range []string{"", "/", "tenant", "a/b/c", strings.Repeat("x", MaxDirBytes)} {
		b, err := encodeConnect(dir, tok)
		if err != nil {
			t.Fatalf("encode %q: %v", dir, err)
		}
		// The receiver sees the CM message's whole field, zero-padded.
		padded := append(b, make([]byte, maxConnect-len(b))...)
		got, gotTok, err := decodeConnect(padded)
		if err != nil || got != dir || gotTok != tok {
			t.Errorf("decode(encode(%q)) = %q, %x, %v", dir, got, gotTok, err)
		}
	}
	if _, err := encodeConnect(strings.Repeat("x", MaxDirBytes+1), tok); !errors.Is(err, syscall.ENAMETOOLONG) {
		t.Errorf("too long a directory: %v, want ENAMETOOLONG", err)
	}
}

func TestConnectRejectsGarbage(t *testing.T) {
	good, _ := encodeConnect("dir", remote.Token{})
	head := append([]byte("MRFS\x02"), make([]byte, tokenSize)...)
	bad := map[string][]byte{
		"empty":       nil,
		"short":       []byte("MRF"),
		"magic":       append([]byte("XXXX"), good[4:]...),
		"version 1":   append([]byte("MRFS\x01\x03"), "dir"...),
		"no token":    []byte("MRFS\x02\x03dir"),
		"length":      append(append(head, 0x20), "dir"...),
		"nul in path": append(append(head, 3), "d\x00r"...),
	}
	for name, b := range bad {
		_, _, err := decodeConnect(b)
		if !errors.Is(err, ErrPrivateData) {
			t.Errorf("%s: %v, want ErrPrivateData", name, err)
		}
		// Another version is an mrfs peer, not a failure of its source;
		// the rest are.
		if errors.Is(err, errVersion) != (name == "version 1") {
			t.Errorf("%s: %v: another version: %v", name, err, errors.Is(err, errVersion))
		}
	}
}

func TestRejectRoundTrip(t *testing.T) {
	b := encodeReject(syscall.ENOENT, "no directory \"x\"")
	errno, msg, ok := decodeReject(append(b, make([]byte, 20)...))
	if !ok || errno != syscall.ENOENT || msg != "no directory \"x\"" {
		t.Errorf("decodeReject = %v %q %v", errno, msg, ok)
	}
	long := encodeReject(syscall.EACCES, strings.Repeat("m", 500))
	if len(long) > maxReject {
		t.Errorf("reject of %d bytes, at most %d fit", len(long), maxReject)
	}
	if _, _, ok := decodeReject([]byte{0, 0, 0}); ok {
		t.Error("a foreign reject decoded as mrfs's")
	}
}

func TestAcceptRoundTrip(t *testing.T) {
	b := encodeAccept("rxe1")
	if len(b) > maxAccept {
		t.Errorf("accept of %d bytes, at most %d fit", len(b), maxAccept)
	}
	// Over IB and RoCE the peer sees the REP's whole field, zero-padded.
	if dev, ok := decodeAccept(append(b, make([]byte, 40)...)); !ok || dev != "rxe1" {
		t.Errorf("decodeAccept = %q %v, want rxe1", dev, ok)
	}
	for _, bad := range [][]byte{nil, make([]byte, 196), encodeAccept(""), encodeAccept("rxe1")[:7]} {
		if dev, ok := decodeAccept(bad); ok {
			t.Errorf("decodeAccept(%q) = %q: want no device", bad, dev)
		}
	}
}
