package buffer_test

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/store"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

const page = 4096

// allowed is the policy of the tests: ZeroBased is allowed but the soft
// device (like rxe) refuses it, MWBind is supported but not allowed.
const allowed = verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic | verbs.ZeroBased

// logBuf is a log sink safe for concurrent handlers.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

type env struct {
	m   *buffer.Manager
	dev *spy
	d   *buffer.Domain // a first domain with default access local_write
	log *logBuf
}

// newStore is the store the tests run on: the private tmpfs instance the
// daemon uses, as root; memfds otherwise (fsopen needs CAP_SYS_ADMIN).
// Its size is the budget, as the daemon makes it.
func newStore(t *testing.T, opt buffer.Options) store.Store {
	t.Helper()
	if os.Geteuid() != 0 {
		return store.NewMemfd()
	}
	s, err := store.NewTmpfs(store.TmpfsOptions{Size: opt.MaxPinned, Files: uint64(opt.MaxBuffers), Huge: "never"})
	if err != nil {
		t.Fatalf("the tmpfs store as root: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// setup opens a soft device (maxMR 0: rxe's) behind a spy and a manager
// with opt (Allowed defaults to allowed, Store to newStore). Cleanup
// closes the manager and checks the device holds no region and no PD
// afterwards.
func setup(t *testing.T, opt buffer.Options, maxMR int) *env {
	t.Helper()
	dev, err := soft.New(soft.Options{MaxMR: maxMR}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	return setupOn(t, opt, dev)
}

// setupOn is setup on dev, which it closes at cleanup.
func setupOn(t *testing.T, opt buffer.Options, dev verbs.Device) *env {
	t.Helper()
	var err error
	if opt.Allowed == 0 {
		opt.Allowed = allowed
	}
	if opt.Store == nil {
		opt.Store = newStore(t, opt)
	}
	e := &env{dev: &spy{Device: dev, t: t}, log: &logBuf{}}
	e.m = buffer.NewManager(e.dev, opt, slog.New(slog.NewTextHandler(e.log, nil)))
	e.d, err = e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := e.m.Close(); err != nil {
			t.Errorf("Manager.Close: %v", err)
		}
		if mrs, pds := e.dev.counts(); mrs != 0 || pds != 0 {
			t.Errorf("after Close the device holds %d regions and %d PDs", mrs, pds)
		}
		e.dev.checkViolations(t)
		if err := dev.Close(); err != nil {
			t.Errorf("device Close: %v", err)
		}
	})
	return e
}

func (e *env) create(t *testing.T, size uint64) *buffer.Buffer {
	t.Helper()
	b, err := e.m.Create(e.d, size, 0)
	if err != nil {
		t.Fatalf("Create(%d): %v", size, err)
	}
	return b
}

// check asserts the buffer's invariants: the file's size, the state,
// and for a registered buffer that the region is the whole file, at the
// daemon's mapping, and that the manager and device count one region.
func check(t *testing.T, e *env, b *buffer.Buffer, size uint64, state buffer.State) {
	t.Helper()
	in := b.Info()
	if in.Size != size || in.State != state {
		t.Fatalf("Info: size %d state %v (%q), want %d %v", in.Size, in.State, in.Reason, size, state)
	}
	if got := fileSize(t, b); got != size {
		t.Fatalf("file size %d, want %d", got, size)
	}
	mr := b.MR()
	switch state {
	case buffer.Registered:
		if mr == nil {
			t.Fatal("registered without a region")
		}
		if mr.Length() != size || in.Length != size || in.Reason != "" || in.Addr != mr.Addr() || in.LKey != mr.LKey() || in.RKey != mr.RKey() {
			t.Fatalf("Info %+v does not match region len %d addr 0x%x lkey 0x%x", in, mr.Length(), mr.Addr(), mr.LKey())
		}
		if mem := b.Mem(); uintptr(len(mem)) != uintptr(size) || mr.Addr() != uintptr(buffer.UnsafePointer(mem)) {
			t.Fatalf("region 0x%x is not the daemon mapping", mr.Addr())
		}
		if b.MappedLen() != buffer.PageRound(size) {
			t.Fatalf("mapping is %d bytes, want %d", b.MappedLen(), buffer.PageRound(size))
		}
		if mr.Access() != in.Access || mr.PD().Handle() != in.PD {
			t.Fatalf("region access %s pd %d, Info says %s %d", mr.Access(), mr.PD().Handle(), in.Access, in.PD)
		}
	default:
		if mr != nil || in.LKey != 0 || in.RKey != 0 || in.Addr != 0 {
			t.Fatalf("%v buffer has a region: %+v", state, in)
		}
		if b.MappedLen() != 0 {
			t.Fatalf("%v buffer keeps a %d-byte mapping", state, b.MappedLen())
		}
	}
	if n := mappingsOf(t, b); state == buffer.Registered && n != 1 || state != buffer.Registered && n != 0 {
		t.Fatalf("%d daemon mappings of the file in state %v", n, state)
	}
}

func fileSize(t *testing.T, b *buffer.Buffer) uint64 {
	t.Helper()
	size, _, err := b.File().Stat()
	if err != nil {
		t.Fatal(err)
	}
	return size
}

// mappingsOf counts the lines of /proc/self/maps that map b's file (by
// device and inode).
func mappingsOf(t *testing.T, b *buffer.Buffer) int {
	t.Helper()
	fd, err := b.File().Open()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	err = unix.Fstat(fd, &st)
	unix.Close(fd)
	if err != nil {
		t.Fatal(err)
	}
	dev := fmt.Sprintf("%02x:%02x", unix.Major(st.Dev), unix.Minor(st.Dev))
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 5 && fs[3] == dev && fs[4] == strconv.FormatUint(st.Ino, 10) {
			n++
		}
	}
	return n
}

// client is a client's open of a buffer: its own descriptor of the file,
// as a passthrough open has, and the handle's Fd that the daemon keeps
// open for it until RELEASE.
type client struct {
	*os.File
	fd *buffer.Fd
}

// Close is the client's close and its RELEASE.
func (c *client) Close() error {
	err := c.File.Close()
	c.fd.Close()
	return err
}

// outside opens the file again, as a client's passthrough open does.
func outside(t *testing.T, b *buffer.Buffer) *client {
	t.Helper()
	fd, err := b.Open(true)
	if err != nil {
		t.Fatal(err)
	}
	n, err := unix.FcntlInt(uintptr(fd.N), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	c := &client{File: os.NewFile(uintptr(n), "client"), fd: fd}
	t.Cleanup(func() { c.Close() })
	return c
}

// pattern is size bytes that differ from page to page and byte to byte.
func pattern(size uint64, seed byte) []byte {
	p := make([]byte, size)
	for i := range p {
		p[i] = byte(i/page) + byte(i)*7 + seed
	}
	return p
}

func readAll(t *testing.T, b *buffer.Buffer) []byte {
	t.Helper()
	size := b.Info().Size
	p := make([]byte, size)
	n, err := b.ReadAt(p, 0)
	if err != nil || uint64(n) != size {
		t.Fatalf("ReadAt: %d, %v; want %d", n, err, size)
	}
	return p
}

func vmLck(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(l, "VmLck:") {
			return strings.TrimSpace(strings.TrimPrefix(l, "VmLck:"))
		}
	}
	t.Fatal("no VmLck in /proc/self/status")
	return ""
}

// deadMR asserts that a region the buffer dropped is gone from the device.
func deadMR(t *testing.T, mr verbs.MR) {
	t.Helper()
	errnoIs(t, mr.Dereg(), unix.EINVAL)
}
