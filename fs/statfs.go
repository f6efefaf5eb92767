package fs

import (
	"context"
	"math"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"mrfs/verbs"
)

const statfsBlock = 4096

// Statfs reports the pinning budget as the filesystem's size and what the
// store holds (or is charged, which is more while an operation is under
// way) as used, so `df` shows how much more can be had; max_buffers is
// its inodes, files unlinked but still open among those used.
func (n *dirNode) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	st := n.fsys.mgr.Stats()
	opt := n.fsys.mgr.Options()
	total := opt.MaxPinned
	if ml := verbs.MemlockLimit(); ml != 0 && (total == 0 || ml < total) {
		total = ml
	}
	if total == 0 {
		var si unix.Sysinfo_t
		if unix.Sysinfo(&si) == nil {
			total = uint64(si.Totalram) * uint64(si.Unit)
		}
	}
	used := max(st.StoreUsed, st.ChargedBytes)
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
	if n := uint64(st.Buffers + st.Orphans); files > n {
		out.Ffree = files - n
	}
	out.NameLen = 255
	return 0
}
