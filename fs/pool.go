package fs

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"

	"mrfs/buffer"
	"mrfs/internal/config"
	"mrfs/store"
)

// xattrPool is a pool directory's shape (DESIGN "Pools"): set
// "slot=SIZE,slots=N" on an empty directory to make it a pool, or
// "slots=N" on a pool to grow or shrink it; read
// "slot=SIZE,slots=N,used=K,chunks=C".
const xattrPool = xattrPrefix + "pool"

// poolSpec is a value set on xattrPool; slot 0 when not given.
type poolSpec struct {
	slot  uint64
	slots int
}

func parsePoolSpec(v string) (poolSpec, error) {
	var s poolSpec
	seen := false
	for _, kv := range strings.Split(strings.TrimSpace(v), ",") {
		k, val, ok := strings.Cut(strings.TrimSpace(kv), "=")
		switch {
		case !ok:
			return s, fmt.Errorf("pool %q: want slot=SIZE,slots=N: %w", v, syscall.EINVAL)
		case k == "slot":
			n, err := config.ParseSize(val)
			if err != nil || n == 0 {
				return s, fmt.Errorf("pool slot %q: want a size such as 1MiB: %w", val, syscall.EINVAL)
			}
			s.slot = uint64(n)
		case k == "slots":
			n, err := strconv.Atoi(strings.TrimSpace(val))
			if err != nil || n <= 0 {
				return s, fmt.Errorf("pool slots %q: want a whole number above 0: %w", val, syscall.EINVAL)
			}
			s.slots, seen = n, true
		case k == "used" || k == "chunks":
			// What a read gives back: a value read and set again works.
		default:
			return s, fmt.Errorf("pool: unknown key %q; want slot=SIZE,slots=N: %w", k, syscall.EINVAL)
		}
	}
	if !seen {
		return s, fmt.Errorf("pool %q: slots=N is missing: %w", v, syscall.EINVAL)
	}
	return s, nil
}

// poolString is what xattrPool reads.
func poolString(in buffer.PoolInfo) string {
	return fmt.Sprintf("slot=%s,slots=%d,used=%d,chunks=%d", compactSize(in.Slot), in.Slots, in.Used, in.Chunks)
}

// compactSize writes n as config sizes are written ("1MiB"), which
// ParseSize reads back.
func compactSize(n uint64) string {
	b, _ := config.Size(n).MarshalText()
	return string(b)
}

// setPool makes the directory a pool charged to uid, or changes its slots.
func (n *dirNode) setPool(v string, uid uint32) error {
	s, err := parsePoolSpec(v)
	if err != nil {
		return err
	}
	if p := n.dir.Domain().Pool(); p != nil {
		if have := p.Info().Slot; s.slot != 0 && store.PageRound(s.slot) != have {
			return fmt.Errorf("a pool's slot size (%s) cannot change; make another pool: %w", compactSize(have), syscall.EINVAL)
		}
		return p.SetSlots(s.slots, uid)
	}
	if s.slot == 0 {
		return fmt.Errorf("pool %q: slot=SIZE is missing: %w", v, syscall.EINVAL)
	}
	_, err = n.dir.MakePool(s.slot, s.slots, uid)
	return err
}
