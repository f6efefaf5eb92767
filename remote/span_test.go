package remote

import (
	"errors"
	"reflect"
	"syscall"
	"testing"
)

func TestSpan(t *testing.T) {
	regions := []Region{{Addr: 0x1000, Length: 0x100, RKey: 1}, {Addr: 0x1100, Length: 0x100, RKey: 2}, {Addr: 0x1200, Length: 0x80, RKey: 3}}
	for _, c := range []struct {
		name         string
		addr, length uint64
		max          uint32
		want         []Piece
	}{
		{"inside one region", 0x1010, 0x20, 0x1000, []Piece{{0x1010, 0x20, 1, 0}}},
		{"across a boundary", 0x10f0, 0x20, 0x1000, []Piece{{0x10f0, 0x10, 1, 0}, {0x1100, 0x10, 2, 0x10}}},
		{"all three", 0x1000, 0x280, 0x1000, []Piece{{0x1000, 0x100, 1, 0}, {0x1100, 0x100, 2, 0x100}, {0x1200, 0x80, 3, 0x200}}},
		{"past the message size", 0x1000, 0x110, 0x80, []Piece{{0x1000, 0x80, 1, 0}, {0x1080, 0x80, 1, 0x80}, {0x1100, 0x10, 2, 0x100}}},
		{"nothing", 0x1000, 0, 0x80, nil},
	} {
		got, err := Span(regions, c.addr, c.length, c.max)
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %v, %v; want %v", c.name, got, err, c.want)
		}
	}
	for _, c := range []struct{ addr, length uint64 }{{0xfff, 2}, {0x1270, 0x20}, {0x5000, 1}} {
		if _, err := Span(regions, c.addr, c.length, 0x1000); !errors.Is(err, syscall.ERANGE) {
			t.Errorf("[0x%x, +0x%x) outside the regions: %v, want ERANGE", c.addr, c.length, err)
		}
	}
	if r, err := RegionAt(regions, 0x11f8); err != nil || r.RKey != 2 {
		t.Errorf("RegionAt 0x11f8: %+v, %v", r, err)
	}
}
