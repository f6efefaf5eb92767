package fs

import (
	"bytes"
	"context"
	"os"
	"strconv"

	"github.com/hanwen/go-fuse/v2/fuse"

	"mrfs/tree"
)

// caller is who makes the request of ctx, for checks the kernel's mode
// check does not make itself (who may read a PD's token): the uid and
// gid the kernel gives, and the supplementary groups of the calling
// thread, which FUSE does not carry, from /proc. A caller the kernel
// gives no pid for (in a pid namespace the daemon cannot see) counts by
// its uid and gid alone; a request without a caller counts as nobody's.
func caller(ctx context.Context) tree.Caller {
	c, ok := fuse.FromContext(ctx)
	if !ok {
		return tree.Caller{Owner: tree.Owner{UID: ^uint32(0), GID: ^uint32(0)}}
	}
	return tree.Caller{Owner: tree.Owner{UID: c.Uid, GID: c.Gid}, Groups: procGroups(c.Pid)}
}

// procGroups reads the "Groups:" line of /proc/PID/status (PID is the
// calling thread's); nil when there is none to read.
func procGroups(pid uint32) []uint32 {
	var groups []uint32
	for _, f := range bytes.Fields(procStatus(pid, "Groups:")) {
		if g, err := strconv.ParseUint(string(f), 10, 32); err == nil {
			groups = append(groups, uint32(g))
		}
	}
	return groups
}

// procCapEff reads the calling thread's effective capabilities from the
// "CapEff:" line of /proc/PID/status; none when there is none to read.
func procCapEff(pid uint32) uint64 {
	caps, err := strconv.ParseUint(string(bytes.TrimSpace(procStatus(pid, "CapEff:"))), 16, 64)
	if err != nil {
		return 0
	}
	return caps
}

// procStatus is what follows key on its line of /proc/PID/status, nil
// when there is none (pid 0: the kernel gave none).
func procStatus(pid uint32, key string) []byte {
	if pid == 0 {
		return nil
	}
	status, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/status")
	if err != nil {
		return nil
	}
	for line := range bytes.Lines(status) {
		if rest, ok := bytes.CutPrefix(line, []byte(key)); ok {
			return rest
		}
	}
	return nil
}
