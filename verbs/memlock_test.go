package verbs

import (
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMemlockLimit(t *testing.T) {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	var caps uint64
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			caps, _ = strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	want := caps&(1<<unix.CAP_IPC_LOCK) != 0
	if CanLockMemory() != want {
		t.Fatalf("CanLockMemory = %v, CapEff %#x says %v", CanLockMemory(), caps, want)
	}
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl); err != nil {
		t.Fatal(err)
	}
	switch got := MemlockLimit(); {
	case want || rl.Cur == unix.RLIM_INFINITY:
		if got != 0 {
			t.Errorf("MemlockLimit = %d, want 0 (CAP_IPC_LOCK or unlimited)", got)
		}
	case got != rl.Cur:
		t.Errorf("MemlockLimit = %d, want RLIMIT_MEMLOCK %d", got, rl.Cur)
	}
}
