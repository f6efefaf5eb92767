package remote

import (
	"fmt"
	"syscall"
)

// Region is one memory region of a buffer as a peer reaches it: a buffer
// larger than its device's max_mr_size is registered as several
// consecutive regions (user.mrfs.desc lists them), and one operation
// names one region's key, as on a NIC.
type Region struct {
	Addr, Length uint64
	RKey         uint32
}

// Piece is the part of a range that one operation moves: its address and
// key, and where it sits in the caller's bytes.
type Piece struct {
	Addr   uint64
	Length uint32
	RKey   uint32
	Off    uint64 // offset in the caller's buffer
}

// Span splits the range [addr, addr+length) over regions, and each part
// further into pieces of at most maxMessage bytes. A byte of the range
// that no region holds is an error (ERANGE): the peer would answer
// IBV_WC_REM_ACCESS_ERR for it.
func Span(regions []Region, addr, length uint64, maxMessage uint32) ([]Piece, error) {
	if maxMessage == 0 {
		return nil, fmt.Errorf("span: a path that carries no bytes: %w", syscall.EINVAL)
	}
	var out []Piece
	for done := uint64(0); done < length; {
		at := addr + done
		r, err := RegionAt(regions, at)
		if err != nil {
			return nil, fmt.Errorf("span: %w", err)
		}
		n := min(length-done, r.Addr+r.Length-at, uint64(maxMessage))
		out = append(out, Piece{Addr: at, Length: uint32(n), RKey: r.RKey, Off: done})
		done += n
	}
	return out, nil
}

// ReadSpan reads len(dst) bytes at addr through c, one READ per piece of
// Span (so across regions and past the path's message size).
func ReadSpan(c Conn, dst []byte, addr uint64, regions []Region) error {
	pieces, err := Span(regions, addr, uint64(len(dst)), c.MaxMessage())
	if err != nil {
		return err
	}
	for _, p := range pieces {
		if err := c.Read(dst[p.Off:p.Off+uint64(p.Length)], p.Addr, p.RKey); err != nil {
			return err
		}
	}
	return nil
}

// WriteSpan writes src at addr through c, one WRITE per piece of Span.
func WriteSpan(c Conn, addr uint64, regions []Region, src []byte) error {
	pieces, err := Span(regions, addr, uint64(len(src)), c.MaxMessage())
	if err != nil {
		return err
	}
	for _, p := range pieces {
		if err := c.Write(p.Addr, p.RKey, src[p.Off:p.Off+uint64(p.Length)]); err != nil {
			return err
		}
	}
	return nil
}

// RegionAt is the region that holds addr, for an atomic operation (eight
// aligned bytes never cross a region: regions start on page boundaries).
func RegionAt(regions []Region, addr uint64) (Region, error) {
	for _, r := range regions {
		if addr >= r.Addr && addr-r.Addr < r.Length {
			return r, nil
		}
	}
	return Region{}, fmt.Errorf("address 0x%x is in no region of the buffer: %w", addr, syscall.ERANGE)
}
