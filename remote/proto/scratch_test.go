package proto

import (
	"bytes"
	"testing"
)

// A WRITE body and a later READ result share one buffer: a connection
// never holds two of max size.
func TestScratchSharesTheBodyBuffer(t *testing.T) {
	const max = 1 << 16
	data := bytes.Repeat([]byte{7}, max)
	wire, err := Append(nil, Frame{Type: TypeWrite, WRID: 1, IOVA: 0x1000, RKey: 0x100, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	r := NewReader(bytes.NewReader(wire), max)
	f, err := r.Next()
	if err != nil || len(f.Data) != max {
		t.Fatalf("Next: %v, %d bytes", err, len(f.Data))
	}
	s := r.Scratch(max)
	// The WRITE body is iova, rkey and reserved (16 bytes), then the data.
	if &s[16] != &f.Data[0] {
		t.Error("Scratch allocated a second buffer instead of reusing the body's")
	}
	if got := r.Scratch(max / 2); cap(got) != cap(s) {
		t.Errorf("a smaller Scratch reallocated: cap %d, want %d", cap(got), cap(s))
	}
}
