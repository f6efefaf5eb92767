//go:build rdma

package guest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
	"mrfs/verbs/ibv"
)

// rawBuffer is what mrfs does for one file, done directly: a file of the
// size (a memfd, or a file on a huge-page tmpfs), mapped shared,
// registered with local write (mrfs's default access).
type rawBuffer struct {
	fd  int
	mem []byte
	mr  verbs.MR
}

// rawRegister registers size bytes of a new memfd, or with dir of a new
// file there.
func rawRegister(pd verbs.PD, size int, dir string) (*rawBuffer, error) {
	var fd int
	var err error
	if dir == "" {
		fd, err = unix.MemfdCreate("raw", unix.MFD_CLOEXEC)
	} else {
		fd, err = unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	}
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ftruncate: %w", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mmap: %w", err)
	}
	mr, err := pd.RegMR(uintptr(unsafe.Pointer(&mem[0])), uint64(size), verbs.LocalWrite)
	if err != nil {
		unix.Munmap(mem)
		unix.Close(fd)
		return nil, fmt.Errorf("reg_mr: %w", err)
	}
	return &rawBuffer{fd: fd, mem: mem, mr: mr}, nil
}

func (b *rawBuffer) free() error {
	if err := b.mr.Dereg(); err != nil {
		return fmt.Errorf("dereg_mr: %w", err)
	}
	if err := unix.Munmap(b.mem); err != nil {
		return err
	}
	return unix.Close(b.fd)
}

// sample is one timed step.
type sample struct{ reg, free time.Duration }

func (s sample) String() string { return fmtDur(s.reg) + "/" + fmtDur(s.free) }

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2f s", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/1e6)
	}
	return fmt.Sprintf("%.1f us", float64(d)/1e3)
}

func fmtSize(n int) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d KiB", n>>10)
}

// TestRegistrationBenchmark times `truncate -s SIZE` of a fresh empty mrfs
// file (FUSE setattr, the store file's resize, mapping, population by
// workers from 64 MiB, ibv_reg_mr in the daemon) against the same file +
// mmap + ibv_reg_mr done directly in this process, on rxe0: with huge
// pages off (mrfs with buffers.huge_pages = "never", by hand on a memfd)
// and on (mrfs's default within_size, by hand on a huge=always tmpfs).
// Each pair alternates which goes first; medians. Under TCG the absolute
// times are slow; the ratios are the figures that mean something. It
// runs when MRFS_VM_BENCH=1.
func TestRegistrationBenchmark(t *testing.T) {
	requireGuest(t)
	if os.Getenv("MRFS_VM_BENCH") != "1" {
		t.Skip("registration benchmark: set MRFS_VM_BENCH=1 (tests/vm/run --bench)")
	}
	p, err := ibv.New()
	if err != nil {
		t.Fatalf("ibv.New: %v", err)
	}
	dev, err := p.Open(device)
	if err != nil {
		t.Fatalf("open %s: %v", device, err)
	}
	defer dev.Close()
	pd, err := dev.AllocPD()
	if err != nil {
		t.Fatalf("alloc_pd: %v", err)
	}
	defer pd.Dealloc()
	hugeDir := filepath.Join(t.TempDir(), "huge")
	if err := os.Mkdir(hugeDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("none", hugeDir, "tmpfs", 0, "huge=always,size=3G"); err != nil {
		t.Fatalf("mount a huge=always tmpfs: %v", err)
	}
	defer unix.Unmount(hugeDir, unix.MNT_DETACH)
	plain := mountConf(t, "[buffers]\nhuge_pages = \"never\"\n")
	huge := mount(t)
	defer func() {
		for _, d := range []*daemon{plain, huge} {
			if err := d.stop(t); err != nil {
				t.Errorf("mrfs exited with %v after SIGINT", err)
			}
		}
	}()

	n := 0
	mrfsSide := func(d *daemon) func(size int) sample {
		return func(size int) sample {
			n++
			f := filepath.Join(d.dir, fmt.Sprintf("b%d", n))
			if err := os.WriteFile(f, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if err := os.Truncate(f, int64(size)); err != nil {
				t.Fatalf("truncate -s %d: %v", size, err)
			}
			reg := time.Since(start)
			if st := getxattr(t, f, "user.mrfs.state"); st != "registered" {
				t.Fatalf("%s after truncate -s %d: state %q", f, size, st)
			}
			if size == 1<<30 {
				var desc struct {
					PageSize int `json:"page_size"`
				}
				json.Unmarshal([]byte(getxattr(t, f, "user.mrfs.desc")), &desc)
				t.Logf("%s: 1 GiB registered on pages of %d bytes", d.dir, desc.PageSize)
			}
			start = time.Now()
			if err := os.Remove(f); err != nil {
				t.Fatal(err)
			}
			return sample{reg, time.Since(start)}
		}
	}
	rawSide := func(dir string) func(size int) sample {
		return func(size int) sample {
			start := time.Now()
			b, err := rawRegister(pd, size, dir)
			if err != nil {
				t.Fatalf("raw %d in %q: %v", size, dir, err)
			}
			reg := time.Since(start)
			start = time.Now()
			if err := b.free(); err != nil {
				t.Fatal(err)
			}
			return sample{reg, time.Since(start)}
		}
	}
	type pair struct {
		name      string
		mrfs, raw func(int) sample
	}
	pairs := []pair{
		{"4 KiB pages", mrfsSide(plain), rawSide("")},
		{"huge pages", mrfsSide(huge), rawSide(hugeDir)},
	}
	sizes := []int{4 << 10, 1 << 20, 64 << 20, 1 << 30}
	rounds := func(size int) int {
		if size >= 1<<30 {
			return 3 // a cold 1 GiB registration takes seconds under TCG
		}
		return 7
	}
	type key struct {
		pair string
		size int
	}
	mrfsT, rawT := map[key][]sample{}, map[key][]sample{}
	for _, size := range sizes {
		for _, pr := range pairs {
			k := key{pr.name, size}
			for r := range rounds(size) {
				// Alternate the order so that neither side always runs
				// on pages the other just freed.
				if r%2 == 0 {
					mrfsT[k] = append(mrfsT[k], pr.mrfs(size))
					rawT[k] = append(rawT[k], pr.raw(size))
				} else {
					rawT[k] = append(rawT[k], pr.raw(size))
					mrfsT[k] = append(mrfsT[k], pr.mrfs(size))
				}
			}
		}
	}

	// The floor of the mrfs path: a truncate to the size the file already
	// has goes through the same lookup and SETATTR round trips to the
	// daemon but registers nothing. It tells fixed FUSE cost from
	// registration cost at small sizes.
	floorFile := filepath.Join(huge.dir, "floor")
	createSized(t, floorFile, 4<<10)
	var floor []time.Duration
	for i := 0; i < 21; i++ {
		start := time.Now()
		if err := os.Truncate(floorFile, 4<<10); err != nil {
			t.Fatal(err)
		}
		floor = append(floor, time.Since(start))
	}
	if err := os.Remove(floorFile); err != nil {
		t.Fatal(err)
	}

	pick := func(ss []sample, reg bool) time.Duration {
		var ds []time.Duration
		for _, s := range ss {
			if reg {
				ds = append(ds, s.reg)
			} else {
				ds = append(ds, s.free)
			}
		}
		return median(ds)
	}
	var tbl strings.Builder
	fmt.Fprintf(&tbl, "| pages | size | rounds | mrfs `truncate -s` | by hand: file+mmap+reg_mr | ratio | mrfs `rm` | by hand: dereg+munmap | ratio |\n")
	fmt.Fprintf(&tbl, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, pr := range pairs {
		for _, size := range sizes {
			k := key{pr.name, size}
			t.Logf("%s, %s samples: mrfs %v, by hand %v", pr.name, fmtSize(size), mrfsT[k], rawT[k])
			mr, rr := pick(mrfsT[k], true), pick(rawT[k], true)
			mf, rf := pick(mrfsT[k], false), pick(rawT[k], false)
			fmt.Fprintf(&tbl, "| %s | %s | %d | %s | %s | %.2fx | %s | %s | %.2fx |\n", pr.name, fmtSize(size), rounds(size),
				fmtDur(mr), fmtDur(rr), float64(mr)/float64(rr), fmtDur(mf), fmtDur(rf), float64(mf)/float64(rf))
		}
	}
	// Issue 12's figure: how much sooner mrfs's defaults (huge pages,
	// population by workers) make 1 GiB ready than a single-threaded
	// program on 4 KiB pages, and than one on a huge-page tmpfs.
	g := 1 << 30
	mrfsHuge := pick(mrfsT[key{"huge pages", g}], true)
	fmt.Fprintf(&tbl, "\n1 GiB ready: mrfs on its defaults %s; by hand on 4 KiB pages %s (%.2fx mrfs's time), on huge pages %s (%.2fx)\n",
		fmtDur(mrfsHuge), fmtDur(pick(rawT[key{"4 KiB pages", g}], true)), float64(pick(rawT[key{"4 KiB pages", g}], true))/float64(mrfsHuge),
		fmtDur(pick(rawT[key{"huge pages", g}], true)), float64(pick(rawT[key{"huge pages", g}], true))/float64(mrfsHuge))
	fmt.Fprintf(&tbl, "mrfs `truncate -s` to the current size (FUSE round trips, no registration): %s (median of %d)\n", fmtDur(median(floor)), len(floor))
	fmt.Printf("\nregistration on %s, kernel %s, zero copy %v (medians; ratio = mrfs/by hand)\n%s\n", device, kernelRelease(), zeroCopy(), tbl.String())
}

// kernelRelease is uname -r.
func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "?"
	}
	return unix.ByteSliceToString(u.Release[:])
}
