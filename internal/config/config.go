package config

import (
	"log/slog"
	"os"

	"mrfs/verbs"
)

// Config is the whole of config.toml. The zero value is not useful; start
// from Default.
type Config struct {
	Verbs   Verbs
	Buffers Buffers
	Mount   Mount
	Log     Log
}

// Verbs is the [verbs] table: which backend and device a mount uses.
type Verbs struct {
	Backend string // verbs.backend: BackendAuto, BackendRDMA or BackendSoft
	Device  string // verbs.device: "" for the first device
	// SoftMaxMR (verbs.soft_max_mr) caps the soft device's regions, to model
	// small devices in tests; 0 keeps the soft device's own default (rxe's
	// 524287). Not part of DESIGN.md's table; the rdma backend refuses it.
	SoftMaxMR int
}

// Buffers is the [buffers] table: what new files get and the limits.
type Buffers struct {
	DefaultSize   Size         // buffers.default_size: bytes a new file gets
	DefaultAccess verbs.Access // buffers.default_access: flags of new files
	AllowedAccess verbs.Access // buffers.allowed_access: flags setfattr may set
	MaxBuffers    int          // buffers.max_buffers: files per mount, 0 no limit
	MaxPinned     Size         // buffers.max_pinned: bytes, 0 no limit but RLIMIT_MEMLOCK
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
}

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

// Default is the configuration of an empty file, as in DESIGN.md and the
// committed config.toml.
func Default() Config {
	return Config{
		Verbs: Verbs{Backend: BackendAuto},
		Buffers: Buffers{
			DefaultAccess: verbs.LocalWrite, // least privilege
			AllowedAccess: verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic,
			MaxBuffers:    65536,
		},
		Mount: Mount{ZeroCopy: true, Umask: 0o077},
		Log:   Log{Level: slog.LevelInfo, Format: FormatText},
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
