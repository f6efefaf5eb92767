package proto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
)

const testMax = 1 << 16

// samples are valid frames of every type, used by the round-trip test and
// as fuzz seeds.
var samples = []Frame{
	{Type: TypeHello, WRID: 0, Version: Version, Path: "/"},
	{Type: TypeHello, Version: Version, Path: "/tenant/a", Token: [TokenSize]byte{1, 2, 3, 15: 0xff}},
	{Type: TypeHelloOK, Version: Version, PD: 3, MaxMessage: 16 << 20},
	{Type: TypeHelloErr, Errno: 2, Msg: "no directory \"/x\""},
	{Type: TypeRead, WRID: 1, IOVA: 0x7f0000001000, RKey: 0x1a7, Length: 4096},
	{Type: TypeRead, WRID: 2, IOVA: 0, RKey: 0, Length: 0},
	{Type: TypeWrite, WRID: 3, IOVA: 0x7f0000001000, RKey: 0x1a7, Data: []byte("hello")},
	{Type: TypeWrite, WRID: 4, IOVA: 1, RKey: 2},
	{Type: TypeCAS, WRID: 5, IOVA: 0x1000, RKey: 0x2ff, Compare: 1, Swap: 2},
	{Type: TypeFetchAdd, WRID: 6, IOVA: 0x1008, RKey: 0x2ff, Add: 1<<64 - 1},
	{Type: TypeCompletion, WRID: 1, Op: TypeRead, Data: []byte("data")},
	{Type: TypeCompletion, WRID: 3, Op: TypeWrite},
	{Type: TypeCompletion, WRID: 5, Op: TypeCAS, Old: 42},
	{Type: TypeCompletion, WRID: 6, Op: TypeFetchAdd, Old: 7},
	{Type: TypeCompletion, WRID: 7, Op: TypeRead, Status: 10},
	{Type: TypeCompletion, WRID: 8, Op: TypeCAS, Status: 9},
}

func mustAppend(t testing.TB, f Frame) []byte {
	t.Helper()
	b, err := Append(nil, f)
	if err != nil {
		t.Fatalf("Append(%+v): %v", f, err)
	}
	return b
}

// normal makes nil and empty Data compare equal.
func normal(f Frame) Frame {
	if len(f.Data) == 0 {
		f.Data = nil
	}
	return f
}

func TestRoundTrip(t *testing.T) {
	var stream []byte
	for _, f := range samples {
		b := mustAppend(t, f)
		stream = append(stream, b...)
		got, n, err := Decode(b, testMax)
		if err != nil || n != len(b) {
			t.Fatalf("Decode(Append(%+v)) = %v, %d, %v", f, got, n, err)
		}
		if !reflect.DeepEqual(normal(got), normal(f)) {
			t.Errorf("round trip:\n got %+v\nwant %+v", got, f)
		}
		// Every strict prefix is incomplete, never an error or a frame.
		for i := range len(b) {
			if _, _, err := Decode(b[:i], testMax); err != ErrShort {
				t.Errorf("%s: Decode of %d of %d bytes: %v, want ErrShort", f.Type, i, len(b), err)
			}
		}
	}
	// The same frames through the stream reader.
	r := NewReader(bytes.NewReader(stream), testMax)
	for _, f := range samples {
		got, err := r.Next()
		if err != nil {
			t.Fatalf("Next: %v", err)
		}
		if !reflect.DeepEqual(normal(got), normal(f)) {
			t.Errorf("stream:\n got %+v\nwant %+v", got, f)
		}
	}
	if _, err := r.Next(); err != io.EOF {
		t.Errorf("Next at the end: %v, want io.EOF", err)
	}
}

// rawHeader builds a raw header.
func rawHeader(typ Type, blen uint32) []byte {
	b := make([]byte, HeaderSize)
	b[0] = byte(typ)
	binary.BigEndian.PutUint32(b[4:], blen)
	return b
}

func TestRefused(t *testing.T) {
	write := mustAppend(t, Frame{Type: TypeWrite, IOVA: 1, RKey: 2, Data: []byte("x")})
	flags := append([]byte{}, write...)
	flags[1] = 1
	reserved := append([]byte{}, write...)
	reserved[HeaderSize+12] = 1
	hello := mustAppend(t, Frame{Type: TypeHello, Version: Version, Path: "/a"})
	badMagic := append([]byte{}, hello...)
	badMagic[HeaderSize] = 'X'
	badPathLen := append([]byte{}, hello...)
	badPathLen[HeaderSize+7] = 9
	oldHello := append([]byte{}, hello...)
	oldHello[HeaderSize+5] = 1 // version 1: no token
	newHello := append([]byte{}, hello...)
	newHello[HeaderSize+5] = Version + 1
	compl := mustAppend(t, Frame{Type: TypeCompletion, Op: TypeWrite})
	complData := append(append([]byte{}, compl...), 'x')
	binary.BigEndian.PutUint32(complData[4:], 9)
	complOp := append([]byte{}, compl...)
	complOp[HeaderSize+4] = byte(TypeHello)
	for _, c := range []struct {
		name string
		b    []byte
		msg  string
	}{
		{"unknown type", rawHeader(0x7f, 0), "unknown frame type"},
		{"flags", flags, "non-zero flags"},
		{"reserved op field", reserved, "reserved field"},
		{"write over max", rawHeader(TypeWrite, opFixed+testMax+1), "max message size"},
		{"write 4 GiB", rawHeader(TypeWrite, 0xffffffff), "max message size"},
		{"read body size", rawHeader(TypeRead, 12), "want 16"},
		{"cas body size", rawHeader(TypeCAS, 24), "want 32"},
		{"hello huge path", rawHeader(TypeHello, helloFixed+MaxPath+1), "HELLO body"},
		{"hello magic", badMagic, "MRFS"},
		{"hello path length", badPathLen, "path length"},
		{"hello of version 1", oldHello, "version 1"},
		{"hello of a newer version", newHello, fmt.Sprintf("version %d", Version+1)},
		{"hello without its token", append(rawHeader(TypeHello, 8), "MRFS\x00\x02\x00\x00"...), "HELLO body"},
		{"completion payload", complData, "carries 1 bytes"},
		{"completion of a non-op", complOp, "not an operation"},
	} {
		_, _, err := Decode(c.b, testMax)
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%s: Decode: %v, want a protocol violation mentioning %q", c.name, err, c.msg)
		}
		// The reader refuses on the header alone, without waiting for a
		// body that will never come and without allocating it.
		r := NewReader(bytes.NewReader(c.b), testMax)
		if _, err := r.Next(); !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: Next: %v, want a protocol violation", c.name, err)
		}
		if cap(r.buf) > len(c.b) {
			t.Errorf("%s: the reader allocated %d bytes", c.name, cap(r.buf))
		}
	}
}

func TestAppendPrefix(t *testing.T) {
	for _, f := range samples {
		whole := mustAppend(t, f)
		prefix, err := AppendPrefix(nil, f)
		if err != nil {
			t.Fatal(err)
		}
		if got := append(prefix, f.Data...); !bytes.Equal(got, whole) {
			t.Errorf("%s: prefix+data = %x, want %x", f.Type, got, whole)
		}
	}
}

func TestTruncatedStream(t *testing.T) {
	b := mustAppend(t, Frame{Type: TypeWrite, Data: make([]byte, 100)})
	for _, n := range []int{1, HeaderSize - 1, HeaderSize, len(b) - 1} {
		r := NewReader(bytes.NewReader(b[:n]), testMax)
		if _, err := r.Next(); err != io.ErrUnexpectedEOF {
			t.Errorf("%d of %d bytes: %v, want io.ErrUnexpectedEOF", n, len(b), err)
		}
	}
}

func TestAppendRefuses(t *testing.T) {
	for _, f := range []Frame{
		{Type: TypeHello, Path: strings.Repeat("a", MaxPath+1)},
		{Type: TypeHelloOK, MaxMessage: 0},
		{Type: TypeCompletion, Op: TypeHelloOK},
		{Type: 0x55},
	} {
		if b, err := Append([]byte("keep"), f); err == nil || string(b) != "keep" {
			t.Errorf("Append(%+v) = %q, %v; want an error and dst unchanged", f, b, err)
		}
	}
}

// FuzzDecode: no input panics or allocates past its limit, and whatever
// decodes encodes back to the same bytes (the format has one spelling per
// frame, so nothing is silently dropped).
func FuzzDecode(f *testing.F) {
	for _, s := range samples {
		f.Add(mustAppend(f, s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		fr, n, err := Decode(b, testMax)
		if err != nil {
			if err != ErrShort && !errors.Is(err, ErrProtocol) {
				t.Fatalf("Decode: unexpected error kind %v", err)
			}
			return
		}
		again, err := Append(nil, fr)
		if err != nil {
			t.Fatalf("Append of a decoded frame %+v: %v", fr, err)
		}
		if !bytes.Equal(again, b[:n]) {
			t.Fatalf("re-encoding differs:\n in %x\nout %x", b[:n], again)
		}
		// The stream reader agrees with Decode.
		r := NewReader(bytes.NewReader(b), testMax)
		fr2, err := r.Next()
		if err != nil || !reflect.DeepEqual(normal(fr), normal(fr2)) {
			t.Fatalf("Reader.Next = %+v, %v; Decode = %+v", fr2, err, fr)
		}
	})
}

// The first frame is read up to the largest HELLO: a header of another
// type, or of a longer HELLO, ends it before its body is read; a HELLO
// is read to its end and not a byte further.
func TestReadHello(t *testing.T) {
	hello := mustAppend(t, Frame{Type: TypeHello, Version: Version, Path: "/a", Token: [TokenSize]byte{9}})
	next := mustAppend(t, Frame{Type: TypeWrite, WRID: 1, IOVA: 8, RKey: 3, Data: []byte("pipelined")})
	r := bytes.NewReader(append(hello, next...))
	f, err := ReadHello(r)
	if err != nil || f.Type != TypeHello || f.Path != "/a" || f.Token[0] != 9 {
		t.Fatalf("ReadHello: %+v, %v", f, err)
	}
	if r.Len() != len(next) {
		t.Errorf("%d bytes left after the hello, want the %d of the next frame", r.Len(), len(next))
	}
	if f, err := NewReader(r, testMax).Next(); err != nil || string(f.Data) != "pipelined" {
		t.Errorf("the frame behind the hello: %+v, %v", f, err)
	}

	bigWrite := binary.BigEndian.AppendUint32([]byte{byte(TypeWrite), 0, 0, 0}, 16<<20)
	bigWrite = append(bigWrite, make([]byte, 8)...)
	bigHello := binary.BigEndian.AppendUint32([]byte{byte(TypeHello), 0, 0, 0}, uint32(MaxHelloFrame-HeaderSize+1))
	bigHello = append(bigHello, make([]byte, 8)...)
	for _, c := range []struct {
		name string
		in   []byte
		want error
	}{
		{"a WRITE of 16 MiB", append(bigWrite, make([]byte, 4096)...), ErrProtocol},
		{"a small READ", mustAppend(t, Frame{Type: TypeRead, Length: 1}), ErrProtocol},
		{"a HELLO past the largest", append(bigHello, make([]byte, 4096)...), ErrProtocol},
		{"not mrfs", []byte("GET / HTTP/1.1\r\n\r\n"), ErrProtocol},
		{"nothing", nil, io.EOF},
		{"half a header", hello[:7], io.ErrUnexpectedEOF},
		{"half a body", hello[:len(hello)-1], io.ErrUnexpectedEOF},
	} {
		r := bytes.NewReader(c.in)
		_, err := ReadHello(r)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
		if c.want == ErrProtocol && len(c.in)-r.Len() > HeaderSize {
			t.Errorf("%s: %d bytes read, want the header's %d alone", c.name, len(c.in)-r.Len(), HeaderSize)
		}
	}
	if _, err := ReadHello(bytes.NewReader(mustAppend(t, Frame{Type: TypeHello, Version: 1, Path: "/"}))); !errors.As(err, new(*VersionError)) {
		t.Errorf("a HELLO of version 1: %v, want a VersionError", err)
	}
}
