package buffer

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"mrfs/store"
)

// Each registered buffer is one memory mapping of the daemon, and the
// kernel allows a process vm.max_map_count of them (65530 by default).
// Past it every mmap fails, the Go runtime's own included: a daemon that
// maps buffers up to the limit dies ("runtime: out of memory") with every
// registration in it. So mappings are admitted like memory: a buffer that
// would leave the daemon fewer than a reserve of mappings for the runtime
// and its own needs is refused with ENOSPC, naming vm.max_map_count.
//
// The daemon counts its buffers' mappings itself. What else the process
// maps (heap arenas, thread stacks, libraries) is counted from
// /proc/self/maps now and then, streaming through a buffer made once, so
// that counting needs no memory at the edge; never at each mapping.
// Guarded by the Manager's mu (its "the mappings"), but buf while
// counting, which runs without it.
type mapCount struct {
	limit      int           // vm.max_map_count (0: unknown, no check)
	own        int           // buffers' mappings the manager holds
	other      int           // the process's other mappings at the last count
	since      int           // own mappings made since that count
	countedAt  time.Time     // when
	took       time.Duration // and how long that count took
	counting   bool          // a count is under way (it uses buf)
	buf        []byte
	reserveMin int // the reserve when not 0 (Options.MapReserve)
}

const (
	// mapRecount: the other mappings are counted again after this many
	// buffer mappings, as the runtime grows with the daemon, or after
	// 1/mapRecountShare of the mappings there are, whichever is more: a
	// count reads every line of /proc/self/maps (and holds the kernel's
	// mmap lock meanwhile), so a fixed interval made each buffer cost
	// O(buffers), and a million of them made at half the first pace.
	mapRecount      = 4096
	mapRecountShare = 16
	// mapNearEvery: within twice the reserve of the limit, they are
	// counted (and vm.max_map_count read) at most this often, and at most
	// 1/mapRecountShare of the time (a count of a million takes ~0.5 s).
	mapNearEvery = time.Second
)

func (c *mapCount) init() {
	c.buf = make([]byte, 64<<10)
	c.limit = maxMapCount()
	if n, err := countMaps(c.buf); err == nil {
		c.other, c.countedAt = n, now()
	}
}

// reserve is what the daemon leaves the runtime: 1/64 of the limit (1023
// of the default 65530), at least 256.
func (c *mapCount) reserve() int {
	if c.reserveMin > 0 {
		return c.reserveMin
	}
	return max(c.limit/64, 256)
}

func (c *mapCount) usedLocked() int { return c.own + c.other }

// headroom is how many more buffers may be mapped.
func (c *mapCount) headroom() int {
	if c.limit == 0 {
		return 1 << 30
	}
	return max(c.limit-c.reserve()-c.own-c.other, 0)
}

func (c *mapCount) due(t time.Time) bool {
	if c.counting {
		return false
	}
	return c.since >= max(mapRecount, c.usedLocked()/mapRecountShare) ||
		c.headroom() < c.reserve() && t.Sub(c.countedAt) >= max(mapNearEvery, mapRecountShare*c.took)
}

// mapFile maps the first n bytes of f for a buffer, if the mapping limit
// allows one more (ENOSPC naming vm.max_map_count otherwise).
func (m *Manager) mapFile(f store.File, n uint64) (mapping, error) {
	if err := m.reserveMaps(1); err != nil {
		return mapping{}, err
	}
	p, err := f.Map(n)
	if err != nil {
		m.unreserveMaps(1)
		return mapping{}, m.classifyFd(err)
	}
	return mapping{base: p, len: pageRound(n)}, nil
}

// reserveMaps counts n more mappings of the daemon's, if the limit
// allows them (ENOSPC naming vm.max_map_count otherwise).
func (m *Manager) reserveMaps(n int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.maps.due(now()) {
		m.maps.counting = true
		own := m.maps.own
		m.mu.Unlock()
		start := now()
		total, err := countMaps(m.maps.buf)
		limit := maxMapCount()
		m.mu.Lock()
		m.maps.counting = false
		if err == nil {
			t := now()
			m.maps.other, m.maps.since, m.maps.countedAt, m.maps.took = max(total-own, 0), 0, t, t.Sub(start)
		}
		if limit > 0 {
			m.maps.limit = limit
		}
	}
	if m.maps.headroom() < n {
		c := &m.maps
		return m.refuseLocked(limitMaxMapCount, syscall.ENOSPC,
			fmt.Sprintf("vm.max_map_count (%d) reached", c.limit),
			fmt.Sprintf("cannot map %d more: the daemon has %d mappings, %d of them buffers and pool slots, and keeps %d of vm.max_map_count (%d) for itself; each registered buffer and each pool slot is one mapping: raise it with `sysctl vm.max_map_count=%d`, or hold fewer buffers",
				n, c.usedLocked(), c.own, c.reserve(), c.limit, 2*c.limit),
			"value", c.limit, "mappings", c.usedLocked())
	}
	m.maps.own += n
	m.maps.since += n
	return nil
}

// unreserveMaps gives back n mappings' count.
func (m *Manager) unreserveMaps(n int) {
	m.mu.Lock()
	m.maps.own -= n
	m.mu.Unlock()
}

// unmap drops a buffer's mapping and its count.
func (m *Manager) unmap(mp *mapping) {
	if mp.base == nil {
		return
	}
	if err := mp.unmap(); err != nil {
		m.log.Error("leaking a buffer mapping", "err", err)
		*mp = mapping{}
		return // it still counts: it is still there
	}
	m.unreserveMaps(1)
}

// MapHeadroom is how many buffers the daemon could map now, with what the
// process maps already and the reserve it keeps (0: the default): what
// max_buffers' default must not exceed. ok is false when vm.max_map_count
// cannot be read.
func MapHeadroom(reserve int) (n int, ok bool) {
	var c mapCount
	c.init()
	c.reserveMin = reserve
	return c.headroom(), c.limit > 0
}

func maxMapCount() int {
	b, err := os.ReadFile("/proc/sys/vm/max_map_count")
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// countMaps counts the process's mappings (the lines of /proc/self/maps)
// through buf, allocating nothing.
func countMaps(buf []byte) (int, error) {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n := 0
	for {
		k, err := f.Read(buf)
		n += bytes.Count(buf[:k], []byte{'\n'})
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return 0, err
		}
	}
}
