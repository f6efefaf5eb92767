package buffer_test

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
)

const nofileChildEnv = "MRFS_BUFFER_NOFILE_CHILD"

// TestNoFile runs in a child with a small RLIMIT_NOFILE (every buffer
// holds a memfd): creating past it fails with EMFILE, changes nothing,
// and the log names the limit once.
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
	e := setup(t, buffer.Options{}, 0)
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: uint64(len(entries) + 4), Max: lim.Max}); err != nil {
		t.Fatal(err)
	}
	var bufs []*buffer.Buffer
	for range 20 {
		b, err := e.m.Create(e.d, 4096)
		if err != nil {
			if !errors.Is(err, syscall.EMFILE) {
				t.Fatalf("create past RLIMIT_NOFILE: %v, want EMFILE", err)
			}
			break
		}
		bufs = append(bufs, b)
	}
	if len(bufs) == 0 || len(bufs) == 20 {
		t.Fatalf("%d buffers created under a limit of a few descriptors", len(bufs))
	}
	if st := e.m.Stats(); st.Buffers != len(bufs) || st.RegisteredBytes != uint64(4096*len(bufs)) {
		t.Errorf("stats after the refusal: %+v, want %d buffers", st, len(bufs))
	}
	e.m.Create(e.d, 4096) // refused again: logged once only
	if n := strings.Count(e.log.String(), "RLIMIT_NOFILE is"); n != 1 {
		t.Errorf("RLIMIT_NOFILE logged %d times, want 1:\n%s", n, e.log.String())
	}
	unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	for _, b := range bufs {
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
}
