package config

import (
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	good := []struct {
		in   string
		want Size
	}{
		{"0", 0},
		{"4096", 4096},
		{"  4096 ", 4096},
		{"64KiB", 65536},
		{"64 KiB", 65536},
		{"64kib", 65536},
		{"1MiB", 1 << 20},
		{"1GiB", 1 << 30},
		{"2TiB", 2 << 40},
		{"1PiB", 1 << 50},
		{"15EiB", 15 << 60},
		{"512B", 512},
		{"18446744073709551615", 1<<64 - 1},
	}
	for _, c := range good {
		got, err := ParseSize(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	bad := []struct{ in, msg string }{
		{"", "whole number"},
		{"KiB", "whole number"},
		{"-1", "whole number"},
		{"+1", "whole number"},
		{"0x10", "unknown unit"},
		{"64KB", "ambiguous"},
		{"64k", "ambiguous"},
		{"1G", "ambiguous"},
		{"1.5MiB", "fractions"},
		{"64 bytes", "unknown unit"},
		{"64KiB extra", "unknown unit"},
		{"16EiB", "too large"},
		{"18446744073709551616", "too large"},
		{"99999999999999999999999", "too large"},
	}
	for _, c := range bad {
		got, err := ParseSize(c.in)
		if err == nil || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("ParseSize(%q) = %d, %v; want an error about %q", c.in, got, err, c.msg)
		}
	}
}

func TestSizeString(t *testing.T) {
	cases := []struct {
		in   uint64
		want string
	}{
		{0, "0 B"},
		{512, "512 B"},
		{1023, "1023 B"},
		{1024, "1 KiB"},
		{65536, "64 KiB"},
		{64 << 20, "64 MiB"},
		{8 << 20, "8 MiB"},
		{3 << 19, "1.5 MiB"},
		{100000, "97.7 KiB"},
		{1<<20 - 1, "1048575 B"},
		{1 << 30, "1 GiB"},
		{1<<64 - 1, "18446744073709551615 B"},
	}
	for _, c := range cases {
		if got := Size(c.in).String(); got != c.want {
			t.Errorf("Size(%d).String() = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestSizeTextRoundTrip(t *testing.T) {
	for _, n := range []Size{0, 1, 4097, 4096, 65536, 3 << 19, 1 << 30, 1<<64 - 1, 15 << 60} {
		text, err := n.MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		var back Size
		if err := back.UnmarshalText(text); err != nil || back != n {
			t.Errorf("%d -> %q -> %d, %v", n, text, back, err)
		}
	}
	if text, _ := Size(65536).MarshalText(); string(text) != "64KiB" {
		t.Errorf("MarshalText(65536) = %q, want 64KiB", text)
	}
}
