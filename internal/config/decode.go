package config

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/netip"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"mrfs/verbs"
)

// file mirrors config.toml. It differs from Config where the file's form
// is not the Go type's (access lists, the umask string, the level name).
type file struct {
	Verbs struct {
		Backend       string     `toml:"backend"`
		Device        string     `toml:"device"`
		Devices       deviceList `toml:"devices"`
		SoftDevices   int        `toml:"soft_devices"`
		SoftMaxMR     int        `toml:"soft_max_mr"`
		SoftMaxMRSize Size       `toml:"soft_max_mr_size"`
		SoftMaxPD     int        `toml:"soft_max_pd"`
	} `toml:"verbs"`
	Buffers struct {
		DefaultSize       Size       `toml:"default_size"`
		DefaultAccess     accessList `toml:"default_access"`
		AllowedAccess     accessList `toml:"allowed_access"`
		MaxBuffers        int        `toml:"max_buffers"`
		MaxPinned         Budget     `toml:"max_pinned"`
		MaxPinnedPerUser  Size       `toml:"max_pinned_per_user"`
		HugePages         string     `toml:"huge_pages"`
		PopulateThreshold Size       `toml:"populate_threshold"`
		PopulateWorkers   int        `toml:"populate_workers"`
		MaxRegionSize     Size       `toml:"max_region_size"`
	} `toml:"buffers"`
	Mount struct {
		AllowOther bool      `toml:"allow_other"`
		ZeroCopy   bool      `toml:"zero_copy"`
		Umask      octalMode `toml:"umask"`
	} `toml:"mount"`
	Log struct {
		Level        levelName `toml:"level"`
		Format       string    `toml:"format"`
		Output       string    `toml:"output"`
		FuseRequests bool      `toml:"fuse_requests"`
	} `toml:"log"`
	Remote struct {
		Listen         string     `toml:"listen"`
		AllowFrom      prefixList `toml:"allow_from"`
		MaxConnections int        `toml:"max_connections"`
		MaxFailures    int        `toml:"max_failures"`
		FailPrefixV4   int        `toml:"failure_prefix_v4"`
		FailPrefixV6   int        `toml:"failure_prefix_v6"`
		MaxMessageSize Size       `toml:"max_message_size"`
		Timeout        duration   `toml:"timeout"`
	} `toml:"remote"`
	Metrics struct {
		Listen string `toml:"listen"`
	} `toml:"metrics"`
	Publish struct {
		Endpoints []string `toml:"endpoints"`
		Prefix    string   `toml:"prefix"`
		Lease     duration `toml:"lease"`
		Name      string   `toml:"name"`
	} `toml:"publish"`
}

func decode(data []byte) (Config, error) { return decodeOnto(Default(), data) }

// decodeOnto decodes data over d: keys absent from data keep d's values.
func decodeOnto(d Config, data []byte) (Config, error) {
	var f file
	f.Verbs.Backend, f.Verbs.Device, f.Verbs.SoftMaxMR = d.Verbs.Backend, d.Verbs.Device, d.Verbs.SoftMaxMR
	f.Verbs.SoftMaxMRSize, f.Verbs.SoftMaxPD = d.Verbs.SoftMaxMRSize, d.Verbs.SoftMaxPD
	f.Verbs.Devices = deviceList{names: d.Verbs.Devices, all: d.Verbs.AllDevices}
	f.Verbs.SoftDevices = d.Verbs.SoftDevices
	f.Buffers.PopulateThreshold, f.Buffers.PopulateWorkers = d.Buffers.PopulateThreshold, d.Buffers.PopulateWorkers
	f.Buffers.MaxRegionSize = d.Buffers.MaxRegionSize
	f.Buffers.DefaultSize, f.Buffers.MaxBuffers, f.Buffers.MaxPinned = d.Buffers.DefaultSize, d.Buffers.MaxBuffers, d.Buffers.MaxPinned
	f.Buffers.DefaultAccess, f.Buffers.AllowedAccess = accessList(d.Buffers.DefaultAccess), accessList(d.Buffers.AllowedAccess)
	f.Buffers.MaxPinnedPerUser, f.Buffers.HugePages = d.Buffers.MaxPinnedPerUser, d.Buffers.HugePages
	f.Metrics.Listen = d.Metrics.Listen
	f.Publish.Endpoints, f.Publish.Prefix, f.Publish.Lease = d.Publish.Endpoints, d.Publish.Prefix, duration(d.Publish.Lease)
	f.Publish.Name = d.Publish.Name
	f.Mount.AllowOther, f.Mount.ZeroCopy, f.Mount.Umask = d.Mount.AllowOther, d.Mount.ZeroCopy, octalMode(d.Mount.Umask)
	name, _ := knownLevel(d.Log.Level)
	f.Log.Level, f.Log.Format, f.Log.Output = levelName(name), d.Log.Format, d.Log.Output
	f.Log.FuseRequests = d.Log.FuseRequests
	f.Remote.Listen, f.Remote.AllowFrom, f.Remote.MaxConnections = d.Remote.Listen, d.Remote.AllowFrom, d.Remote.MaxConnections
	f.Remote.MaxFailures, f.Remote.FailPrefixV4, f.Remote.FailPrefixV6 = d.Remote.MaxFailures, d.Remote.FailurePrefixV4, d.Remote.FailurePrefixV6
	f.Remote.MaxMessageSize, f.Remote.Timeout = d.Remote.MaxMessageSize, duration(d.Remote.Timeout)

	md, err := toml.Decode(string(data), &f)
	if err != nil {
		return Config{}, decodeError(err)
	}
	if err := checkKeys(md); err != nil {
		return Config{}, err
	}
	level, _ := parseLevel(string(f.Log.Level)) // checked by UnmarshalTOML
	return Config{
		Verbs: Verbs{Backend: f.Verbs.Backend, Device: f.Verbs.Device, Devices: f.Verbs.Devices.names, AllDevices: f.Verbs.Devices.all,
			SoftDevices: f.Verbs.SoftDevices, SoftMaxMR: f.Verbs.SoftMaxMR, SoftMaxMRSize: f.Verbs.SoftMaxMRSize, SoftMaxPD: f.Verbs.SoftMaxPD},
		Buffers: Buffers{
			DefaultSize:       f.Buffers.DefaultSize,
			DefaultAccess:     verbs.Access(f.Buffers.DefaultAccess),
			AllowedAccess:     verbs.Access(f.Buffers.AllowedAccess),
			MaxBuffers:        f.Buffers.MaxBuffers,
			MaxPinned:         f.Buffers.MaxPinned,
			MaxPinnedPerUser:  f.Buffers.MaxPinnedPerUser,
			HugePages:         f.Buffers.HugePages,
			PopulateThreshold: f.Buffers.PopulateThreshold,
			PopulateWorkers:   f.Buffers.PopulateWorkers,
			MaxRegionSize:     f.Buffers.MaxRegionSize,
		},
		Mount: Mount{AllowOther: f.Mount.AllowOther, ZeroCopy: f.Mount.ZeroCopy, Umask: uint32(f.Mount.Umask)},
		Log:   Log{Level: level, Format: f.Log.Format, Output: f.Log.Output, FuseRequests: f.Log.FuseRequests},
		Remote: Remote{
			Listen:          f.Remote.Listen,
			AllowFrom:       f.Remote.AllowFrom,
			MaxConnections:  f.Remote.MaxConnections,
			MaxFailures:     f.Remote.MaxFailures,
			FailurePrefixV4: f.Remote.FailPrefixV4,
			FailurePrefixV6: f.Remote.FailPrefixV6,
			MaxMessageSize:  f.Remote.MaxMessageSize,
			Timeout:         time.Duration(f.Remote.Timeout),
		},
		Metrics: Metrics{Listen: f.Metrics.Listen},
		Publish: Publish{Endpoints: nilIfEmpty(f.Publish.Endpoints), Prefix: f.Publish.Prefix, Lease: time.Duration(f.Publish.Lease),
			Name: f.Publish.Name},
	}, nil
}

// decodeError turns the decoder's error into an *Error with the key and
// line it reports, in the file's terms rather than Go's: the user wrote a
// config file, not input for a library.
func decodeError(err error) error {
	var pe toml.ParseError
	if errors.As(err, &pe) {
		return &Error{Line: pe.Position.Line, Key: pe.LastKey, Msg: pe.Message, Err: err}
	}
	// Type mismatches come as plain errors: `toml: line N (last key "k"): msg`.
	e := &Error{Msg: strings.TrimPrefix(err.Error(), "toml: "), Err: err}
	if m := typeErrorRE.FindStringSubmatch(err.Error()); m != nil {
		e.Line, _ = strconv.Atoi(m[1])
		e.Key = m[2]
		e.Msg = m[3]
		if t := badTypeRE.FindStringSubmatch(e.Msg); t != nil {
			e.Msg = fmt.Sprintf("got a TOML %s, want a TOML %s", goTypeNames.Replace(t[1]), t[2])
		} else if t := tableTypeRE.FindStringSubmatch(e.Msg); t != nil {
			e.Msg = fmt.Sprintf("got a TOML %s, want a table", goTypeNames.Replace(t[1]))
		}
	}
	return e
}

var (
	typeErrorRE = regexp.MustCompile(`^toml: (?:line (\d+) )?\(last key "([^"]*)"\): (.*)$`)
	tableTypeRE = regexp.MustCompile(`^type mismatch for .*: expected table but found (.*)$`)
	badTypeRE   = regexp.MustCompile(`^incompatible types: TOML value has type (.*); destination has type (.*)$`)
	goTypeNames = strings.NewReplacer("int64", "integer", "float64", "float", "bool", "boolean",
		"[]map[string]any", "array of tables", "map[string]any", "table", "[]any", "array", "time.Time", "datetime")
)

// checkKeys refuses keys the schema does not have: the decoder's undecoded
// keys, and keys it matched only by ignoring case (TOML keys are case
// sensitive, and "Backend" next to "backend" would be a silent override).
func checkKeys(md toml.MetaData) error {
	known := map[string]bool{}
	schemaKeys(reflect.TypeOf(file{}), "", known)
	var errs []error
	var reported []string
	bad := func(k toml.Key, msg string) {
		s := k.String()
		for _, r := range reported {
			if s == r || strings.HasPrefix(s, r+".") {
				return // already reported, or inside a table already reported
			}
		}
		reported = append(reported, s)
		errs = append(errs, invalid(s, "%s", msg))
	}
	for _, k := range md.Undecoded() {
		bad(k, unknownKeyMsg(k, known))
	}
	for _, k := range md.Keys() {
		if !known[k.String()] {
			bad(k, unknownKeyMsg(k, known))
		}
	}
	return join(errs)
}

func unknownKeyMsg(k toml.Key, known map[string]bool) string {
	s := k.String()
	for name := range known {
		if strings.EqualFold(name, s) {
			return fmt.Sprintf("unknown key (keys are case sensitive: did you mean %q?)", name)
		}
	}
	parent := strings.Join(k[:len(k)-1], ".")
	var siblings []string
	for name := range known {
		i := strings.LastIndexByte(name, '.')
		if (i < 0 && parent == "") || (i >= 0 && name[:i] == parent) {
			siblings = append(siblings, name[i+1:])
		}
	}
	if len(siblings) == 0 {
		return "unknown key"
	}
	sort.Strings(siblings)
	where := "the top level"
	if parent != "" {
		where = "[" + parent + "]"
	}
	return fmt.Sprintf("unknown key; %s has %s", where, strings.Join(siblings, ", "))
}

// schemaKeys lists the dotted keys of a toml-tagged struct.
func schemaKeys(t reflect.Type, prefix string, out map[string]bool) {
	for i := range t.NumField() {
		fld := t.Field(i)
		name := prefix + fld.Tag.Get("toml")
		out[name] = true
		if isTable(fld.Type) {
			schemaKeys(fld.Type, name+".", out)
		}
	}
}

// accessList is an access set as config.toml writes it.
type accessList verbs.Access

// accessNames lists the known names for error messages.
var accessNames = strings.Join((verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic |
	verbs.MWBind | verbs.ZeroBased | verbs.OnDemand | verbs.RelaxedOrdering).Names(), ", ")

// deviceList is verbs.devices: a list of device names, or "all".
type deviceList struct {
	names []string
	all   bool
}

func (l *deviceList) UnmarshalTOML(v any) error {
	switch v := v.(type) {
	case string:
		if v != "all" {
			return fmt.Errorf("%q is not a list; use a list of device names such as [\"rxe0\", \"rxe1\"], or \"all\"", v)
		}
		*l = deviceList{all: true}
		return nil
	case []any:
		seen := map[string]bool{}
		var names []string
		for _, it := range v {
			n, ok := it.(string)
			if !ok || n == "" {
				return fmt.Errorf("list element is a TOML %s; want a device name", tomlType(it))
			}
			if seen[n] {
				return fmt.Errorf("device %q is listed twice", n)
			}
			seen[n] = true
			names = append(names, n)
		}
		if len(names) == 0 {
			return fmt.Errorf("the list is empty; name at least one device, or use \"all\"")
		}
		*l = deviceList{names: names}
		return nil
	}
	return fmt.Errorf("got a TOML %s, want a list of device names or \"all\"", tomlType(v))
}

func (a *accessList) UnmarshalTOML(v any) error {
	var items []any
	switch v := v.(type) {
	case []any:
		items = v
	case string, int64:
		items = []any{v}
	default:
		return fmt.Errorf("got a TOML %s, want a list of access names such as [\"local_write\", \"remote_read\"]", tomlType(v))
	}
	var acc verbs.Access
	for _, it := range items {
		switch it := it.(type) {
		case string:
			f, err := verbs.ParseAccess(it)
			if err != nil {
				return fmt.Errorf("unknown access %q; names are %s, or a mask such as \"0x5\"", it, accessNames)
			}
			acc |= f
		case int64:
			if it < 0 || it > math.MaxUint32 {
				return fmt.Errorf("access mask %d is out of range (0 to 0xffffffff)", it)
			}
			acc |= verbs.Access(it)
		default:
			return fmt.Errorf("list element is a TOML %s; want an access name or mask", tomlType(it))
		}
	}
	*a = accessList(acc)
	return nil
}

// octalMode is a permission mask written as a string of octal digits.
type octalMode uint32

func (m *octalMode) UnmarshalTOML(v any) error {
	s, ok := v.(string)
	if !ok {
		if n, isInt := v.(int64); isInt {
			return fmt.Errorf("got the integer %d; write the umask as a quoted octal string such as \"077\" (a bare 22 would be decimal, not 022)", n)
		}
		return fmt.Errorf("got a TOML %s; want a quoted octal string such as \"077\"", tomlType(v))
	}
	digits := strings.TrimPrefix(strings.TrimPrefix(s, "0o"), "0O")
	n, err := strconv.ParseUint(digits, 8, 32)
	if err != nil || digits == "" || strings.ContainsAny(digits, "+-_") {
		return fmt.Errorf("%q is not octal digits; want a string such as \"077\"", s)
	}
	if n > 0o777 {
		return fmt.Errorf("%q is more than 0777; a umask covers only the permission bits", s)
	}
	*m = octalMode(n)
	return nil
}

var levels = []struct {
	name  string
	level slog.Level
}{
	{"debug", slog.LevelDebug},
	{"info", slog.LevelInfo},
	{"warn", slog.LevelWarn},
	{"error", slog.LevelError},
}

// parseLevel reads the four names of levels; slog's own parser also takes
// "INFO+2" and the like, which only invites typos.
func parseLevel(s string) (slog.Level, bool) {
	for _, l := range levels {
		if l.name == s {
			return l.level, true
		}
	}
	return 0, false
}

// knownLevel gives the name of one of the four levels.
func knownLevel(l slog.Level) (string, bool) {
	for _, x := range levels {
		if x.level == l {
			return x.name, true
		}
	}
	return "", false
}

// levelName is log.level as written: one of the four names of levels.
type levelName string

func (l *levelName) UnmarshalTOML(v any) error {
	s, ok := v.(string)
	if !ok {
		return fmt.Errorf("got a TOML %s; want debug, info, warn or error", tomlType(v))
	}
	if _, ok := parseLevel(s); !ok {
		return fmt.Errorf("%q is not a level; use debug, info, warn or error", s)
	}
	*l = levelName(s)
	return nil
}

// prefixList is remote.allow_from: CIDR networks, or single addresses
// (taken as /32 or /128).
type prefixList []netip.Prefix

func (l *prefixList) UnmarshalTOML(v any) error {
	items, ok := v.([]any)
	if !ok {
		return fmt.Errorf("got a TOML %s, want a list of networks such as [\"127.0.0.0/8\", \"::1/128\"]", tomlType(v))
	}
	out := prefixList{} // [] stays an empty list: nobody may connect
	for _, it := range items {
		s, ok := it.(string)
		if !ok {
			return fmt.Errorf("list element is a TOML %s; want a network such as \"10.0.0.0/8\"", tomlType(it))
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return fmt.Errorf("%q is not a network (\"10.0.0.0/8\") or an address (\"10.0.0.1\")", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		if p != p.Masked() {
			return fmt.Errorf("%q has host bits set; did you mean %q?", s, p.Masked())
		}
		out = append(out, p)
	}
	*l = out
	return nil
}

// duration is a Go duration string ("10s", "500ms"); a bare integer is
// refused because its unit would be a guess.
type duration time.Duration

func (d *duration) UnmarshalTOML(v any) error {
	s, ok := v.(string)
	if !ok {
		return fmt.Errorf("got a TOML %s; want a quoted duration such as \"10s\"", tomlType(v))
	}
	t, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration; write e.g. \"10s\" or \"500ms\"", s)
	}
	*d = duration(t)
	return nil
}

// tomlType names a decoded TOML value's type as the file spells it.
func tomlType(v any) string {
	switch v.(type) {
	case string:
		return "string"
	case int64:
		return "integer"
	case float64:
		return "float"
	case bool:
		return "boolean"
	case []any, []map[string]any:
		return "array"
	case map[string]any:
		return "table"
	case time.Time:
		return "datetime"
	}
	return fmt.Sprintf("%T", v)
}

// nilIfEmpty is ss, or nil for an empty list: `endpoints = []` is the
// default's none.
func nilIfEmpty(ss []string) []string {
	if len(ss) == 0 {
		return nil
	}
	return ss
}
