package config

import (
	"fmt"
	"math"
	"mrfs/internal/bytesize"
	"strconv"
	"strings"
)

// Size is a byte count. In config.toml it is an integer of bytes or a
// string with a binary unit ("64KiB"); see the package documentation.
type Size uint64

var sizeUnits = []struct {
	name  string
	bytes uint64
}{
	{"B", 1},
	{"KiB", 1 << 10},
	{"MiB", 1 << 20},
	{"GiB", 1 << 30},
	{"TiB", 1 << 40},
	{"PiB", 1 << 50},
	{"EiB", 1 << 60},
}

// ParseSize reads "4096", "64KiB", "64 KiB", "1gib": a whole number and an
// optional binary unit. Decimal (KB, MB) and bare (K, M) units, fractions,
// signs and values past 2^64-1 bytes are errors.
func ParseSize(s string) (Size, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && t[i] >= '0' && t[i] <= '9' {
		i++
	}
	num, unit := t[:i], strings.TrimSpace(t[i:])
	if num == "" {
		return 0, fmt.Errorf("invalid size %q: want a whole number of bytes, optionally with a unit (B, KiB, MiB, GiB, TiB), e.g. \"64KiB\"", s)
	}
	if strings.HasPrefix(unit, ".") || strings.HasPrefix(unit, ",") {
		return 0, fmt.Errorf("invalid size %q: fractions are not accepted; write a whole number of a smaller unit (\"1536KiB\", not \"1.5MiB\")", s)
	}
	mult := uint64(0)
	if unit == "" {
		mult = 1
	}
	for _, u := range sizeUnits {
		if unit != "" && strings.EqualFold(unit, u.name) {
			mult = u.bytes
		}
	}
	if mult == 0 {
		if ambiguousUnit(unit) {
			return 0, fmt.Errorf("invalid size %q: unit %q is ambiguous (1000 or 1024?); write \"%s%siB\" for powers of 1024, or the number of bytes", s, unit, num, strings.ToUpper(unit[:1]))
		}
		return 0, fmt.Errorf("invalid size %q: unknown unit %q; use B, KiB, MiB, GiB, TiB, PiB or EiB", s, unit)
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil || n > math.MaxUint64/mult {
		return 0, fmt.Errorf("invalid size %q: too large (the limit is 2^64-1 bytes)", s)
	}
	return Size(n * mult), nil
}

// ambiguousUnit reports the SI-looking units that people use for both
// powers of 1000 and powers of 1024.
func ambiguousUnit(u string) bool {
	switch strings.ToUpper(u) {
	case "K", "M", "G", "T", "P", "E", "KB", "MB", "GB", "TB", "PB", "EB":
		return true
	}
	return false
}

// String is the size for people (bytesize.Format).
func (s Size) String() string { return bytesize.Format(uint64(s)) }

// MarshalText writes the exact size in the largest unit that divides it
// ("64KiB", "4097"), which ParseSize reads back unchanged.
func (s Size) MarshalText() ([]byte, error) {
	n := uint64(s)
	for u := len(sizeUnits) - 1; u > 0; u-- {
		if n != 0 && n%sizeUnits[u].bytes == 0 {
			return fmt.Appendf(nil, "%d%s", n/sizeUnits[u].bytes, sizeUnits[u].name), nil
		}
	}
	return strconv.AppendUint(nil, n, 10), nil
}

// UnmarshalText is ParseSize, for flags and other text sources.
func (s *Size) UnmarshalText(text []byte) error {
	v, err := ParseSize(string(text))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// UnmarshalTOML takes a TOML integer of bytes or a size string. It is
// preferred over UnmarshalText by the decoder, and lets floats, booleans
// and negative integers be refused with a precise message.
func (s *Size) UnmarshalTOML(v any) error {
	switch v := v.(type) {
	case int64:
		if v < 0 {
			return fmt.Errorf("invalid size %d: must not be negative", v)
		}
		*s = Size(v)
		return nil
	case string:
		return s.UnmarshalText([]byte(v))
	default:
		return fmt.Errorf("invalid size: got a TOML %s, want an integer of bytes or a string such as \"64KiB\"", tomlType(v))
	}
}
