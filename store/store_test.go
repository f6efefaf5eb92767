package store

import (
	"bytes"
	"errors"
	"os"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func stores(t *testing.T) map[string]func(*testing.T, TmpfsOptions) Store {
	t.Helper()
	m := map[string]func(*testing.T, TmpfsOptions) Store{
		"memfd": func(*testing.T, TmpfsOptions) Store { return NewMemfd() },
	}
	if os.Geteuid() == 0 {
		m["tmpfs"] = func(t *testing.T, opt TmpfsOptions) Store {
			s, err := NewTmpfs(opt)
			if err != nil {
				t.Fatalf("NewTmpfs as root: %v", err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}
	} else {
		t.Log("not root: the tmpfs store (fsopen needs CAP_SYS_ADMIN) is not tested")
	}
	return m
}

func bytesAt(p unsafe.Pointer, n int) []byte { return unsafe.Slice((*byte)(p), n) }

// Every store: sizes, mappings that share pages with descriptors, and a
// removed file that lives on in what was opened or mapped before.
func TestFileLifecycle(t *testing.T) {
	for name, mk := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := mk(t, TmpfsOptions{Size: 16 << 20, Files: 4, Huge: "never"})
			if s.Kind() != name {
				t.Errorf("Kind %q", s.Kind())
			}
			f, err := s.Create(1)
			if err != nil {
				t.Fatal(err)
			}
			if size, held, err := f.Stat(); err != nil || size != 0 || held != 0 {
				t.Fatalf("new file: %d %d %v", size, held, err)
			}
			if err := f.Truncate(3 * 4096); err != nil {
				t.Fatal(err)
			}
			if size, held, _ := f.Stat(); size != 3*4096 || held != 0 {
				t.Errorf("after truncate: size %d held %d, want a sparse 12288", size, held)
			}
			p, err := f.Map(3 * 4096)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.MunmapPtr(p, 3*4096)
			copy(bytesAt(p, 5), "hello")
			got := make([]byte, 5)
			if n, err := f.ReadAt(got, 0); err != nil || n != 5 || string(got) != "hello" {
				t.Errorf("ReadAt after a store through the mapping: %q %d %v", got, n, err)
			}
			if _, err := f.WriteAt([]byte("world"), 4096); err != nil {
				t.Fatal(err)
			}
			if string(bytesAt(unsafe.Add(p, 4096), 5)) != "world" {
				t.Error("the mapping does not see WriteAt")
			}
			if _, held, _ := f.Stat(); held != 2*4096 {
				t.Errorf("held %d after touching two pages", held)
			}
			fd, err := f.Open()
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			if err := f.Allocate(0, 0, 5*4096); err != nil {
				t.Fatal(err)
			}
			if size, _, _ := f.Stat(); size != 5*4096 {
				t.Errorf("size %d after fallocate to 5 pages", size)
			}
			if err := f.Remove(); err != nil {
				t.Fatal(err)
			}
			if !errors.Is(f.Remove(), syscall.ENOENT) {
				t.Error("a second Remove succeeded")
			}
			if _, _, err := f.Stat(); !errors.Is(err, syscall.ENOENT) {
				t.Errorf("Stat after Remove: %v", err)
			}
			if _, err := f.Open(); !errors.Is(err, syscall.ENOENT) {
				t.Errorf("Open after Remove: %v", err)
			}
			// What was opened and mapped before still holds the memory.
			b := make([]byte, 5)
			if _, err := unix.Pread(fd, b, 4096); err != nil || string(b) != "world" {
				t.Errorf("an open descriptor after Remove: %q %v", b, err)
			}
			if !bytes.Equal(bytesAt(p, 5), []byte("hello")) {
				t.Error("the mapping lost its bytes after Remove")
			}
		})
	}
}

// Holes counts what filling a range would add, in pages; Grain is what
// one page may take.
func TestHolesAndGrain(t *testing.T) {
	for name, mk := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := mk(t, TmpfsOptions{Size: 16 << 20, Huge: "never"})
			if g, pastEnd := s.Grain(); g != 4096 || pastEnd {
				t.Errorf("Grain %d, %v without huge pages, want 4096", g, pastEnd)
			}
			f, _ := s.Create(1)
			f.Truncate(10 * 4096)
			f.WriteAt([]byte{1}, 2*4096+5)
			f.WriteAt([]byte{1}, 7*4096)
			check := func(from, to, want uint64) {
				t.Helper()
				if got, err := f.Holes(from, to); err != nil || got != want {
					t.Errorf("Holes(%d, %d) = %d, %v; want %d", from, to, got, err, want)
				}
			}
			for _, c := range []struct{ from, to, want uint64 }{
				{0, 10 * 4096, 8 * 4096},
				{2 * 4096, 3 * 4096, 0},
				{2*4096 + 100, 3*4096 - 1, 0}, // within the page that holds data
				{0, 4096 + 1, 2 * 4096},       // a partial page counts whole
				{3 * 4096, 7 * 4096, 4 * 4096},
				{8 * 4096, 10 * 4096, 2 * 4096},
				{10 * 4096, 16 * 4096, 6 * 4096}, // past the end: nothing there yet
			} {
				check(c.from, c.to, c.want)
			}
			// Pages past the end (fallocate with KEEP_SIZE) are seen too.
			if err := f.Allocate(unix.FALLOC_FL_KEEP_SIZE, 12*4096, 2*4096); err != nil {
				t.Fatal(err)
			}
			check(10*4096, 16*4096, 4*4096)
			check(0, 16*4096, 12*4096)
			check(12*4096, 14*4096, 0)
		})
	}
	if os.Geteuid() == 0 {
		for huge, pastEnd := range map[string]bool{"always": true, "within_size": false} {
			s, err := NewTmpfs(TmpfsOptions{Size: 16 << 20, Huge: huge})
			if err != nil {
				t.Fatal(err)
			}
			if g, p := s.Grain(); g != hugeSize() || p != pastEnd {
				t.Errorf("Grain %d, %v with huge=%s, want %d, %v", g, p, huge, hugeSize(), pastEnd)
			}
			s.Close()
		}
	}
}

// The instance's size bounds what files hold, at the call that would
// pass it; a sparse size does not count.
func TestTmpfsBounds(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	s, err := NewTmpfs(TmpfsOptions{Size: 1 << 20, Files: 2, Huge: "never"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	f, _ := s.Create(1)
	if err := f.Truncate(1 << 30); err != nil {
		t.Fatalf("a sparse size past the instance's: %v", err)
	}
	if err := f.Allocate(0, 0, 2<<20); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("fallocate past the size: %v, want ENOSPC", err)
	}
	// A write that crosses the size is short; the next one is ENOSPC.
	n, err := f.WriteAt(make([]byte, 2<<20), 0)
	if err != nil || n == 0 || n > 1<<20 {
		t.Errorf("write across the size: %d, %v; want a short write", n, err)
	}
	if _, err := f.WriteAt([]byte{1}, int64(n)); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("write past the size: %v, want ENOSPC", err)
	}
	used, size, ok := s.Usage()
	if !ok || size != 1<<20 || used > size {
		t.Errorf("Usage %d of %d (%v)", used, size, ok)
	}
	// nr_inodes: two files fit, a third is ENOSPC.
	if _, err := s.Create(2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create(3); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("a file past Files: %v, want ENOSPC", err)
	}
	if _, err := s.Create(2); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("creating an existing id: %v, want EEXIST", err)
	}
}

// huge=always gives 2 MiB pages whatever the machine's shmem_enabled.
func TestTmpfsHuge(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	for _, c := range []struct {
		huge string
		want uint64
	}{{"never", 4096}, {"always", hugeSize()}} {
		s, err := NewTmpfs(TmpfsOptions{Size: 64 << 20, Huge: c.huge})
		if err != nil {
			t.Fatal(err)
		}
		f, _ := s.Create(1)
		f.Truncate(4 << 20)
		p, err := f.Map(4 << 20)
		if err != nil {
			t.Fatal(err)
		}
		bytesAt(p, 1)[0] = 1
		got, ok := PageSizeAt(p)
		if !ok || got != c.want {
			t.Errorf("huge=%s: page size %d (%v), want %d", c.huge, got, ok, c.want)
		}
		unix.MunmapPtr(p, 4<<20)
		s.Close()
	}
}

// A memfd's pages are huge as the kernel's shmem_enabled says: admission
// must count what a huge page may take, past the end of file too for
// always and force.
func TestShmemGrain(t *testing.T) {
	huge := hugeSize()
	for _, c := range []struct {
		setting string
		size    uint64
		pastEnd bool
	}{
		{"always within_size advise [never] deny force\n", pageSize, false},
		{"[always] within_size advise never deny force\n", huge, true},
		{"always [within_size] advise never deny force\n", huge, false},
		{"always within_size [advise] never deny force\n", pageSize, false},
		{"always within_size advise never deny [force]\n", huge, true},
		{"always within_size advise never [deny] force\n", pageSize, false},
		{"", pageSize, false},
	} {
		if size, past := shmemGrain(c.setting); size != c.size || past != c.pastEnd {
			t.Errorf("%q: grain %d, past the end %v; want %d, %v", c.setting, size, past, c.size, c.pastEnd)
		}
	}
}

// Reserve lowers the instance's own bound, refuses what its files
// already hold (ENOSPC), and Unreserve gives the room back; a sealed
// file never grows or shrinks.
func TestReserve(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	s, err := NewTmpfs(TmpfsOptions{Size: 4 << 20, Huge: "never"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	r := s.(Reserver)
	f, _ := s.Create(1)
	if err := f.Allocate(0, 0, 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := r.Reserve(1 << 20); err != nil {
		t.Fatalf("reserve 1 MiB of 4 with 2 held: %v", err)
	}
	if _, size, _ := s.Usage(); size != 3<<20 {
		t.Errorf("size after reserving 1 MiB: %d, want 3 MiB", size)
	}
	if err := r.Reserve(2 << 20); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("reserving what the files hold: %v, want ENOSPC", err)
	}
	if err := f.Allocate(0, 0, 3<<20+4096); !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("fallocate past the lowered bound: %v, want ENOSPC", err)
	}
	r.Unreserve(1 << 20)
	if _, size, _ := s.Usage(); size != 4<<20 {
		t.Errorf("size after giving it back: %d, want 4 MiB", size)
	}

	fd, err := NewSealed(64 << 10)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 128<<10); !errors.Is(err, syscall.EPERM) {
		t.Errorf("growing a sealed file: %v, want EPERM", err)
	}
	if _, err := unix.Pwrite(fd, []byte{1}, 64<<10); !errors.Is(err, syscall.EPERM) {
		t.Errorf("writing past a sealed file's end: %v, want EPERM", err)
	}
}

// A store handed over keeps its files after the process that made it
// lets go: the adopting one opens the files by id; what was reserved (for
// pools, which no restart takes back) is given back.
func TestTmpfsHandover(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	opt := TmpfsOptions{Size: 4 << 20, Huge: "never"}
	s, err := NewTmpfs(opt)
	if err != nil {
		t.Fatal(err)
	}
	f, _ := s.Create(7)
	if _, err := f.WriteAt([]byte("kept"), 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := s.(Reserver).Reserve(1 << 20); err != nil {
		t.Fatal(err)
	}
	root, err := s.(Lasting).Handover()
	if err != nil {
		t.Fatal(err)
	}
	s.Close()

	a, err := AdoptTmpfs(root, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	g, err := a.Open(7)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := g.ReadAt(b, 1<<20); err != nil || string(b) != "kept" {
		t.Fatalf("read back %q, %v", b, err)
	}
	if _, err := a.Open(8); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("opening a file never made: %v, want ENOENT", err)
	}
	if _, size, _ := a.Usage(); size != 4<<20 {
		t.Errorf("size after the handover: %d, want 4 MiB (what was reserved before given back)", size)
	}
	if err := a.(Reserver).Reserve(1 << 20); err != nil {
		t.Fatal(err)
	}
	if _, size, _ := a.Usage(); size != 3<<20 {
		t.Errorf("size after a MiB reserved: %d, want 3 MiB", size)
	}

	proc, err := unix.Open("/proc", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(proc)
	if _, err := AdoptTmpfs(proc, opt); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("adopting /proc as the store: %v, want EINVAL", err)
	}
}

// TestTmpfsSweep: a sweep removes the files not wanted, and only them.
func TestTmpfsSweep(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	s, err := NewTmpfs(TmpfsOptions{Size: 4 << 20, Huge: "never"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, id := range []uint64{3, 4, 5} {
		f, err := s.Create(id)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("x"), 0); err != nil {
			t.Fatal(err)
		}
	}
	root, err := s.(Lasting).Handover()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(root)
	n, bytes, err := Sweep(root, func(id uint64) bool { return id == 4 })
	if err != nil || n != 2 || bytes != 2*int64(os.Getpagesize()) {
		t.Errorf("sweep: %d files, %d bytes, %v; want 2 files of a page", n, bytes, err)
	}
	for id, want := range map[uint64]bool{3: false, 4: true, 5: false} {
		if _, err := s.(Lasting).Open(id); (err == nil) != want {
			t.Errorf("file %d after the sweep: %v, want kept %v", id, err, want)
		}
	}
}
