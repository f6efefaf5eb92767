package buffer_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
)

const nofileChildEnv = "MRFS_BUFFER_NOFILE_CHILD"

// TestNoFile runs in a child with a small RLIMIT_NOFILE. On the tmpfs
// store the daemon holds no descriptor per buffer: buffers past the limit
// all register, and only clients' opens run out (EMFILE, logged as
// RLIMIT_NOFILE once, nothing else touched). On memfds (no CAP_SYS_ADMIN)
// each buffer holds one: creating past the limit is EMFILE.
func TestNoFile(t *testing.T) {
	if os.Getenv(nofileChildEnv) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestNoFile$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(), nofileChildEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestNoFile") {
			t.Fatalf("child: %v\n%s", err, out)
		}
		return
	}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	// A few descriptors to spare, and a reserve that leaves clients 16.
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: uint64(len(entries) + 24), Max: lim.Max}); err != nil {
		t.Fatal(err)
	}
	defer unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	e := setup(t, buffer.Options{FdReserve: len(entries) + 8}, 0)
	memfd := e.m.Stats().Store == "memfd"
	var bufs []*buffer.Buffer
	for range 200 {
		b, err := e.m.Create(e.d, 4096, 0)
		if err != nil {
			if !memfd || !errors.Is(err, syscall.EMFILE) {
				t.Fatalf("create %d on %s past RLIMIT_NOFILE: %v", len(bufs), e.m.Stats().Store, err)
			}
			break
		}
		bufs = append(bufs, b)
	}
	if memfd {
		if len(bufs) == 0 || len(bufs) == 200 {
			t.Fatalf("%d buffers on memfds under a limit of a few descriptors", len(bufs))
		}
		t.Logf("memfd store: %d buffers fit", len(bufs))
		return
	}
	if st := e.m.Stats(); st.Buffers != 200 || st.RegisteredBytes != 200*4096 {
		t.Fatalf("stats: %+v, want 200 registered buffers", st)
	}
	// Clients' opens: 16 fit, the next is EMFILE and touches nothing.
	var fds []*buffer.Fd
	for i := range 20 {
		fd, err := bufs[i].Open(true)
		if err != nil {
			if !errors.Is(err, syscall.EMFILE) || len(fds) != 16 {
				t.Fatalf("open %d: %v (after %d)", i, err, len(fds))
			}
			break
		}
		fds = append(fds, fd)
	}
	bufs[19].Open(true) // refused again: logged once only
	if n := strings.Count(e.log.String(), "RLIMIT_NOFILE is"); n != 1 {
		t.Errorf("RLIMIT_NOFILE logged %d times, want 1:\n%s", n, e.log.String())
	}
	if st := e.m.Stats(); st.Buffers != 200 || st.RegisteredBytes != 200*4096 || st.OpenFds != 16 {
		t.Fatalf("stats after the refusal: %+v", st)
	}
	// Every buffer still resizes: the daemon's own opens have their reserve.
	for _, b := range bufs[:50] {
		if err := b.Resize(context.Background(), 8192); err != nil {
			t.Fatal(err)
		}
	}
	for _, fd := range fds {
		fd.Close()
	}
	if fd, err := bufs[0].Open(true); err != nil {
		t.Fatalf("open once descriptors were closed: %v", err)
	} else {
		fd.Close()
	}
	// The kernel's own EMFILE (the process's descriptors went elsewhere,
	// within the clients' share): refused, named, and the manager still
	// answers. (It once classified the error holding the lock that the
	// classification takes: every later call hung.)
	lowest, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(lowest)
	// The limit bounds descriptors' numbers: none free below it.
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: uint64(lowest), Max: lim.Max}); err != nil {
		t.Fatal(err)
	}
	opened := make(chan error, 1)
	go func() {
		fd, err := bufs[1].Open(true)
		if err == nil {
			fd.Close()
		}
		opened <- err
	}()
	select {
	case err := <-opened:
		if !errors.Is(err, syscall.EMFILE) || !strings.Contains(err.Error(), "RLIMIT_NOFILE") {
			t.Errorf("open past the process's descriptors: %v, want EMFILE naming RLIMIT_NOFILE", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("an open refused by the kernel's EMFILE hangs")
	}
	if st := e.m.Stats(); st.OpenFds != 0 {
		t.Errorf("stats after the kernel's refusal: %d open descriptors, want 0", st.OpenFds)
	}
}
