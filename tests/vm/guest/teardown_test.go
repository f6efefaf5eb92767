//go:build rdma

package guest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// waitLine waits for a line of the daemon's log that contains s, and
// fails the test when the daemon exits first or none comes in time.
func waitLine(t *testing.T, d *daemon, s string) string {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		for _, line := range strings.Split(d.log.String(), "\n") {
			if strings.Contains(line, s) {
				return line
			}
		}
		select {
		case err := <-d.done:
			d.done <- err
			t.Fatalf("mrfs exited (%v) before logging %q", err, s)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("mrfs did not log %q within 60s", s)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestTeardownFreesWhileAliveRDMA: at SIGINT mrfs itself deregisters
// every region and deallocates every PD, before it closes the device.
// Closing the device, or exiting, makes the kernel release whatever is
// left, so the kernel is asked while the daemon lives: the test hook
// MRFS_TEST_PAUSE_AFTER_TEARDOWN holds it right after the teardown, and
// then `rdma resource show mr` and `pd` list nothing of it.
func TestTeardownFreesWhileAliveRDMA(t *testing.T) {
	requireGuest(t)
	t.Setenv("MRFS_TEST_PAUSE_AFTER_TEARDOWN", "1") // inherited by the daemon
	mrsBefore, pdsBefore := ids(t, "mr"), ids(t, "pd")
	d := mount(t)
	pid := d.cmd.Process.Pid

	createSized(t, filepath.Join(d.dir, "a"), 1<<20)
	if err := os.Mkdir(filepath.Join(d.dir, "tenant"), 0o755); err != nil {
		t.Fatal(err)
	}
	createSized(t, filepath.Join(d.dir, "tenant", "b"), 64<<10)
	createSized(t, filepath.Join(d.dir, "empty"), 0)
	if n := len(newSince(t, "mr", mrsBefore, pid)); n != 2 {
		t.Fatalf("the kernel lists %d regions of mrfs for two registered buffers", n)
	}
	if n := len(newSince(t, "pd", pdsBefore, pid)); n != 2 {
		t.Fatalf("the kernel lists %d PDs of mrfs for two directories", n)
	}

	if err := d.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	freed := fmt.Sprintf("deregistered_regions=2 deallocated_pds=2 unpinned_bytes=%d", 1<<20+64<<10)
	if line := waitLine(t, d, "paused after teardown"); !strings.Contains(line, freed) {
		t.Errorf("the paused daemon reports %q, want %s", line, freed)
	}
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("the daemon (pid %d) is gone while it should be paused: %v", pid, err)
	}
	for _, kind := range []string{"mr", "pd"} {
		before := map[string]snapshot{"mr": mrsBefore, "pd": pdsBefore}[kind]
		if left := newSince(t, kind, before, pid); len(left) != 0 {
			t.Errorf("after its teardown, while it lives, the daemon still holds %d %s: %v", len(left), kind, left)
		} else {
			t.Logf("paused after teardown: the kernel lists no %s of the live daemon (pid %d)", kind, pid)
		}
	}
	if err := d.stop(t); err != nil {
		t.Errorf("mrfs exited with %v after the pause, want status 0", err)
	}
	if line := waitLine(t, d, "teardown complete"); !strings.Contains(line, freed) {
		t.Errorf("the teardown reports %q, want %s", line, freed)
	}
}
