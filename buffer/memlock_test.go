package buffer_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
)

const memlockChildEnv = "MRFS_BUFFER_MEMLOCK_CHILD"

// TestMemlock runs in a child without CAP_IPC_LOCK, so RLIMIT_MEMLOCK
// applies to the soft device's pinning as it does to ib_umem_get.
func TestMemlock(t *testing.T) {
	if os.Getenv(memlockChildEnv) != "" {
		memlockChild(t)
		return
	}
	args := []string{"-test.run=^TestMemlock$", "-test.v", "-test.count=1"}
	var cmd *exec.Cmd
	switch {
	case !hasCap(unix.CAP_IPC_LOCK):
		cmd = exec.Command(os.Args[0], args...)
	case os.Geteuid() != 0:
		t.Skip("cannot start a child without CAP_IPC_LOCK")
	default:
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Skip("setpriv not found: cannot drop CAP_IPC_LOCK for the child")
		}
		cmd = exec.Command(setpriv, append([]string{"--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--", os.Args[0]}, args...)...)
	}
	cmd.Env = append(os.Environ(), memlockChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestMemlock") {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

func hasCap(c int) bool {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			var caps uint64
			for _, r := range strings.TrimSpace(v) {
				caps = caps<<4 | uint64(strings.IndexRune("0123456789abcdef", r))
			}
			return caps&(1<<c) != 0
		}
	}
	return false
}

func memlockChild(t *testing.T) {
	if hasCap(unix.CAP_IPC_LOCK) {
		t.Fatal("the child has CAP_IPC_LOCK")
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		t.Fatal(err)
	}
	setLimit := func(n uint64) {
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: n, Max: lim.Max}); err != nil {
			t.Fatal(err)
		}
	}
	setLimit(64 << 10)
	e := setup(t, buffer.Options{}, 0)

	_, err := e.m.Create(e.d, 128<<10, 0)
	errnoIs(t, err, syscall.ENOMEM)
	if st := e.m.Stats(); st.Buffers != 0 || st.PDs != 1 || st.PinnedBytes != 0 || len(st.Users) != 0 {
		t.Fatalf("failed Create left %+v", st)
	}
	want := "cannot pin 128 KiB: RLIMIT_MEMLOCK is 64 KiB; raise it with `ulimit -l` (LimitMEMLOCK= in a systemd unit) or run with CAP_IPC_LOCK"
	if !strings.Contains(e.log.String(), want) {
		t.Fatalf("log lacks %q:\n%s", want, e.log.String())
	}

	b := e.create(t, 16<<10)
	copy(b.Mem(), pattern(16<<10, 1))
	// The kernel counts the new region and the old one while both live,
	// so 16 KiB -> 32 KiB needs 48 KiB: it fits.
	if err := b.Resize(context.Background(), 32<<10); err != nil {
		t.Fatal(err)
	}
	before := b.Info()
	errnoIs(t, b.Resize(context.Background(), 96<<10), syscall.ENOMEM)
	check(t, e, b, 32<<10, buffer.Registered)
	if b.Info() != before {
		t.Fatal("failed Resize changed the buffer")
	}

	// A client grows it past the limit: the registration stays, with
	// the reason.
	f := outside(t, b)
	if _, err := f.WriteAt([]byte("x"), 100<<10); err != nil {
		t.Fatal(err)
	}
	errnoIs(t, b.Sync(), syscall.ENOMEM)
	if in := b.Info(); in.State != buffer.Registered || in.Length != 32<<10 || in.Reason != "RLIMIT_MEMLOCK (64 KiB) reached" {
		t.Fatalf("Info %+v", in)
	}
	// Logged for Create, not again within the minute.
	if n := strings.Count(e.log.String(), "RLIMIT_MEMLOCK is 64 KiB"); n != 1 {
		t.Fatalf("logged %d times", n)
	}
	if err := b.Resize(context.Background(), 16<<10); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, b); string(got) != string(pattern(16<<10, 1)) {
		t.Fatal("data lost")
	}

	// RLIMIT_MEMLOCK 0 is EPERM.
	setLimit(0)
	_, err = e.m.Create(e.d, page, 0)
	errnoIs(t, err, syscall.EPERM)
	setLimit(64 << 10)
}
