package fs

import (
	"context"
	"math"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

const statfsBlock = 4096

// Statfs reports the pinning budget as the filesystem's size, so `df`
// shows how much more can be registered, and max_buffers as its inodes.
func (d *dirNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	st := d.fsys.mgr.Stats()
	opt := d.fsys.mgr.Options()
	total := opt.MaxPinned
	if ml := memlockLimit(); ml != 0 && (total == 0 || ml < total) {
		total = ml
	}
	if total == 0 {
		var si unix.Sysinfo_t
		if unix.Sysinfo(&si) == nil {
			total = uint64(si.Totalram) * uint64(si.Unit)
		}
	}
	used := st.PinnedBytes
	free := uint64(0)
	if total > used {
		free = total - used
	}
	out.Bsize = statfsBlock
	out.Frsize = statfsBlock
	out.Blocks = total / statfsBlock
	out.Bfree = free / statfsBlock
	out.Bavail = out.Bfree
	files := uint64(opt.MaxBuffers)
	if files == 0 {
		files = math.MaxUint32
	}
	out.Files = files
	if files > uint64(st.Buffers) {
		out.Ffree = files - uint64(st.Buffers)
	}
	out.NameLen = 255
	return 0
}

// memlockLimit is the daemon's RLIMIT_MEMLOCK in bytes, 0 when it does not
// apply (unlimited, or the daemon has CAP_IPC_LOCK).
func memlockLimit() uint64 {
	var rl unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl) != nil || rl.Cur == unix.RLIM_INFINITY || hasIPCLock() {
		return 0
	}
	return rl.Cur
}

// hasIPCLock reports whether CAP_IPC_LOCK is in the effective set.
func hasIPCLock() bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<unix.CAP_IPC_LOCK) != 0
		}
	}
	return false
}
