package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestFileXattrFormats: every file xattr, its format, listxattr, desc JSON.
func TestFileXattrFormats(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("rx")
	makeBuffer(t, f, 4<<20)

	v := map[string]string{}
	for _, name := range fileXattrs {
		v[name] = mustXattr(t, f, name)
	}
	for _, name := range []string{xLkey, xRkey, xAddr} {
		if !hexRe.MatchString(v[name]) {
			t.Errorf("%s = %q, want %s", name, v[name], hexRe)
		}
	}
	switch {
	case v[xLkey] == v[xRkey]:
	case !backend.soft() && v[xRkey] == "0x0":
		// rxe before about Linux 6.5 (verbs/verbstest/cases.go).
		backend.differs(t, "a region without remote access has rkey 0 (lkey "+v[xLkey]+")")
	default:
		t.Errorf("keys like rxe's: lkey %q != rkey %q", v[xLkey], v[xRkey])
	}
	if hexRe.MatchString(v[xAddr]) && parseHex(t, v[xAddr])%uint64(pageSize) != 0 {
		t.Errorf("addr %s is not page-aligned", v[xAddr])
	}
	if v[xLength] != "4194304" {
		t.Errorf("length = %q, want 4194304", v[xLength])
	}
	if size := fileSize(t, f); strconv.FormatInt(size, 10) != v[xLength] {
		t.Errorf("length %q != file size %d", v[xLength], size)
	}
	if v[xAccess] != "local_write" {
		t.Errorf("access = %q, want the default local_write", v[xAccess])
	}
	if v[xDevice] != backend.device {
		t.Errorf("device = %q, want %s", v[xDevice], backend.device)
	}
	if !decRe.MatchString(v[xPD]) {
		t.Errorf("pd = %q, want decimal", v[xPD])
	}
	if rootPD := mustXattr(t, d.mnt, xPD); v[xPD] != rootPD {
		t.Errorf("pd = %q, want the root's pd %q", v[xPD], rootPD)
	}
	if v[xState] != "registered" {
		t.Errorf("state = %q, want registered", v[xState])
	}
	if v[xZeroCopy] != "1" {
		t.Errorf("zero_copy = %q, want 1", v[xZeroCopy])
	}
	if want := v[xDevice] + " " + v[xLkey] + " " + v[xRkey] + "\n"; v[xKeys] != want {
		t.Errorf("keys = %q, want the one device's line %q", v[xKeys], want)
	}

	// desc: one JSON object with string keys in the formats above.
	var desc map[string]any
	if err := json.Unmarshal([]byte(v[xDesc]), &desc); err != nil {
		t.Fatalf("desc is not JSON: %v: %q", err, v[xDesc])
	}
	for key, xname := range map[string]string{"device": xDevice, "addr": xAddr, "length": xLength, "lkey": xLkey, "rkey": xRkey} {
		s, ok := desc[key].(string)
		if !ok {
			t.Errorf("desc[%q] = %#v, want a string", key, desc[key])
			continue
		}
		if s != v[xname] {
			t.Errorf("desc[%q] = %q, want %q (as %s)", key, s, v[xname], xname)
		}
	}
	acc, ok := desc["access"].([]any)
	if !ok {
		t.Errorf("desc access = %#v, want a list", desc["access"])
	} else if len(acc) != 1 || acc[0] != "local_write" {
		t.Errorf("desc access = %v, want [local_write]", acc)
	}
	// Numbers: the PD (as user.mrfs.pd), the page size, the generation;
	// and the state as user.mrfs.state.
	if pd, ok := desc["pd"].(float64); !ok || strconv.FormatFloat(pd, 'f', -1, 64) != v[xPD] {
		t.Errorf("desc pd = %#v, want %s", desc["pd"], v[xPD])
	}
	if st, ok := desc["state"].(string); !ok || st != v[xState] {
		t.Errorf("desc state = %#v, want %q", desc["state"], v[xState])
	}
	if ps, ok := desc["page_size"].(float64); !ok || ps != float64(pageSize) && ps != 2<<20 {
		t.Errorf("desc page_size = %#v, want %d or 2 MiB", desc["page_size"], pageSize)
	}
	if g, ok := desc["generation"].(float64); !ok || g < 1 {
		t.Errorf("desc generation = %#v, want a number of registrations", desc["generation"])
	}

	names, err := listxattr(f)
	if err != nil {
		t.Fatalf("listxattr: %v", err)
	}
	for _, name := range fileXattrs {
		if !slices.Contains(names, name) {
			t.Errorf("listxattr(%s) = %v, missing %s", f, names, name)
		}
	}

	// Size probe and a too-small buffer follow the xattr ABI.
	n, err := unix.Getxattr(f, xRkey, nil)
	if err != nil || n != len(v[xRkey]) {
		t.Errorf("getxattr size probe: %d, %v; want %d", n, err, len(v[xRkey]))
	}
	_, err = unix.Getxattr(f, xDesc, make([]byte, 2))
	wantErrno(t, err, unix.ERANGE, "getxattr desc into 2 bytes")
}

// TestEmptyFileXattrs: an empty file has no registration.
func TestEmptyFileXattrs(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	before := readStats(t, d.mnt)
	f := d.path("empty")
	makeBuffer(t, f, 0)
	requireEmpty(t, f)
	// Length = file size; with no registration either "0" or ENODATA is
	// defensible, anything else is wrong.
	if l, err := getxattr(f, xLength); err == nil && l != "0" {
		t.Errorf("length of an empty file = %q, want 0 (or ENODATA)", l)
	} else if err != nil {
		wantErrno(t, err, unix.ENODATA, "length of an empty file")
	}
	if got := mustXattr(t, f, xAccess); got != "local_write" {
		t.Errorf("access = %q, want local_write", got)
	}
	if got := mustXattr(t, f, xDevice); got != backend.device {
		t.Errorf("device = %q, want %s", got, backend.device)
	}
	if got, want := mustXattr(t, f, xPD), mustXattr(t, d.mnt, xPD); got != want {
		t.Errorf("pd = %q, want %q", got, want)
	}
	if got := mustXattr(t, f, xZeroCopy); got != "1" {
		t.Errorf("zero_copy = %q, want 1", got)
	}
	after := readStats(t, d.mnt)
	if after.Buffers != before.Buffers+1 {
		t.Errorf("stats buffers %d -> %d after creating an empty file, want +1", before.Buffers, after.Buffers)
	}
	if after.RegisteredBytes != before.RegisteredBytes || after.PinnedBytes != before.PinnedBytes {
		t.Errorf("an empty file changed registered/pinned bytes: %+v -> %+v", before, after)
	}
}

// TestUnknownXattrENODATA: unknown user.mrfs.* names answer ENODATA.
func TestUnknownXattrENODATA(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	makeBuffer(t, f, 4096)
	if err := os.Mkdir(d.path("dir"), 0o700); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{f, d.mnt, d.path("dir")} {
		_, err := getxattr(p, "user.mrfs.foo")
		wantErrno(t, err, unix.ENODATA, "getxattr user.mrfs.foo on "+p)
	}
	// A file has no stats.
	_, err := getxattr(f, xStats)
	wantErrno(t, err, unix.ENODATA, "getxattr user.mrfs.stats on a file")
}

// TestReadOnlyXattrsEPERM: setting a read-only xattr is EPERM, changes
// nothing, and does not disable setxattr on the mount (no ENOSYS).
func TestReadOnlyXattrsEPERM(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	makeBuffer(t, f, 64<<10)
	if err := os.Mkdir(d.path("dir"), 0o700); err != nil {
		t.Fatal(err)
	}
	before := takeSnapshot(t, d.mnt, f)
	for _, name := range []string{xLkey, xRkey, xAddr, xLength, xDevice, xPD, xState, xZeroCopy, xDesc} {
		wantErrno(t, setxattr(f, name, "0x1"), unix.EPERM, "setxattr "+name+" on a file")
	}
	for _, name := range []string{xStats, xPD, xDevice} {
		wantErrno(t, setxattr(d.mnt, name, "1"), unix.EPERM, "setxattr "+name+" on the root")
	}
	for _, name := range []string{xPD, xDevice} {
		wantErrno(t, setxattr(d.path("dir"), name, "1"), unix.EPERM, "setxattr "+name+" on a directory")
	}
	before.requireSame(t, takeSnapshot(t, d.mnt, f), "setting read-only xattrs")

	// The mount still accepts setxattr afterwards.
	mustSetxattr(t, f, xAccess, "local_write,remote_read")
	if got := mustXattr(t, f, xAccess); got != "local_write,remote_read" {
		t.Errorf("access after set = %q", got)
	}
}

// TestDirXattrs: root and directory xattrs.
func TestDirXattrs(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	dir := d.path("tenant")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	rootPD := mustXattr(t, d.mnt, xPD)
	dirPD := mustXattr(t, dir, xPD)
	for _, pd := range []string{rootPD, dirPD} {
		if !decRe.MatchString(pd) {
			t.Errorf("pd %q is not decimal", pd)
		}
	}
	if rootPD == dirPD {
		t.Errorf("mkdir did not make a new PD: root pd %s == dir pd %s", rootPD, dirPD)
	}
	for _, p := range []string{d.mnt, dir} {
		if got := mustXattr(t, p, xDevice); got != backend.device {
			t.Errorf("%s: device %q, want %s", p, got, backend.device)
		}
		if got := mustXattr(t, p, xDefAcc); got != "local_write" {
			t.Errorf("%s: default_access %q, want local_write", p, got)
		}
		names, err := listxattr(p)
		if err != nil {
			t.Fatalf("listxattr %s: %v", p, err)
		}
		for _, want := range []string{xPD, xDevice, xDefAcc} {
			if !slices.Contains(names, want) {
				t.Errorf("listxattr(%s) = %v, missing %s", p, names, want)
			}
		}
		if p == d.mnt && !slices.Contains(names, xStats) {
			t.Errorf("listxattr(root) = %v, missing %s", names, xStats)
		}
	}
}

// TestDefaultAccess: default_access is settable (forgiving input, canonical
// output) and new files get it.
func TestDefaultAccess(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	dir := d.path("d")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	mustSetxattr(t, dir, xDefAcc, "REMOTE_READ|ibv_access_local_write")
	if got := mustXattr(t, dir, xDefAcc); got != "local_write,remote_read" {
		t.Errorf("dir default_access = %q, want local_write,remote_read", got)
	}
	f := dir + "/f"
	makeBuffer(t, f, 8192)
	if got := mustXattr(t, f, xAccess); got != "local_write,remote_read" {
		t.Errorf("file created after set: access %q, want local_write,remote_read", got)
	}
	// The root's default is separate.
	g := d.path("g")
	makeBuffer(t, g, 8192)
	if got := mustXattr(t, g, xAccess); got != "local_write" {
		t.Errorf("file in root: access %q, want local_write", got)
	}
	mustSetxattr(t, d.mnt, xDefAcc, "local_write,remote_write")
	h := d.path("h")
	makeBuffer(t, h, 0) // gets it even while empty, and keeps it once sized
	if err := os.Truncate(h, 4096); err != nil {
		t.Fatal(err)
	}
	if got := mustXattr(t, h, xAccess); got != "local_write,remote_write" {
		t.Errorf("file created after setting the root's default: access %q", got)
	}
	// An existing file keeps its access.
	if got := mustXattr(t, g, xAccess); got != "local_write" {
		t.Errorf("existing file's access changed to %q", got)
	}
	// An unknown name is EINVAL and the default stays.
	wantErrno(t, setxattr(dir, xDefAcc, "bogus"), unix.EINVAL, "default_access bogus")
	if got := mustXattr(t, dir, xDefAcc); got != "local_write,remote_read" {
		t.Errorf("default_access after a failed set = %q", got)
	}
}

// TestStatsJSON: the root's stats object, its limits and counters that track
// creates, resizes, mkdir/rmdir and unlinks.
func TestStatsJSON(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	raw := mustXattr(t, d.mnt, xStats)
	var m map[string]any
	if err := json.Unmarshal([]byte(raw), &m); err != nil {
		t.Fatalf("stats is not JSON: %v: %s", err, raw)
	}
	for _, k := range []string{"buffers", "pds", "registered_bytes", "pinned_bytes"} {
		if _, ok := m[k].(float64); !ok {
			t.Errorf("stats[%q] = %#v, want a number", k, m[k])
		}
	}
	lim, ok := m["limits"].(map[string]any)
	if !ok {
		t.Fatalf("stats limits = %#v, want an object", m["limits"])
	}
	for _, k := range []string{"max_buffers", "max_pinned", "max_mr", "memlock"} {
		if _, ok := lim[k].(float64); !ok {
			t.Errorf("stats limits[%q] = %#v, want a number", k, lim[k])
		}
	}
	s0 := readStats(t, d.mnt)
	if s0.PID != d.pid() {
		t.Errorf("stats pid = %d, the daemon is %d", s0.PID, d.pid())
	}
	if s0.Backend != backend.name || s0.Device != backend.device {
		t.Errorf("stats backend/device = %q/%q, want %s/%s", s0.Backend, s0.Device, backend.name, backend.device)
	}
	if s0.Buffers != 0 || s0.RegisteredBytes != 0 || s0.PinnedBytes != 0 {
		t.Errorf("fresh mount stats = %+v, want no buffers and 0 bytes", s0)
	}
	if s0.PDs < 1 {
		t.Errorf("stats pds = %d, want >= 1 (the root is a PD)", s0.PDs)
	}
	// max_pinned defaults to 50% of the memory the daemon may use;
	// max_buffers to 65536, or what vm.max_map_count leaves the daemon
	// when less (each registered buffer is one mapping).
	if total := memTotal(t); s0.Limits.MaxBuffers > 65536 || s0.Limits.MaxBuffers < 1024 || s0.Limits.MaxPinned == 0 || s0.Limits.MaxPinned > total/2 {
		t.Errorf("default limits = %+v, want max_buffers at most 65536, max_pinned at most half of MemTotal %d", s0.Limits, total)
	}
	if mmc := readInt(t, "/proc/sys/vm/max_map_count"); s0.Limits.MaxMapCount != mmc || s0.Mappings <= 0 ||
		int64(s0.Limits.MaxBuffers)+s0.Mappings > mmc {
		t.Errorf("max_buffers %d with %d mappings: past vm.max_map_count %d (stats say %d)", s0.Limits.MaxBuffers, s0.Mappings, mmc, s0.Limits.MaxMapCount)
	}
	if s0.Limits.MaxMR == 0 {
		t.Errorf("limits max_mr = 0; the device reports a max_mr")
	}

	makeBuffer(t, d.path("a"), 1<<20)
	makeBuffer(t, d.path("b"), 256<<10)
	s1 := readStats(t, d.mnt)
	if s1.Buffers != 2 || s1.RegisteredBytes != 1<<20+256<<10 || s1.PinnedBytes != 1<<20+256<<10 {
		t.Errorf("after 1 MiB + 256 KiB buffers: %+v", s1)
	}
	if err := os.Truncate(d.path("b"), 512<<10); err != nil {
		t.Fatal(err)
	}
	s2 := readStats(t, d.mnt)
	if s2.Buffers != 2 || s2.RegisteredBytes != 1<<20+512<<10 || s2.PinnedBytes != 1<<20+512<<10 {
		t.Errorf("after growing b to 512 KiB: %+v", s2)
	}
	if err := os.Mkdir(d.path("p"), 0o700); err != nil {
		t.Fatal(err)
	}
	if s := readStats(t, d.mnt); s.PDs != s0.PDs+1 {
		t.Errorf("pds after mkdir = %d, want %d", s.PDs, s0.PDs+1)
	}
	if err := os.Remove(d.path("p")); err != nil {
		t.Fatal(err)
	}
	if s := readStats(t, d.mnt); s.PDs != s0.PDs {
		t.Errorf("pds after rmdir = %d, want %d", s.PDs, s0.PDs)
	}
	if err := os.Remove(d.path("a")); err != nil {
		t.Fatal(err)
	}
	s3 := readStats(t, d.mnt)
	if s3.Buffers != 1 || s3.RegisteredBytes != 512<<10 || s3.PinnedBytes != 512<<10 {
		t.Errorf("after rm a: %+v", s3)
	}
}

// TestStatsLimitsFromConfig: configured limits show in stats. The
// daemon runs under RLIMIT_MEMLOCK 1 MiB but keeps root's CAP_IPC_LOCK,
// with which the kernel lets it pin past that limit: memlock is 0, no
// limit (TestMemlockENOMEM drops the capability and sees 1 MiB).
func TestStatsLimitsFromConfig(t *testing.T) {
	t.Parallel()
	cfg := daemonConfig{
		Buffers: "max_buffers = 7\nmax_pinned = \"3MiB\"\nmax_pinned_per_user = \"1MiB\"",
		Wrapper: []string{"prlimit", "--memlock=1048576:1048576"},
	}
	maxMR := uint64(9)
	if backend.soft() {
		cfg.Verbs = "soft_max_mr = 9"
	} else {
		maxMR = deviceMaxMR(t)
		backend.differs(t, fmt.Sprintf("max_mr is the device's own, %d (verbs.soft_max_mr models the soft device only)", maxMR))
	}
	d := startDaemon(t, cfg)
	capEff := procStatusField(t, d.pid(), "CapEff")
	if caps, err := strconv.ParseUint(capEff, 16, 64); err != nil || caps&(1<<unix.CAP_IPC_LOCK) == 0 {
		t.Fatalf("test setup: the daemon (CapEff %s) lacks root's CAP_IPC_LOCK", capEff)
	}
	s := readStats(t, d.mnt)
	want := statsLimits{MaxBuffers: 7, MaxPinned: 3 << 20, MaxPinnedPerUser: 1 << 20, MaxMR: maxMR, Memlock: 0, OpenFiles: s.Limits.OpenFiles,
		MaxMapCount: readInt(t, "/proc/sys/vm/max_map_count")}
	if s.Limits != want {
		t.Errorf("limits = %+v, want %+v", s.Limits, want)
	}
}

// TestAccessForgivingInput: forgiving input, canonical output, a new
// registration (new keys) on each successful set, desc follows.
func TestAccessForgivingInput(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	makeBuffer(t, f, 64<<10)
	for _, in := range []string{"IBV_ACCESS_LOCAL_WRITE|remote_read", "Local_Write remote_read", "0x5", "remote_read,local_write"} {
		mustSetxattr(t, f, xAccess, "local_write")
		if got := mustXattr(t, f, xAccess); got != "local_write" {
			t.Fatalf("reset to local_write: got %q", got)
		}
		keyBefore := mustXattr(t, f, xLkey)
		rkeyBefore := mustXattr(t, f, xRkey)
		if err := setxattr(f, xAccess, in); err != nil {
			t.Errorf("set access %q: %v", in, err)
			continue
		}
		if got := mustXattr(t, f, xAccess); got != "local_write,remote_read" {
			t.Errorf("access after set %q = %q, want local_write,remote_read", in, got)
		}
		if got := mustXattr(t, f, xLkey); got == keyBefore {
			t.Errorf("set %q: lkey stayed %s; a new registration has new keys", in, got)
		}
		if got := mustXattr(t, f, xRkey); got == rkeyBefore {
			t.Errorf("set %q: rkey stayed %s", in, got)
		}
		requireRegistered(t, f, 64<<10)
		var desc struct {
			Access []string `json:"access"`
		}
		if err := json.Unmarshal([]byte(mustXattr(t, f, xDesc)), &desc); err != nil {
			t.Fatal(err)
		}
		if strings.Join(desc.Access, ",") != "local_write,remote_read" {
			t.Errorf("desc access = %v after set %q", desc.Access, in)
		}
	}
	if s := readStats(t, d.mnt); s.Buffers != 1 || s.RegisteredBytes != 64<<10 || s.PinnedBytes != 64<<10 {
		t.Errorf("re-registrations leaked: stats %+v", s)
	}
}

// TestAccessSetErrors: each bad access value gives its errno and changes
// nothing.
func TestAccessSetErrors(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	makeBuffer(t, f, 64<<10)
	mustSetxattr(t, f, xAccess, "local_write,remote_read")
	for _, c := range []struct {
		in   string
		want unix.Errno
	}{
		{"remote_write", unix.EINVAL},
		{"remote_atomic", unix.EINVAL},
		{"remote_read,remote_write", unix.EINVAL},
		{"bogus", unix.EINVAL},
		{"local_write,bogus", unix.EINVAL},
		{"local_write,mw_bind", unix.EPERM},    // outside the default allowed_access
		{"local_write,zero_based", unix.EPERM}, // outside the default allowed_access
		{"local_write,relaxed_ordering", unix.EPERM},
	} {
		before := takeSnapshot(t, d.mnt, f)
		wantErrno(t, setxattr(f, xAccess, c.in), c.want, "set access "+strconv.Quote(c.in))
		before.requireSame(t, takeSnapshot(t, d.mnt, f), "failed set access "+strconv.Quote(c.in))
	}
}

// TestAccessZeroBasedEOPNOTSUPP: allowed by config, refused by the device.
func TestAccessZeroBasedEOPNOTSUPP(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{
		Buffers: `allowed_access = ["local_write", "remote_read", "remote_write", "remote_atomic", "zero_based"]`,
	})
	f := d.path("f")
	makeBuffer(t, f, 64<<10)
	before := takeSnapshot(t, d.mnt, f)
	wantErrno(t, setxattr(f, xAccess, "local_write,zero_based"), unix.EOPNOTSUPP, "set access local_write,zero_based")
	before.requireSame(t, takeSnapshot(t, d.mnt, f), "failed set access zero_based")
	// Still outside the list: EPERM.
	wantErrno(t, setxattr(f, xAccess, "local_write,mw_bind"), unix.EPERM, "set access local_write,mw_bind")
	before.requireSame(t, takeSnapshot(t, d.mnt, f), "failed set access mw_bind")
}
