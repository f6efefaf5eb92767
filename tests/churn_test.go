package tests

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestSharedMountChurn: four users, eight threads each, for a minute on a
// shared mount whose per-user quotas add up exactly to the budget:
// truncate, fallocate (with and without KEEP_SIZE), appends through
// zero-copy opens, stores through MAP_SHARED, mappings kept past their
// close (and the file unlinked under them), unlink while open, and root
// moving files between users with chown. Every 10 ms the daemon's word is
// checked: the charges are the users' and within the budget, and the
// store holds no more than is charged but for appends not yet seen (the
// kernel bounds those by the store only; past their owner's quota they
// are taken back at the writer's close, or as soon as another call needs
// the room). With every page charged, the only refusal a user can meet is
// EDQUOT: no call the daemon answers ends in ENOSPC or ENOMEM (a write
// through a zero-copy open meets the kernel's bound, the store's size:
// see below). At the end the store holds what is charged, and after rm -r
// nothing.
// It runs alone (not in parallel): its 32 threads would slow the others
// past their watchdogs under emulation. MRFS_CHURN_SECONDS sets its
// length; under emulation (the tests/vm guest) it is 20 s.
func TestSharedMountChurn(t *testing.T) {
	const (
		users  = 4
		quota  = 16 << 20
		budget = users * quota
	)
	seconds := 60
	if slowFactor() > 1 {
		seconds = 20
	}
	if s := os.Getenv("MRFS_CHURN_SECONDS"); s != "" {
		seconds, _ = strconv.Atoi(s)
	}
	d := startDaemon(t, daemonConfig{
		Buffers: fmt.Sprintf("max_pinned = %d\nmax_pinned_per_user = %d", budget, quota),
		Mount:   "allow_other = true\numask = \"022\"",
		Metrics: `listen = "127.0.0.1:0"`,
		Quiet:   true,
		Hang:    time.Duration(seconds)*time.Second + 2*time.Minute,
	})
	shared := sharedDir(t, d)

	// The users' workers: this test binary again, as each uid, from where
	// they may run it.
	self, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	binDir, err := os.MkdirTemp("", "mrfs-churn-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(binDir) })
	bin := filepath.Join(binDir, "worker")
	if err := os.Chmod(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, self, 0o755); err != nil {
		t.Fatal(err)
	}
	var workers []*exec.Cmd
	var outs []string
	for u := range users {
		uid := 3001 + u
		out := filepath.Join(binDir, fmt.Sprintf("result-%d.json", uid))
		if err := os.WriteFile(out, nil, 0o666); err != nil {
			t.Fatal(err)
		}
		os.Chmod(out, 0o666)
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), churnEnv+"="+shared, "MRFS_CHURN_OUT="+out,
			"MRFS_CHURN_SECONDS="+strconv.Itoa(seconds), "MRFS_CHURN_UID="+strconv.Itoa(uid))
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		workers = append(workers, cmd)
		outs = append(outs, out)
	}

	// Root meanwhile moves files between users (chown), and samples.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var chowns, chownRefused int
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			ents, _ := os.ReadDir(shared)
			if len(ents) == 0 {
				continue
			}
			e := ents[rand.IntN(len(ents))]
			uid := 3001 + rand.IntN(users)
			err := os.Chown(filepath.Join(shared, e.Name()), uid, uid)
			switch {
			case err == nil:
				chowns++
			case errors.Is(err, unix.EDQUOT):
				chownRefused++
			case errors.Is(err, unix.ENOENT):
			default:
				t.Errorf("chown: %v", err)
			}
		}
	})
	samples, unseen := 0, 0
	var sampleErr error
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
			raw, err := getxattr(d.mnt, xStats)
			var s mrfsStats
			if err == nil {
				err = json.Unmarshal([]byte(raw), &s)
			}
			if err != nil {
				if sampleErr == nil {
					sampleErr = fmt.Errorf("stats: %w", err)
				}
				continue
			}
			samples++
			var sum int64
			for _, u := range s.Users {
				sum += u.ChargedBytes
			}
			if s.StoreBytes > s.ChargedBytes {
				unseen++
			}
			switch {
			case sampleErr != nil:
			case s.ChargedBytes > budget || s.StoreBytes > budget:
				sampleErr = fmt.Errorf("%d bytes charged, past the budget %d", s.ChargedBytes, budget)
			case sum != s.ChargedBytes:
				sampleErr = fmt.Errorf("the users are charged %d, the total is %d", sum, s.ChargedBytes)
			}
		}
	})
	for _, w := range workers {
		if err := w.Wait(); err != nil {
			t.Errorf("a worker: %v", err)
		}
	}
	close(stop)
	wg.Wait()
	if sampleErr != nil {
		t.Error(sampleErr)
	}

	total := churnResult{Errs: map[string]int{}, Where: map[string]int{}}
	for i, out := range outs {
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatalf("worker %d's result: %v", i, err)
		}
		var r churnResult
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatal(err)
		}
		total.Ops += r.Ops
		for k, v := range r.Errs {
			total.Errs[k] += v
		}
		for k, v := range r.Where {
			total.Where[k] += v
		}
	}
	t.Logf("%d calls in %d s, refusals %v; root: %d chowns, %d refused; %d samples, %d with appends not seen yet", total.Ops, seconds, total.Errs, chowns, chownRefused, samples, unseen)
	// A write through a zero-copy open meets the store's own size, which
	// the kernel applies: it may find the store full in the moment
	// between another user's write past its quota and that writer's
	// close, which takes it back. Every other call goes through the
	// daemon, which charges before the pages exist; it meets the same
	// moment only when such writes fill the store between its admission
	// and its population, twice (it takes them back and tries again), and
	// then it refuses naming the store (DESIGN, Accounting), which
	// /metrics counts. Memory charged to nobody would stay at rest: the
	// checks below catch it.
	zeroCopy := total.Where["zero-copy write: ENOSPC"]
	storeFull := int(scrape(t, metricsURL(t, d))[`mrfs_limit_hits_total{limit="store"}`])
	t.Logf("writes through zero-copy opens that met a full store: %d; daemon refusals naming the store: %d", zeroCopy, storeFull)
	if n := total.Errs["ENOSPC"] - zeroCopy; n > storeFull || total.Errs["ENOMEM"] > 0 {
		t.Errorf("users were refused by the daemon with ENOSPC (%d, %d of them naming the store) or ENOMEM (%d), though only EDQUOT can refuse them: some memory is charged to nobody (%v)", n, storeFull, total.Errs["ENOMEM"], total.Where)
	}
	if total.Errs["EDQUOT"] == 0 || samples < seconds {
		t.Errorf("the quotas were never reached (%d EDQUOT) or the invariants seldom looked at (%d samples): the test proves little", total.Errs["EDQUOT"], samples)
	}
	for k, v := range total.Errs {
		if k != "EDQUOT" && k != "EACCES" && k != "ENOENT" && k != "EPERM" && k != "ENOSPC" && k != "ENOMEM" {
			t.Errorf("%d calls failed with %s (%v)", v, k, total.Where)
		}
	}
	if d.exited() {
		t.Fatal("the daemon died")
	}
	s := requireHeld(t, d, "after the churn")
	for uid, u := range s.Users {
		if u.ChargedBytes > quota {
			t.Errorf("at rest uid %s holds %d bytes, past its quota %d", uid, u.ChargedBytes, quota)
		}
	}
	if out, err := run2(t, "rm", "-r", shared); err != nil {
		t.Fatalf("rm -r: %v %s", err, out)
	}
	waitReleased(t, d)
	s = requireHeld(t, d, "after rm -r")
	if s.ChargedBytes != 0 || s.StoreBytes != 0 || s.OpenUnlinked != 0 {
		t.Errorf("after rm -r: %+v", s)
	}
}

// churnEnv names the shared directory a worker of TestSharedMountChurn
// works in; TestMain runs the worker, not the tests, when it is set.
const churnEnv = "MRFS_CHURN_DIR"

type churnResult struct {
	Ops  int            `json:"ops"`
	Errs map[string]int `json:"errs"`
	// Where are the refusals other than EDQUOT, EACCES, EPERM and ENOENT,
	// by the call that met them.
	Where map[string]int `json:"where"`
}

// churnWorker is one user of TestSharedMountChurn: eight threads, each on
// files of its own, doing what users do until the time is up; the result
// (calls made, refusals by errno) goes to MRFS_CHURN_OUT.
func churnWorker() int {
	dir := os.Getenv(churnEnv)
	seconds, _ := strconv.Atoi(os.Getenv("MRFS_CHURN_SECONDS"))
	uid := os.Getenv("MRFS_CHURN_UID")
	deadline := time.Now().Add(time.Duration(seconds) * time.Second)
	var mu sync.Mutex
	res := churnResult{Errs: map[string]int{}, Where: map[string]int{}}
	var wg sync.WaitGroup
	for th := range 8 {
		wg.Go(func() {
			w := &churner{rng: rand.New(rand.NewPCG(uint64(th), uint64(time.Now().UnixNano())))}
			for k := range 4 {
				w.files = append(w.files, filepath.Join(dir, fmt.Sprintf("u%s-t%d-%d", uid, th, k)))
			}
			for time.Now().Before(deadline) {
				w.step()
			}
			mu.Lock()
			res.Ops += w.ops
			for k, v := range w.errs {
				res.Errs[k] += v
			}
			for k, v := range w.where {
				res.Where[k] += v
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	b, _ := json.Marshal(res)
	if err := os.WriteFile(os.Getenv("MRFS_CHURN_OUT"), b, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "churn worker:", err)
		return 1
	}
	return 0
}

// churner is one thread of a churn worker.
type churner struct {
	rng   *rand.Rand
	files []string
	ops   int
	errs  map[string]int
	where map[string]int
	op    string // the step under way, for where
}

// note counts a call and its refusal, if any.
func (c *churner) note(err error) bool {
	c.ops++
	if err == nil {
		return true
	}
	if c.errs == nil {
		c.errs = map[string]int{}
	}
	name := err.Error()
	var e syscall.Errno
	if errors.As(err, &e) {
		name = unix.ErrnoName(e)
	}
	c.errs[name]++
	switch name {
	case "EDQUOT", "EACCES", "EPERM", "ENOENT":
	default:
		if c.where == nil {
			c.where = map[string]int{}
		}
		c.where[c.op+": "+name]++
	}
	return false
}

// size is a size up to 6 MiB, often not a whole number of pages.
func (c *churner) size() int64 {
	n := c.rng.Int64N(6 << 20)
	if c.rng.IntN(2) == 0 {
		n &^= 4095
	}
	return n
}

func (c *churner) step() {
	f := c.files[c.rng.IntN(len(c.files))]
	switch c.rng.IntN(8) {
	case 0: // truncate
		c.op = "truncate"
		fd, err := unix.Open(f, unix.O_CREAT|unix.O_RDWR, 0o644)
		if c.note(err) {
			c.note(unix.Ftruncate(fd, c.size()))
			unix.Close(fd)
		}
	case 1, 2: // fallocate, with and without KEEP_SIZE
		c.op = "fallocate"
		fd, err := unix.Open(f, unix.O_CREAT|unix.O_RDWR, 0o644)
		if c.note(err) {
			mode := uint32(0)
			if c.rng.IntN(2) == 0 {
				mode = unix.FALLOC_FL_KEEP_SIZE
			}
			c.note(unix.Fallocate(fd, mode, c.rng.Int64N(4<<20), 1+c.rng.Int64N(2<<20)))
			unix.Close(fd)
		}
	case 3: // an append through the zero-copy open: unseen until the close
		c.op = "append"
		fd, err := unix.Open(f, unix.O_CREAT|unix.O_WRONLY|unix.O_APPEND, 0o644)
		if !c.note(err) {
			return
		}
		c.op = "zero-copy write"
		_, err = unix.Write(fd, make([]byte, 1+c.rng.IntN(256<<10)))
		c.note(err)
		c.op = "close after append"
		c.note(unix.Close(fd))
	case 4: // stores through MAP_SHARED, within the size
		c.op = "mmap"
		fd, err := unix.Open(f, unix.O_CREAT|unix.O_RDWR, 0o644)
		if !c.note(err) {
			return
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		if unix.Fstat(fd, &st) != nil || st.Size == 0 {
			return
		}
		p, err := unix.MmapPtr(fd, 0, nil, uintptr(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if !c.note(err) {
			return
		}
		b := unsafe.Slice((*byte)(p), st.Size)
		for i := int64(0); i < st.Size; i += 4096 {
			b[i]++
		}
		unix.MunmapPtr(p, uintptr(st.Size))
	case 5: // unlink while open, and the calls an open unlinked file takes
		c.op = "unlinked"
		fd, err := unix.Open(f, unix.O_CREAT|unix.O_RDWR, 0o644)
		if !c.note(err) {
			return
		}
		c.note(unix.Ftruncate(fd, c.size()))
		c.note(unix.Unlink(f))
		c.note(unix.Fallocate(fd, 0, 0, 1+c.rng.Int64N(2<<20)))
		c.note(unix.Ftruncate(fd, c.size()))
		time.Sleep(time.Duration(c.rng.IntN(20)) * time.Millisecond)
		c.note(unix.Close(fd))
	case 6: // remove
		c.op = "rm"
		err := unix.Unlink(f)
		if !errors.Is(err, unix.ENOENT) {
			c.note(err)
		}
	case 7: // a mapping outlives its descriptor: map, close, maybe unlink, store, munmap
		c.op = "map after close"
		fd, err := unix.Open(f, unix.O_RDWR, 0)
		if errors.Is(err, unix.ENOENT) || !c.note(err) {
			return
		}
		var st unix.Stat_t
		if unix.Fstat(fd, &st) != nil || st.Size == 0 {
			unix.Close(fd)
			return
		}
		p, err := unix.MmapPtr(fd, 0, nil, uintptr(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		unix.Close(fd)
		if !c.note(err) {
			return
		}
		if c.rng.IntN(2) == 0 {
			c.op = "unlink while mapped"
			c.note(unix.Unlink(f))
		}
		b := unsafe.Slice((*byte)(p), st.Size)
		for i := int64(0); i < st.Size; i += 4096 {
			b[i]++
		}
		time.Sleep(time.Duration(c.rng.IntN(20)) * time.Millisecond)
		unix.MunmapPtr(p, uintptr(st.Size))
	}
}
