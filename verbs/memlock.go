package verbs

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// CanLockMemory reports whether the process has CAP_IPC_LOCK in its
// effective set, the bit the kernel checks (capable(CAP_IPC_LOCK)) to pin
// past RLIMIT_MEMLOCK. Read once from /proc/self/status: mrfs never
// changes its capabilities, and the file may be unreadable later (no file
// descriptor left).
var CanLockMemory = sync.OnceValue(func() bool {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return false
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<unix.CAP_IPC_LOCK) != 0
		}
	}
	return false
})

// MemlockLimit is the RLIMIT_MEMLOCK, in bytes, that registrations are
// accounted against: 0 when none applies (unlimited, or CAP_IPC_LOCK).
func MemlockLimit() uint64 {
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl) != nil || rl.Cur == unix.RLIM_INFINITY || CanLockMemory() {
		return 0
	}
	return rl.Cur
}
