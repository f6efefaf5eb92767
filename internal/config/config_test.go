package config

import (
	"errors"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"mrfs/verbs"
)

func mustParse(t *testing.T, s string) Config {
	t.Helper()
	c, err := Parse([]byte(s))
	if err != nil {
		t.Fatalf("Parse(%q): %v", s, err)
	}
	return c
}

// parseErr parses s, requires a config error, and returns its text.
func parseErr(t *testing.T, s string) string {
	t.Helper()
	_, err := Parse([]byte(s))
	if err == nil {
		t.Fatalf("Parse(%q) succeeded, want an error", s)
	}
	if !errors.Is(err, ErrInvalid) {
		t.Errorf("Parse(%q): %v does not match ErrInvalid", s, err)
	}
	var ce *Error
	if !errors.As(err, &ce) {
		t.Errorf("Parse(%q): %v is not an *Error", s, err)
	}
	return err.Error()
}

func wantErr(t *testing.T, s string, parts ...string) {
	t.Helper()
	msg := parseErr(t, s)
	for _, p := range parts {
		if !strings.Contains(msg, p) {
			t.Errorf("Parse(%q) error %q does not mention %q", s, msg, p)
		}
	}
}

func TestDefaults(t *testing.T) {
	d := Default()
	if d.Verbs.Backend != "auto" || d.Verbs.Device != "" || d.Verbs.SoftMaxMR != 0 {
		t.Errorf("verbs defaults: %+v", d.Verbs)
	}
	if d.Buffers.DefaultSize != 0 || d.Buffers.MaxBuffers != 65536 || d.Buffers.MaxPinned != (Budget{Percent: 50}) ||
		d.Buffers.MaxPinnedPerUser != 0 || d.Buffers.HugePages != "within_size" || d.Metrics.Listen != "" {
		t.Errorf("buffers defaults: %+v", d.Buffers)
	}
	if got := d.Buffers.DefaultAccess.String(); got != "local_write" {
		t.Errorf("default_access = %q", got)
	}
	if got := d.Buffers.AllowedAccess.String(); got != "local_write,remote_write,remote_read,remote_atomic" {
		t.Errorf("allowed_access = %q", got)
	}
	if d.Mount.AllowOther || !d.Mount.ZeroCopy || d.Mount.Umask != 0o077 {
		t.Errorf("mount defaults: %+v", d.Mount)
	}
	if d.Log.Level != slog.LevelInfo || d.Log.Format != "text" || d.Log.Output != "stderr" {
		t.Errorf("log defaults: %+v", d.Log)
	}
	if err := d.Validate(); err != nil {
		t.Errorf("Default().Validate(): %v", err)
	}
}

func TestEmptyIsDefault(t *testing.T) {
	for _, s := range []string{"", "\n# nothing\n", "[verbs]\n[buffers]\n[mount]\n[log]\n"} {
		if c := mustParse(t, s); !reflect.DeepEqual(c, Default()) {
			t.Errorf("Parse(%q) = %+v, want Default()", s, c)
		}
	}
	c, err := Load("")
	if err != nil || !reflect.DeepEqual(c, Default()) {
		t.Errorf(`Load("") = %+v, %v`, c, err)
	}
}

// The committed annotated file and Default() cannot drift apart.
func TestCommittedFileIsDefault(t *testing.T) {
	c, err := Load("../../config.toml")
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, Default()) {
		t.Errorf("config.toml = %+v\nDefault()  = %+v", c, Default())
	}
	// Every key the schema knows is written out in the file.
	data, err := os.ReadFile("../../config.toml")
	if err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	schemaKeys(reflectFile(), "", known)
	for k := range known {
		name := k[strings.LastIndexByte(k, '.')+1:]
		if !strings.Contains(k, ".") {
			name = "[" + k + "]"
		}
		if !strings.Contains(string(data), name) {
			t.Errorf("config.toml does not mention %s", k)
		}
	}
}

func TestValues(t *testing.T) {
	c := mustParse(t, `
[verbs]
backend = "soft"
device = "soft0"
soft_max_mr = 16
soft_max_mr_size = "1GiB"
soft_max_pd = 5

[buffers]
default_size = "64KiB"
default_access = ["local_write", "REMOTE_READ"]
allowed_access = ["IBV_ACCESS_LOCAL_WRITE|remote_read", "0x2", 8]
max_buffers = 10
max_pinned = "1GiB"
max_pinned_per_user = "256MiB"
huge_pages = "always"
populate_threshold = "256MiB"
populate_workers = 3

[mount]
allow_other = true
zero_copy = false
umask = "022"

[log]
level = "debug"
format = "json"
output = "/var/log/mrfs.log"

[remote]
listen = "127.0.0.1:7471"
allow_from = ["10.0.0.0/8", "192.168.1.7", "fd00::/8"]
max_connections = 8
max_failures = 3
failure_prefix_v4 = 16
failure_prefix_v6 = 48
max_message_size = "1MiB"
timeout = "1500ms"

[metrics]
listen = "127.0.0.1:9471"

[publish]
endpoints = ["http://10.0.0.5:2379", "https://etcd.example:2379"]
prefix = "/rdma"
lease = "30s"
name = "gpu/buffers"
`)
	want := Config{
		Publish: Publish{Endpoints: []string{"http://10.0.0.5:2379", "https://etcd.example:2379"}, Prefix: "/rdma", Lease: 30 * time.Second, Name: "gpu/buffers"},
		Verbs:   Verbs{Backend: "soft", Device: "soft0", SoftMaxMR: 16, SoftMaxMRSize: 1 << 30, SoftMaxPD: 5},
		Buffers: Buffers{
			DefaultSize:       65536,
			DefaultAccess:     verbs.LocalWrite | verbs.RemoteRead,
			AllowedAccess:     verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic,
			MaxBuffers:        10,
			MaxPinned:         Budget{Bytes: 1 << 30},
			MaxPinnedPerUser:  256 << 20,
			HugePages:         "always",
			PopulateThreshold: 256 << 20,
			PopulateWorkers:   3,
		},
		Mount: Mount{AllowOther: true, ZeroCopy: false, Umask: 0o022},
		Log:   Log{Level: slog.LevelDebug, Format: "json", Output: "/var/log/mrfs.log"},
		Remote: Remote{
			Listen:          "127.0.0.1:7471",
			AllowFrom:       []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.1.7/32"), netip.MustParsePrefix("fd00::/8")},
			MaxConnections:  8,
			MaxFailures:     3,
			FailurePrefixV4: 16,
			FailurePrefixV6: 48,
			MaxMessageSize:  1 << 20,
			Timeout:         1500 * time.Millisecond,
		},
		Metrics: Metrics{Listen: "127.0.0.1:9471"},
	}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got  %+v\nwant %+v", c, want)
	}
}

func TestSizeKeys(t *testing.T) {
	for in, want := range map[string]Size{
		`4096`: 4096, `"4096"`: 4096, `"0"`: 0, `0`: 0, `"64KiB"`: 65536, `"1GiB"`: 1 << 30, `"3 MiB"`: 3 << 20,
	} {
		c := mustParse(t, "[buffers]\nmax_pinned = "+in)
		if c.Buffers.MaxPinned != (Budget{Bytes: want}) {
			t.Errorf("max_pinned = %s: got %v, want %d", in, c.Buffers.MaxPinned, want)
		}
		c = mustParse(t, "[buffers]\nmax_pinned_per_user = "+in)
		if c.Buffers.MaxPinnedPerUser != want {
			t.Errorf("max_pinned_per_user = %s: got %d, want %d", in, c.Buffers.MaxPinnedPerUser, want)
		}
		c = mustParse(t, "[buffers]\ndefault_size = "+in)
		if c.Buffers.DefaultSize != want {
			t.Errorf("default_size = %s: got %d, want %d", in, c.Buffers.DefaultSize, want)
		}
	}
	wantErr(t, "[buffers]\nmax_pinned = -1", "buffers.max_pinned", "negative")
	wantErr(t, "[buffers]\nmax_pinned = \"64KB\"", "buffers.max_pinned", "ambiguous")
	wantErr(t, "[buffers]\nmax_pinned = \"64XB\"", "buffers.max_pinned", "unknown unit")
	wantErr(t, "[buffers]\ndefault_size = \"1.5MiB\"", "buffers.default_size", "fractions")
	wantErr(t, "[buffers]\ndefault_size = 1.5", "buffers.default_size", "float")
	wantErr(t, "[buffers]\ndefault_size = true", "buffers.default_size", "boolean")
	wantErr(t, "[buffers]\nmax_pinned = \"16EiB\"", "buffers.max_pinned", "too large")
	wantErr(t, "[buffers]\nmax_pinned = \"99999999999999999999\"", "buffers.max_pinned", "too large")
}

// max_pinned takes a percentage of the memory the daemon may use,
// resolved at mount in whole pages.
func TestBudget(t *testing.T) {
	for in, want := range map[string]Budget{`"50%"`: {Percent: 50}, `"12.5 %"`: {Percent: 12.5}, `"100%"`: {Percent: 100}, `"0"`: {}, `"2GiB"`: {Bytes: 2 << 30}} {
		c := mustParse(t, "[buffers]\nmax_pinned = "+in)
		if c.Buffers.MaxPinned != want {
			t.Errorf("max_pinned = %s: got %+v, want %+v", in, c.Buffers.MaxPinned, want)
		}
	}
	if got := (Budget{Percent: 50}).Resolve(1<<30+4095, 4096); got != 1<<29 {
		t.Errorf("50%% of 1 GiB + 4095: %d", got)
	}
	if got := (Budget{Percent: 12.5}).Resolve(24<<30, 4096); got != 3<<30 {
		t.Errorf("12.5%% of 24 GiB: %d", got)
	}
	if got := (Budget{Bytes: 1000}).Resolve(24<<30, 4096); got != 1000 {
		t.Errorf("bytes resolve to %d", got)
	}
	if s := (Budget{Percent: 50}).String(); s != "50%" {
		t.Errorf("String %q", s)
	}
	for _, bad := range []string{`"0%"`, `"101%"`, `"-5%"`, `"x%"`, `"%"`} {
		wantErr(t, "[buffers]\nmax_pinned = "+bad, "buffers.max_pinned", "percentage")
	}
	wantErr(t, "[buffers]\nhuge_pages = \"sometimes\"", "buffers.huge_pages", "never, within_size, always or advise")
	wantErr(t, "[metrics]\nlisten = \"localhost:9\"", "metrics.listen", "not an IP address")
	for _, name := range []string{"/mnt/a", "mnt/", "a//b", "a/../b", "./a"} {
		wantErr(t, "[remote]\nlisten = \"127.0.0.1:0\"\n[publish]\nendpoints = [\"http://127.0.0.1:2379\"]\nname = \""+name+"\"", "publish.name", "no leading or trailing /")
	}
	wantErr(t, "[buffers]\ndefault_size = \"2MiB\"\nmax_pinned_per_user = \"1MiB\"", "buffers.default_size", "max_pinned_per_user")
}

func TestUnknownKeys(t *testing.T) {
	wantErr(t, "[buffers]\nmax_bufers = 1", "buffers.max_bufers", "unknown key", "max_buffers")
	wantErr(t, "[verbs]\nbackend = \"soft\"\ncolour = 1", "verbs.colour", "unknown key")
	wantErr(t, "[verbs]\nBackend = \"soft\"", "verbs.Backend", "case sensitive", "verbs.backend")
	wantErr(t, "verbose = true", "verbose", "unknown key")
	msg := parseErr(t, "[extra]\na = 1\nb = 2\n[buffers]\nmax_bufers = 1\n")
	if strings.Count(msg, "extra") != 1 || strings.Count(msg, "buffers.max_bufers") != 1 {
		t.Errorf("unknown table error %q: want the table and the other key named once each", msg)
	}
}

func TestSyntaxAndTypeErrors(t *testing.T) {
	msg := parseErr(t, "[buffers]\nmax_buffers = = 1\n")
	if !strings.Contains(msg, "line 2") {
		t.Errorf("syntax error %q does not give the line", msg)
	}
	wantErr(t, "[buffers]\nmax_buffers = \"many\"", "buffers.max_buffers")
	wantErr(t, "[mount]\nzero_copy = \"yes\"", "mount.zero_copy")
	wantErr(t, "verbs = 1", "verbs", "got a TOML integer, want a table")
	if msg := parseErr(t, "verbs = 1"); strings.Contains(msg, "struct") {
		t.Errorf("error %q speaks Go, not TOML", msg)
	}
	wantErr(t, "[log]\nformat = 1", "line 2", "log.format", "got a TOML integer, want a TOML string")
}

func TestValidation(t *testing.T) {
	wantErr(t, `verbs.backend = "ibverbs"`, "verbs.backend", `"ibverbs"`, "auto, rdma or soft")
	wantErr(t, `verbs.backend = "Soft"`, "verbs.backend", `"Soft"`)
	wantErr(t, "verbs.soft_max_mr = -1", "verbs.soft_max_mr", "-1")
	wantErr(t, "verbs.soft_max_mr = 16777216", "verbs.soft_max_mr", "16777216")
	wantErr(t, "[verbs]\nbackend = \"rdma\"\nsoft_max_mr = 8", "verbs.soft_max_mr", "soft backend")
	mustParse(t, "[verbs]\nbackend = \"auto\"\nsoft_max_mr = 8")
	wantErr(t, "verbs.soft_max_mr_size = 100", "verbs.soft_max_mr_size", "less than a page")
	wantErr(t, "[verbs]\nbackend = \"rdma\"\nsoft_max_mr_size = \"1GiB\"", "verbs.soft_max_mr_size", "soft backend")
	wantErr(t, "verbs.soft_max_pd = -1", "verbs.soft_max_pd", "-1")
	wantErr(t, "[verbs]\nbackend = \"rdma\"\nsoft_max_pd = 4", "verbs.soft_max_pd", "soft backend")
	wantErr(t, "buffers.populate_workers = -1", "buffers.populate_workers", "-1")
	wantErr(t, "buffers.populate_workers = 257", "buffers.populate_workers", "257")
	mustParse(t, "buffers.populate_workers = 256\nbuffers.populate_threshold = 0")

	wantErr(t, `buffers.default_access = ["local_write", "remote_reed"]`, "buffers.default_access", "remote_reed", "local_write, remote_write")
	wantErr(t, `buffers.allowed_access = ["bogus"]`, "buffers.allowed_access", "bogus")
	wantErr(t, `buffers.allowed_access = [1.5]`, "buffers.allowed_access", "float")
	wantErr(t, `buffers.allowed_access = [-1]`, "buffers.allowed_access", "out of range")
	wantErr(t, `buffers.allowed_access = true`, "buffers.allowed_access", "boolean")
	wantErr(t, `buffers.allowed_access = ["0x800"]`, "buffers.allowed_access", "0x800", "no device accepts")
	wantErr(t, `buffers.default_access = ["0x800"]`, "buffers.default_access", "0x800", "no device accepts")
	wantErr(t, `buffers.default_access = ["remote_write"]`, "buffers.default_access", "remote_write", "need local_write")
	wantErr(t, `buffers.default_access = ["local_write", "mw_bind"]`, "buffers.default_access", "subset", "mw_bind")
	wantErr(t, "[buffers]\nallowed_access = []", "buffers.default_access", "subset")
	// Allowed access is a set of permissions: remote_write alone is legal.
	c := mustParse(t, "[buffers]\nallowed_access = [\"remote_write\"]\ndefault_access = []")
	if c.Buffers.AllowedAccess != verbs.RemoteWrite || c.Buffers.DefaultAccess != 0 {
		t.Errorf("got %+v", c.Buffers)
	}
	// A single string is accepted too, in the xattr's own format.
	if c := mustParse(t, `buffers.default_access = "local_write,remote_read"`); c.Buffers.DefaultAccess != verbs.LocalWrite|verbs.RemoteRead {
		t.Errorf("got %s", c.Buffers.DefaultAccess)
	}

	wantErr(t, "buffers.max_buffers = -5", "buffers.max_buffers", "-5")
	if c := mustParse(t, "buffers.max_buffers = 0"); c.Buffers.MaxBuffers != 0 {
		t.Errorf("max_buffers 0: got %d", c.Buffers.MaxBuffers)
	}
	wantErr(t, "[buffers]\ndefault_size = \"2MiB\"\nmax_pinned = \"1MiB\"", "buffers.default_size", "2 MiB", "1 MiB")

	wantErr(t, "mount.umask = 22", "mount.umask", "22", "quoted octal")
	wantErr(t, "mount.umask = 0o22", "mount.umask", "18", "quoted octal")
	wantErr(t, `mount.umask = "089"`, "mount.umask", `"089"`, "octal")
	wantErr(t, `mount.umask = ""`, "mount.umask", "octal")
	wantErr(t, `mount.umask = "-7"`, "mount.umask", "octal")
	wantErr(t, `mount.umask = "1777"`, "mount.umask", "0777")
	for in, want := range map[string]uint32{`"0"`: 0, `"022"`: 0o22, `"0o027"`: 0o27, `"777"`: 0o777, `"0077"`: 0o77} {
		if c := mustParse(t, "mount.umask = "+in); c.Mount.Umask != want {
			t.Errorf("umask %s: got %o, want %o", in, c.Mount.Umask, want)
		}
	}

	wantErr(t, `log.level = "verbose"`, "log.level", `"verbose"`, "debug, info, warn or error")
	wantErr(t, `log.level = "INFO"`, "log.level")
	wantErr(t, `log.format = "xml"`, "log.format", `"xml"`, "text or json")
	wantErr(t, `log.output = "mrfs.log"`, "log.output", `"mrfs.log"`, "absolute")
	wantErr(t, `log.output = ""`, "log.output", "stderr, syslog or an absolute file path")
	wantErr(t, `log.output = "/var/log/"`, "log.output", "directory")
	wantErr(t, `log.output = "Syslog"`, "log.output", `"Syslog"`)
	if c := mustParse(t, `log.output = "syslog"`); c.Log.Output != OutputSyslog {
		t.Errorf("log.output = syslog: got %q", c.Log.Output)
	}
	wantErr(t, "[log]\nfuse_requests = true", "log.fuse_requests", `log.level = "debug"`)
	wantErr(t, "[buffers]\nmax_region_size = 100", "buffers.max_region_size", "less than a page")
	if c := mustParse(t, "[buffers]\nmax_region_size = \"64KiB\""); c.Buffers.MaxRegionSize != 64<<10 {
		t.Errorf("buffers.max_region_size = 64KiB: got %d", c.Buffers.MaxRegionSize)
	}
	if c := mustParse(t, "[log]\nlevel = \"debug\"\nfuse_requests = true"); !c.Log.FuseRequests {
		t.Errorf("log.fuse_requests = true: not set")
	}
	for in, want := range map[string]slog.Level{"debug": slog.LevelDebug, "info": slog.LevelInfo, "warn": slog.LevelWarn, "error": slog.LevelError} {
		if c := mustParse(t, `log.level = "`+in+`"`); c.Log.Level != want {
			t.Errorf("level %s: got %v", in, c.Log.Level)
		}
	}
}

func TestAllProblemsReported(t *testing.T) {
	_, err := Parse([]byte("verbs.backend = \"x\"\nlog.format = \"y\"\n"))
	msg := err.Error()
	if !strings.Contains(msg, "verbs.backend") || !strings.Contains(msg, "log.format") {
		t.Errorf("error %q does not report both problems", msg)
	}
}

func TestValidateAfterOverride(t *testing.T) {
	c := Default()
	c.Verbs.Backend = "nic"
	c.Log.Level = slog.LevelInfo + 1
	c.Mount.Umask = 0o1000
	err := c.Validate()
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("Validate: %v", err)
	}
	for _, k := range []string{"verbs.backend", "log.level", "mount.umask"} {
		if !strings.Contains(err.Error(), k) {
			t.Errorf("error %q does not mention %s", err, k)
		}
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "mrfs.toml")
	if err := os.WriteFile(path, []byte("[buffers]\nmax_bufers = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := Load(path)
	var ce *Error
	if !errors.As(err, &ce) || ce.Path != path || ce.Key != "buffers.max_bufers" {
		t.Fatalf("Load: %#v", err)
	}
	if !strings.HasPrefix(err.Error(), path+": buffers.max_bufers: ") {
		t.Errorf("error %q does not start with the path and key", err)
	}

	if err := os.WriteFile(path, []byte("[log]\nlevel = \"warn\"\nformat = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = Load(path)
	if !errors.As(err, &ce) || ce.Path != path || ce.Line != 3 {
		t.Errorf("type error: %#v (%v)", err, err)
	}

	_, err = Load(filepath.Join(dir, "missing.toml"))
	if !errors.Is(err, ErrInvalid) || !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "missing.toml") {
		t.Errorf("missing file: %v", err)
	}
}

// verbs.devices is a list of names or "all", never with verbs.device;
// verbs.soft_devices is the soft backend's.
func TestDevices(t *testing.T) {
	if c := mustParse(t, "verbs.devices = [\"rxe0\", \"rxe1\"]"); !slices.Equal(c.Verbs.Devices, []string{"rxe0", "rxe1"}) || c.Verbs.AllDevices {
		t.Errorf("devices list: %+v", c.Verbs)
	}
	if c := mustParse(t, "verbs.devices = \"all\""); c.Verbs.Devices != nil || !c.Verbs.AllDevices {
		t.Errorf("devices all: %+v", c.Verbs)
	}
	if c := mustParse(t, "[verbs]\nbackend = \"soft\"\nsoft_devices = 2"); c.Verbs.SoftDevices != 2 {
		t.Errorf("soft_devices: %+v", c.Verbs)
	}
	wantErr(t, "verbs.devices = \"rxe0\"", "verbs.devices", "list")
	wantErr(t, "verbs.devices = []", "verbs.devices", "empty")
	wantErr(t, "verbs.devices = [\"a\", \"a\"]", "verbs.devices", "twice")
	wantErr(t, "[verbs]\ndevice = \"rxe0\"\ndevices = [\"rxe1\", \"rxe0\"]", "verbs.devices", "verbs.device")
	wantErr(t, "[verbs]\ndevice = \"rxe0\"\ndevices = \"all\"", "verbs.devices", "verbs.device")
	if c := mustParse(t, "[verbs]\ndevice = \"rxe0\"\ndevices = [\"rxe0\", \"rxe1\"]"); len(c.Verbs.Devices) != 2 {
		t.Errorf("verbs.device that is the first of verbs.devices: %+v", c.Verbs)
	}
	wantErr(t, "verbs.soft_devices = -1", "verbs.soft_devices", "-1")
	wantErr(t, "[verbs]\nbackend = \"rdma\"\nsoft_devices = 2", "verbs.soft_devices", "soft backend")
}
