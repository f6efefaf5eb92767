package buffer

import (
	"context"
	"fmt"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/internal/bytesize"
	"mrfs/store"
)

// A pool file's buffer (b.slot set) is a slot of its pool: its size is
// the slot size, always; its registration is its chunk's; it holds no
// charge of its own (the pool's holder pays for every slot). The Buffer
// methods branch here for it.

// createSlot makes a buffer of p's next free slot, owned by owner: no
// allocation, no registration. ENOSPC naming the pool when it is full.
func (m *Manager) createSlot(p *Pool, owner uint32) (*Buffer, error) {
	b := &Buffer{m: m, dom: p.d, owner: owner}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := m.reserveBuffer(b, p.d, owner, 0); err != nil {
		return nil, fmt.Errorf("create a pool file in pd %d: %w", p.d.handle, err)
	}
	i, err := p.take()
	if err != nil {
		b.abandonLocked()
		return nil, fmt.Errorf("create a pool file: %w", err)
	}
	p.mu.Lock()
	addr, _ := p.addrLocked(i)
	p.mu.Unlock()
	b.slot = &slotRef{p: p, i: i, addr: addr}
	b.f = slotFile{b.slot}
	b.size = p.slot
	return b, nil
}

// slotInfoLocked is Info for a slot: its chunk's keys at its address.
func (b *Buffer) slotInfoLocked(in *Info) {
	s := b.slot
	p := s.p
	p.mu.Lock()
	defer p.mu.Unlock()
	in.Access = p.access
	in.Pool = &SlotInfo{Index: s.i, Size: p.slot}
	if b.gone != alive {
		return
	}
	if r := b.slotRegionLocked(); r != nil {
		in.State, in.Length, in.Regions = Registered, p.slot, 1
		in.LKey, in.RKey, in.Addr = r.LKey, r.RKey, uintptr(s.addr)
	}
}

// slotRegionLocked is the region of the slot's chunk that holds it.
// Callers hold the pool's mu.
func (b *Buffer) slotRegionLocked() *Region {
	s := b.slot
	_, c := s.p.addrLocked(s.i)
	if c == nil {
		return nil
	}
	a := uintptr(s.addr)
	for _, r := range c.regs.list() {
		if a >= r.Addr && a < r.Addr+uintptr(r.Length) {
			return &r
		}
	}
	return nil
}

// slotRegionsLocked is Regions for a slot: its chunk's region.
// Callers hold b.mu.
func (b *Buffer) slotRegionsLocked() []Region {
	b.slot.p.mu.Lock()
	defer b.slot.p.mu.Unlock()
	if r := b.slotRegionLocked(); r != nil && b.gone == alive {
		return []Region{*r}
	}
	return nil
}

// errSize answers a change of a pool file's size.
func (s *slotRef) errSize(size uint64) error {
	return fmt.Errorf("a pool file's size is its pool's slot size (%s), not %s: %w",
		bytesize.Format(s.p.slot), bytesize.Format(size), syscall.EINVAL)
}

// InPool says whether b is a pool file's.
func (b *Buffer) InPool() bool { return b.slot != nil }

// Clear is what O_TRUNC does to the file: a pool file's slot is zeroed
// (its size stays the slot size), any other file is resized to 0.
func (b *Buffer) Clear(ctx context.Context) error {
	if b.slot == nil {
		return b.Resize(ctx, 0)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gone != alive {
		return fmt.Errorf("truncate: %w", b.gone.err())
	}
	clear(unsafe.Slice((*byte)(b.slot.addr), b.slot.p.slot))
	return nil
}

// slotFile is a slot as the buffer's store.File: the slot's own sealed
// memfd, reached through the daemon's mapping of it.
type slotFile struct{ s *slotRef }

var _ store.File = slotFile{}

// Stat: the slot size; no memory held of its own (the pool is charged).
func (f slotFile) Stat() (size, held uint64, err error) { return f.s.p.slot, 0, nil }

func (f slotFile) Truncate(size uint64) error {
	if size != f.s.p.slot {
		return f.s.errSize(size)
	}
	return nil
}

// Allocate: every page of a slot exists and is registered; a hole
// punched would leave the registration on pages the file no longer has,
// and a size past the slot is not one.
func (f slotFile) Allocate(mode uint32, off, length uint64) error {
	switch {
	case mode&(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_COLLAPSE_RANGE|unix.FALLOC_FL_INSERT_RANGE|unix.FALLOC_FL_ZERO_RANGE) != 0:
		return fmt.Errorf("fallocate mode 0x%x on a pool file: its pages are its pool's registration: %w", mode, syscall.EPERM)
	case off+length > f.s.p.slot && mode&unix.FALLOC_FL_KEEP_SIZE == 0:
		return fmt.Errorf("fallocate to %s: %w", bytesize.Format(off+length), f.s.errSize(off+length))
	}
	return nil
}

func (f slotFile) Map(uint64) (unsafe.Pointer, error) {
	return nil, fmt.Errorf("a pool slot is mapped by its pool: %w", syscall.EINVAL)
}

// Open reopens the slot's memfd through the daemon's mapping of it (the
// daemon keeps no descriptor per slot); the seals hold for every open.
func (f slotFile) Open() (int, error) {
	a := uintptr(f.s.addr)
	path := fmt.Sprintf("/proc/self/map_files/%x-%x", a, a+uintptr(f.s.p.slot))
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open a pool slot (%s): %w", path, err)
	}
	return fd, nil
}

func (f slotFile) mem() []byte { return unsafe.Slice((*byte)(f.s.addr), f.s.p.slot) }

func (f slotFile) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("read at %d: %w", off, syscall.EINVAL)
	}
	if uint64(off) >= f.s.p.slot {
		return 0, nil
	}
	return copy(p, f.mem()[off:]), nil
}

// WriteAt writes what fits in the slot; a write that starts at or past
// its end fails (EFBIG), as one past a file size limit does.
func (f slotFile) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("write at %d: %w", off, syscall.EINVAL)
	}
	if len(p) > 0 && uint64(off) >= f.s.p.slot {
		return 0, fmt.Errorf("write at %d: past the pool's slot size (%s): %w", off, bytesize.Format(f.s.p.slot), syscall.EFBIG)
	}
	return copy(f.mem()[off:], p), nil
}

func (f slotFile) Holes(from, to uint64) (uint64, error) { return 0, nil }
func (f slotFile) Remove() error                         { return nil }
