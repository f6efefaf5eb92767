package config

import (
	"log/slog"
	"net/netip"
	"os"
	"time"

	"mrfs/verbs"
)

// Config is the whole of config.toml. The zero value is not useful; start
// from Default.
type Config struct {
	Verbs   Verbs
	Buffers Buffers
	Mount   Mount
	Log     Log
	Remote  Remote
	Metrics Metrics
	Publish Publish
}

// Publish is the [publish] table: this host's buffers with remote access,
// published to etcd for peers on other hosts (package publish).
type Publish struct {
	// Endpoints (publish.endpoints) are etcd's client URLs; none: off.
	Endpoints []string
	// Prefix (publish.prefix) begins every key:
	// <prefix>/<host>/<name>/<path>.
	Prefix string
	// Lease (publish.lease) is the TTL of the lease the keys live under:
	// how long they outlive a daemon that dies.
	Lease time.Duration
	// Name (publish.name) is the mount's name in the keys; "": the mount
	// point, without its leading slash.
	Name string
}

// Verbs is the [verbs] table: which backend and device a mount uses.
type Verbs struct {
	Backend string // verbs.backend: BackendAuto, BackendRDMA or BackendSoft
	Device  string // verbs.device: "" for the first device
	// Devices (verbs.devices) registers every buffer on each of these
	// devices, the first one's keys being the file's lkey and rkey; nil:
	// only Device. AllDevices: verbs.devices = "all", every device the
	// backend lists.
	Devices    []string
	AllDevices bool
	// SoftDevices (verbs.soft_devices) is how many soft devices the soft
	// backend makes (soft0, soft1...), to try several NICs without one;
	// 0 or 1: one. The rdma backend refuses it.
	SoftDevices int
	// SoftMaxMR (verbs.soft_max_mr) caps the soft device's regions, to model
	// small devices in tests; 0 keeps the soft device's own default (rxe's
	// 524287). Not part of DESIGN.md's table; the rdma backend refuses it.
	SoftMaxMR int
	// SoftMaxMRSize (verbs.soft_max_mr_size) caps the soft device's region
	// size, to model devices that register at most so much in one region
	// (buffers past it take several); 0: none. The rdma backend refuses it.
	SoftMaxMRSize Size
	// SoftMaxPD (verbs.soft_max_pd) caps the soft device's protection
	// domains (directories); 0 keeps rxe's 1048576. The rdma backend
	// refuses it.
	SoftMaxPD int
}

// Buffers is the [buffers] table: what new files get and the limits.
type Buffers struct {
	DefaultSize   Size         // buffers.default_size: bytes a new file gets
	DefaultAccess verbs.Access // buffers.default_access: flags of new files
	AllowedAccess verbs.Access // buffers.allowed_access: flags setfattr may set
	MaxBuffers    int          // buffers.max_buffers: files per mount, 0 no limit
	// MaxPinned (buffers.max_pinned) is the pinning budget: bytes, or a
	// percentage of the memory the daemon may use; 0 bytes: none.
	MaxPinned Budget
	// MaxPinnedPerUser (buffers.max_pinned_per_user) bounds one uid's
	// registered bytes; 0: no quota.
	MaxPinnedPerUser Size
	// HugePages (buffers.huge_pages) is the store's huge= policy.
	HugePages string
	// PopulateThreshold (buffers.populate_threshold): registrations of at
	// least this many bytes have their new pages populated by
	// PopulateWorkers (buffers.populate_workers; 0: GOMAXPROCS) first;
	// 0: never.
	PopulateThreshold Size
	PopulateWorkers   int
	// MaxRegionSize (buffers.max_region_size) caps one memory region
	// below the device's max_mr_size: larger buffers are registered in
	// several; 0: the device's limit only.
	MaxRegionSize Size
}

// The values of buffers.huge_pages (tmpfs's huge=).
var hugePolicies = []string{"never", "within_size", "always", "advise"}

// Metrics is the [metrics] table.
type Metrics struct {
	// Listen (metrics.listen) is host:port for Prometheus's /metrics;
	// "" (the default) turns it off.
	Listen string
}

// Mount is the [mount] table.
type Mount struct {
	AllowOther bool   // mount.allow_other
	ZeroCopy   bool   // mount.zero_copy: false allows the degraded mode without passthrough
	Umask      uint32 // mount.umask: applied to the mode a creator asks for
}

// Log is the log table of config.toml.
type Log struct {
	Level  slog.Level // log.level: slog.LevelDebug, Info, Warn or Error
	Format string     // log.format: FormatText or FormatJSON
	// Output (log.output) is where the log goes: OutputStderr,
	// OutputSyslog, or an absolute file path (appended to). A daemon in
	// the background has no stderr: there OutputStderr means syslog.
	Output string
	// FuseRequests (log.fuse_requests) logs every FUSE request the daemon
	// receives and its reply, as go-fuse prints them, at debug level.
	FuseRequests bool
}

// Remote is the [remote] table: whether and how peers reach the mount's
// protection domains for one-sided operations (docs/REMOTE.md).
type Remote struct {
	// Listen (remote.listen) is host:port to accept peers on; "" (the
	// default) turns remote access off. Port 0 picks a free port, shown
	// in the user.mrfs.remote xattr.
	Listen string
	// AllowFrom (remote.allow_from) are the networks peers may connect
	// from; others are closed on accept. Default: loopback only.
	AllowFrom []netip.Prefix
	// MaxConnections (remote.max_connections) bounds the peers whose
	// hello and token were accepted.
	MaxConnections int
	// MaxFailures (remote.max_failures) is how many failed attempts
	// (wrong tokens, unknown directories, hellos that break the format or
	// time out, remote access errors) one source network may make within
	// a minute before it is refused for a minute; 0: no limit.
	MaxFailures int
	// FailurePrefixV4 and FailurePrefixV6 (remote.failure_prefix_v4,
	// remote.failure_prefix_v6) are the prefix lengths that make a
	// source network of a peer's address: 24 and 64.
	FailurePrefixV4, FailurePrefixV6 int
	// MaxMessageSize (remote.max_message_size) bounds one READ or WRITE.
	MaxMessageSize Size
	// Timeout (remote.timeout) bounds how long a started frame, the hello
	// and each reply may take: a peer that trickles bytes is cut off.
	Timeout time.Duration
}

// Limits of [remote].
const (
	// MaxMessageLimit is InfiniBand's largest message, 2 GiB.
	MaxMessageLimit = 1 << 31
)

// The values of verbs.backend.
const (
	BackendAuto = "auto"
	BackendRDMA = "rdma"
	BackendSoft = "soft"
)

// The values of log.format.
const (
	FormatText = "text"
	FormatJSON = "json"
)

// The named values of log.output; any other value is a file's path.
const (
	OutputStderr = "stderr"
	OutputSyslog = "syslog"
)

// Default is the configuration of an empty file, as in DESIGN.md and the
// committed config.toml.
func Default() Config {
	return Config{
		Verbs: Verbs{Backend: BackendAuto},
		Buffers: Buffers{
			DefaultAccess: verbs.LocalWrite, // least privilege
			AllowedAccess: verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic,
			MaxBuffers:    65536,
			MaxPinned:     Budget{Percent: 50}, // of the memory the daemon may use, as tmpfs's default
			HugePages:     "within_size",
			// Below this, one thread pins as fast as workers populate.
			PopulateThreshold: 64 << 20,
		},
		Mount:   Mount{ZeroCopy: true, Umask: 0o077},
		Log:     Log{Level: slog.LevelInfo, Format: FormatText, Output: OutputStderr},
		Publish: Publish{Prefix: "/mrfs", Lease: 10 * time.Second},
		Remote: Remote{
			AllowFrom:       []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")},
			MaxConnections:  64,
			MaxFailures:     10,
			FailurePrefixV4: 24,
			FailurePrefixV6: 64,
			MaxMessageSize:  16 << 20,
			Timeout:         10 * time.Second,
		},
	}
}

// Load reads and validates the file at path; "" means no file, Default().
// A missing or unreadable file is a config error too: the user named it.
func Load(path string) (Config, error) {
	if path == "" {
		return Default(), nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, &Error{Path: path, Msg: "cannot read config file: " + err.Error(), Err: err}
	}
	c, err := Parse(data)
	return c, withPath(err, path)
}

// Parse decodes and validates config.toml contents. Keys not present keep
// their defaults.
func Parse(data []byte) (Config, error) {
	c, err := decode(data)
	if err != nil {
		return Config{}, err
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}
