package config

import (
	"fmt"
	"strconv"
	"strings"
)

// Budget is buffers.max_pinned: bytes (a Size), or a percentage of the
// memory the daemon may use ("50%"), resolved at mount by Resolve. The
// zero value is 0 bytes: no budget.
type Budget struct {
	Bytes   Size
	Percent float64 // in (0, 100] when set; Bytes is then unused
}

// ParseBudget reads "50%", "12.5%", or a size ("1GiB", "4096", "0").
func ParseBudget(s string) (Budget, error) {
	t := strings.TrimSpace(s)
	if p, ok := strings.CutSuffix(t, "%"); ok {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || v <= 0 || v > 100 {
			return Budget{}, fmt.Errorf("invalid percentage %q: want more than 0%% and at most 100%%, e.g. \"50%%\"", s)
		}
		return Budget{Percent: v}, nil
	}
	n, err := ParseSize(t)
	if err != nil {
		return Budget{}, fmt.Errorf("%w, or a percentage such as \"50%%\"", err)
	}
	return Budget{Bytes: n}, nil
}

// Resolve is the budget in bytes on a machine where the daemon may use
// limit bytes, rounded down to whole pages of pageSize.
func (b Budget) Resolve(limit, pageSize uint64) uint64 {
	if b.Percent == 0 {
		return uint64(b.Bytes)
	}
	n := uint64(float64(limit) * b.Percent / 100)
	return n &^ (pageSize - 1)
}

// String is the form config.toml takes.
func (b Budget) String() string {
	if b.Percent != 0 {
		return strconv.FormatFloat(b.Percent, 'f', -1, 64) + "%"
	}
	t, _ := b.Bytes.MarshalText()
	return string(t)
}

// UnmarshalTOML takes a TOML integer of bytes or a string: a size or a
// percentage.
func (b *Budget) UnmarshalTOML(v any) error {
	switch v := v.(type) {
	case int64:
		var s Size
		if err := s.UnmarshalTOML(v); err != nil {
			return err
		}
		*b = Budget{Bytes: s}
		return nil
	case string:
		p, err := ParseBudget(v)
		if err != nil {
			return err
		}
		*b = p
		return nil
	default:
		return fmt.Errorf("invalid size: got a TOML %s, want an integer of bytes or a string such as \"1GiB\" or \"50%%\"", tomlType(v))
	}
}
