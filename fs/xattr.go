package fs

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"

	"mrfs/buffer"
	"mrfs/desc"
	"mrfs/tree"
	"mrfs/verbs"
)

// The extended attributes of DESIGN.md. Everything mrfs shows lives in
// the user.mrfs. namespace; other names hold nothing.
const (
	xattrPrefix        = "user.mrfs."
	xattrLKey          = xattrPrefix + "lkey"
	xattrRKey          = xattrPrefix + "rkey"
	xattrAddr          = xattrPrefix + "addr"
	xattrLength        = xattrPrefix + "length"
	xattrAccess        = xattrPrefix + "access"
	xattrDevice        = xattrPrefix + "device"
	xattrPD            = xattrPrefix + "pd"
	xattrState         = xattrPrefix + "state"
	xattrZeroCopy      = xattrPrefix + "zero_copy"
	xattrDesc          = xattrPrefix + "desc"
	xattrKeys          = xattrPrefix + "keys"
	xattrDefaultAccess = xattrPrefix + "default_access"
	xattrStats         = xattrPrefix + "stats"
	xattrRemote        = xattrPrefix + "remote"
	xattrToken         = xattrPrefix + "token"
)

var (
	fileXattrs = []string{xattrLKey, xattrRKey, xattrAddr, xattrLength, xattrAccess,
		xattrDevice, xattrPD, xattrState, xattrZeroCopy, xattrDesc, xattrKeys}
	dirXattrs  = []string{xattrPD, xattrDevice, xattrDefaultAccess, xattrRemote, xattrToken}
	rootXattrs = append(append([]string{}, dirXattrs...), xattrStats)
)

var (
	_ = (fusefs.NodeGetxattrer)((*bufferNode)(nil))
	_ = (fusefs.NodeSetxattrer)((*bufferNode)(nil))
	_ = (fusefs.NodeListxattrer)((*bufferNode)(nil))
	_ = (fusefs.NodeRemovexattrer)((*bufferNode)(nil))
	_ = (fusefs.NodeGetxattrer)((*dirNode)(nil))
	_ = (fusefs.NodeSetxattrer)((*dirNode)(nil))
	_ = (fusefs.NodeListxattrer)((*dirNode)(nil))
	_ = (fusefs.NodeRemovexattrer)((*dirNode)(nil))
)

// fileXattr returns the value of a file attribute. Keys, address and desc
// exist only while the buffer is registered.
func (n *bufferNode) fileXattr(name string) ([]byte, syscall.Errno) {
	if !strings.HasPrefix(name, xattrPrefix) {
		// e.g. security.capability, asked on every write: no fstat.
		return nil, syscall.ENODATA
	}
	n.sync()
	info, regs := n.f.Buffer().Regions()
	registered := info.State == buffer.Registered
	switch name {
	case xattrLKey, xattrRKey, xattrAddr, xattrDesc, xattrKeys:
		if !registered {
			return nil, syscall.ENODATA
		}
	}
	var v string
	switch name {
	case xattrLKey:
		v = desc.Key(info.LKey).String()
	case xattrRKey:
		v = desc.Key(info.RKey).String()
	case xattrAddr:
		v = desc.Hex(info.Addr).String()
	case xattrLength:
		v = strconv.FormatUint(info.Length, 10)
	case xattrAccess:
		v = info.Access.String()
	case xattrDevice:
		v = n.fsys.mgr.Device().Name()
	case xattrPD:
		v = strconv.FormatUint(uint64(info.PD), 10)
	case xattrState:
		v = desc.State(info) + n.fsys.goneNote()
	case xattrZeroCopy:
		v = boolString(n.fsys.ZeroCopy)
	case xattrDesc:
		return desc.Of(n.fsys.mgr.Device().Name(), info, regs, n.f.Buffer().PageSize(), n.f.DirPath()).JSON(), 0
	case xattrKeys:
		v = keyLines(n.fsys.mgr.Device().Name(), info, regs)
	default:
		return nil, syscall.ENODATA
	}
	return []byte(v), 0
}

// keyLines is user.mrfs.keys: a "DEVICE LKEY RKEY" line per device the
// buffer is registered on (its first region's keys), for scripts.
func keyLines(device string, info buffer.Info, regs []buffer.Region) string {
	var b strings.Builder
	if len(regs) == 0 || len(regs[0].Devices) == 0 {
		fmt.Fprintf(&b, "%s %s %s\n", device, desc.Key(info.LKey), desc.Key(info.RKey))
		return b.String()
	}
	for _, k := range regs[0].Devices {
		fmt.Fprintf(&b, "%s %s %s\n", k.Device, desc.Key(k.LKey), desc.Key(k.RKey))
	}
	return b.String()
}

func boolString(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

func (n *dirNode) dirXattr(name string) ([]byte, syscall.Errno) {
	switch name {
	case xattrPD:
		return []byte(strconv.FormatUint(uint64(n.dir.Domain().PD()), 10)), 0
	case xattrDevice:
		return []byte(n.fsys.mgr.Device().Name()), 0
	case xattrDefaultAccess:
		return []byte(n.dir.Domain().DefaultAccess().String()), 0
	case xattrStats:
		if n.dir.IsRoot() {
			return n.fsys.statsJSON(), 0
		}
	case xattrRemote:
		return []byte(n.remote()), 0
	case xattrPool:
		if p := n.dir.Domain().Pool(); p != nil {
			return []byte(poolString(p.Info())), 0
		}
	}
	return nil, syscall.ENODATA
}

// remote is user.mrfs.remote (docs/REMOTE.md): "off", or the transport,
// the address and the directory a peer names in its hello, e.g.
// "tcp 127.0.0.1:7471 /tenant". The directory comes last so that a
// script may split on the first two spaces whatever the name holds.
func (n *dirNode) remote() string {
	where := ""
	if n.fsys.Remote != nil {
		where = n.fsys.Remote()
	}
	if where == "" {
		return "off"
	}
	return where + " " + n.dir.Path()
}

// getxattr answers with the value, or with its size when dest is too
// small (ERANGE) or empty (a size probe).
func getxattr(dest []byte, v []byte) (uint32, syscall.Errno) {
	if len(dest) == 0 {
		return uint32(len(v)), 0
	}
	if len(dest) < len(v) {
		return uint32(len(v)), syscall.ERANGE
	}
	return uint32(copy(dest, v)), 0
}

func listxattr(dest []byte, names []string) (uint32, syscall.Errno) {
	var b []byte
	for _, n := range names {
		b = append(append(b, n...), 0)
	}
	return getxattr(dest, b)
}

func (n *bufferNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	v, errno := n.fileXattr(attr)
	if errno != 0 {
		return 0, errno
	}
	return getxattr(dest, v)
}

func (n *dirNode) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	if attr == xattrToken {
		// The kernel checked that the caller may read the directory
		// (default_permissions); the token needs more (tree.Dir.Token).
		tok, err := n.dir.Token(caller(ctx))
		if err != nil {
			return 0, toErrno(n.fsys.log, "get token", err)
		}
		return getxattr(dest, []byte(tok))
	}
	v, errno := n.dirXattr(attr)
	if errno != 0 {
		return 0, errno
	}
	return getxattr(dest, v)
}

func (n *bufferNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	n.sync()
	names := fileXattrs
	if n.f.Buffer().Info().State != buffer.Registered {
		names = nil
		for _, x := range fileXattrs {
			switch x {
			case xattrLKey, xattrRKey, xattrAddr, xattrDesc:
			default:
				names = append(names, x)
			}
		}
	}
	return listxattr(dest, names)
}

func (n *dirNode) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	names := dirXattrs
	if n.dir.IsRoot() {
		names = rootXattrs
	}
	if n.dir.Domain().Pool() != nil {
		names = append(slices.Clone(names), xattrPool)
	}
	if _, err := n.dir.Token(caller(ctx)); err != nil {
		// Not listed to whoever may not read it: getfattr -d then
		// reads what it lists without an error.
		names = slices.DeleteFunc(slices.Clone(names), func(x string) bool { return x == xattrToken })
	}
	return listxattr(dest, names)
}

// setxattrCheck gives the errno for setting a name that is not settable:
// EPERM for mrfs's own read-only names, EOPNOTSUPP for names mrfs does
// not store (never ENOSYS, which disables setxattr for the whole mount).
func setxattrCheck(name string) syscall.Errno {
	if strings.HasPrefix(name, xattrPrefix) {
		return syscall.EPERM
	}
	return syscall.EOPNOTSUPP
}

// setAccessXattr sets the one kind of settable attribute, an access list
// (a file's access, a directory's default_access), through set. Any
// other name is refused as setxattrCheck says.
func setAccessXattr(fsys *filesystem, m tree.Node, attr, settable string, data []byte, flags uint32, set func(verbs.Access) error) syscall.Errno {
	if attr != settable {
		return setxattrCheck(attr)
	}
	if flags&xattrCreate != 0 {
		return syscall.EEXIST
	}
	a, err := verbs.ParseAccess(string(data))
	if err == nil {
		err = set(a)
	}
	if err != nil {
		return toErrno(fsys.log, "set "+strings.TrimPrefix(attr, xattrPrefix), err)
	}
	m.Touch(false)
	return 0
}

func (n *bufferNode) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	return setAccessXattr(n.fsys, n.f, attr, xattrAccess, data, flags, n.f.SetAccess)
}

func (n *dirNode) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	if attr == xattrUpgrade && n.dir.IsRoot() {
		return n.setUpgrade(ctx, string(data))
	}
	if attr == xattrRegister {
		return n.setRegister(ctx, data)
	}
	if attr == xattrPool {
		if err := n.setPool(string(data), caller(ctx).UID); err != nil {
			return toErrno(n.fsys.log, "set pool", err)
		}
		n.dir.Touch(true)
		return 0
	}
	return setAccessXattr(n.fsys, n.dir, attr, xattrDefaultAccess, data, flags, n.dir.SetDefaultAccess)
}

// Removexattr: mrfs's attributes always exist and cannot be removed;
// other names never exist.
func (n *bufferNode) Removexattr(ctx context.Context, attr string) syscall.Errno {
	return removexattrErrno(attr)
}

func (n *dirNode) Removexattr(ctx context.Context, attr string) syscall.Errno {
	return removexattrErrno(attr)
}

func removexattrErrno(attr string) syscall.Errno {
	if strings.HasPrefix(attr, xattrPrefix) {
		return syscall.EPERM
	}
	return syscall.ENODATA
}

const xattrCreate = 1 // XATTR_CREATE

// xattrUpgrade, set on the root by root or the mount's owner, upgrades
// the daemon in place to the program the value names ("" the running
// one's path): `mrfs upgrade`. It returns once the upgrade started; stats
// say how it ended (restarts, upgrade_error).
const xattrUpgrade = xattrPrefix + "upgrade"

func (n *dirNode) setUpgrade(ctx context.Context, binary string) syscall.Errno {
	if c := caller(ctx); c.UID != 0 && c.UID != uint32(os.Geteuid()) {
		return syscall.EPERM
	}
	if n.fsys.Upgrade == nil {
		return syscall.EOPNOTSUPP
	}
	return toErrno(n.fsys.log, "upgrade", n.fsys.Upgrade(strings.TrimRight(binary, "\x00\n")))
}

// devices is the names of the devices present (several joined, or one).
func (fsys *filesystem) devices() []string {
	dev := fsys.mgr.Device()
	if m, ok := dev.(interface{ Names() []string }); ok {
		return m.Names()
	}
	return []string{dev.Name()}
}

// gone is the mount's devices that left.
func (fsys *filesystem) gone() []string {
	if fsys.Gone == nil {
		return nil
	}
	return fsys.Gone()
}

// goneNote is what a file's state adds while devices are gone: its keys
// there are withdrawn.
func (fsys *filesystem) goneNote() string {
	g := fsys.gone()
	switch len(g) {
	case 0:
		return ""
	case 1:
		return "; device " + g[0] + " gone"
	}
	return "; devices " + strings.Join(g, ", ") + " gone"
}

// stats is user.mrfs.stats on the root.
type stats struct {
	Backend         string `json:"backend"`
	Device          string `json:"device"`
	ZeroCopy        bool   `json:"zero_copy"`
	Store           string `json:"store"`
	Buffers         int    `json:"buffers"`
	PDs             int    `json:"pds"`
	RegisteredBytes uint64 `json:"registered_bytes"`
	PinnedBytes     uint64 `json:"pinned_bytes"`
	StoreBytes      uint64 `json:"store_bytes"`
	// ChargedBytes is the store memory charged to owners (every page the
	// store holds, charged before it exists), what max_pinned bounds;
	// OpenUnlinked files are unlinked but still open, holding
	// OpenUnlinkedBytes of it.
	ChargedBytes      uint64 `json:"charged_bytes"`
	OpenUnlinked      int    `json:"open_unlinked"`
	OpenUnlinkedBytes uint64 `json:"open_unlinked_bytes"`
	// Mappings are the daemon's memory mappings: each registered buffer
	// is one, and vm.max_map_count (limits.max_map_count) bounds them.
	Mappings int `json:"mappings"`
	// MapRoom is how many more buffers or pool slots vm.max_map_count
	// leaves room for, after the mappings the daemon keeps for itself.
	MapRoom int `json:"map_room"`
	// Regions are the memory regions registered, against max_mr.
	Regions   int                  `json:"regions"`
	OpenFiles int                  `json:"open_files"`
	Limits    statsLimits          `json:"limits"`
	Users     map[string]statsUser `json:"users"`
	// PID is the daemon's process: `mrfs umount` waits for it to exit
	// where the kernel's fdinfo does not name a FUSE connection's server.
	PID int `json:"pid"`
	// Started is when the daemon's program started (RFC 3339), Restarts
	// how many restarts (upgrades in place) the mount survived, and
	// UpgradeError why the last upgrade asked for did not happen.
	Started      string `json:"started,omitempty"`
	Restarts     int    `json:"restarts"`
	UpgradeError string `json:"upgrade_error,omitempty"`
	// Pools are the mount's pools by PD number (DESIGN "Pools").
	Pools map[string]statsPool `json:"pools,omitempty"`
	// Devices are the devices every buffer is registered on, the first
	// one's keys being lkey and rkey; DevicesGone the mount's devices
	// that left and have not come back (DESIGN "Several devices").
	Devices     []string `json:"devices"`
	DevicesGone []string `json:"devices_gone,omitempty"`
}

// statsPool is one pool: its slots, chunks and the chunks' keys.
type statsPool struct {
	SlotSize uint64   `json:"slot_size"`
	Slots    int      `json:"slots"`
	Used     int      `json:"used"`
	Chunks   int      `json:"chunks"`
	RKeys    []string `json:"rkeys"`
	Access   string   `json:"access"`
}

type statsLimits struct {
	MaxBuffers       int    `json:"max_buffers"`
	MaxPinned        uint64 `json:"max_pinned"`
	MaxPinnedPerUser uint64 `json:"max_pinned_per_user"`
	MaxMR            int    `json:"max_mr"`
	MaxMRSize        uint64 `json:"max_mr_size"`
	Memlock          uint64 `json:"memlock"`
	OpenFiles        int    `json:"open_files"`
	MaxMapCount      int    `json:"max_map_count"`
}

type statsUser struct {
	Buffers      int    `json:"buffers"`
	PinnedBytes  uint64 `json:"pinned_bytes"`
	ChargedBytes uint64 `json:"charged_bytes"`
}

func (fsys *filesystem) statsJSON() []byte {
	st := fsys.mgr.Stats()
	opt := fsys.mgr.Options()
	attr := fsys.mgr.Device().Attr()
	users := make(map[string]statsUser, len(st.Users))
	for uid, u := range st.Users {
		users[strconv.FormatUint(uint64(uid), 10)] = statsUser{Buffers: u.Buffers, PinnedBytes: u.PinnedBytes, ChargedBytes: u.Charged}
	}
	var pools map[string]statsPool
	for pd, p := range fsys.mgr.Pools() {
		in := p.Info()
		sp := statsPool{SlotSize: in.Slot, Slots: in.Slots, Used: in.Used, Chunks: in.Chunks, Access: in.Access.String()}
		for _, r := range in.Regions {
			sp.RKeys = append(sp.RKeys, desc.Key(r.RKey).String())
		}
		if pools == nil {
			pools = map[string]statsPool{}
		}
		pools[strconv.FormatUint(uint64(pd), 10)] = sp
	}
	maxMRSize := attr.MaxMRSize
	if maxMRSize == ^uint64(0) {
		maxMRSize = 0 // unlimited
	}
	var life Life
	if fsys.Life != nil {
		life = fsys.Life()
	}
	started := ""
	if !life.Started.IsZero() {
		started = life.Started.Format(time.RFC3339Nano)
	}
	b, err := json.Marshal(stats{
		Started:           started,
		Restarts:          life.Restarts,
		UpgradeError:      life.UpgradeError,
		Pools:             pools,
		Devices:           fsys.devices(),
		DevicesGone:       fsys.gone(),
		Backend:           fsys.Backend,
		Device:            fsys.mgr.Device().Name(),
		ZeroCopy:          fsys.ZeroCopy,
		Store:             st.Store,
		Buffers:           st.Buffers,
		PDs:               st.PDs,
		RegisteredBytes:   st.RegisteredBytes,
		PinnedBytes:       st.PinnedBytes,
		StoreBytes:        st.StoreUsed,
		ChargedBytes:      st.ChargedBytes,
		OpenUnlinked:      st.Orphans,
		OpenUnlinkedBytes: st.OrphanBytes,
		Mappings:          st.Maps,
		MapRoom:           st.MapRoom,
		Regions:           st.Regions,
		OpenFiles:         st.OpenFds,
		Limits: statsLimits{
			MaxBuffers:       opt.MaxBuffers,
			MaxPinned:        opt.MaxPinned,
			MaxPinnedPerUser: opt.MaxPinnedPerUser,
			MaxMR:            attr.MaxMR,
			MaxMRSize:        maxMRSize,
			Memlock:          verbs.MemlockLimit(),
			OpenFiles:        st.MaxOpenFds,
			MaxMapCount:      st.MaxMaps,
		},
		Users: users,
		PID:   os.Getpid(),
	})
	if err != nil {
		panic(fmt.Sprintf("marshal stats: %v", err)) // plain struct: cannot fail
	}
	return b
}
