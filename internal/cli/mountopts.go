package cli

import (
	"fmt"
	"io"
	"slices"
	"strings"

	"mrfs/internal/config"
)

// mountOptionError is a bad -o option (exit status 2).
type mountOptionError struct{ opt, msg string }

func (e *mountOptionError) Error() string { return fmt.Sprintf("mount option %q: %s", e.opt, e.msg) }

// mountAliases are the short names of the config keys people set most;
// every key may also be given by its dotted name (buffers.max_pinned=1GiB).
var mountAliases = []struct{ name, key string }{
	{"backend", "verbs.backend"},
	{"device", "verbs.device"},
	{"allow_other", "mount.allow_other"},
	{"zero_copy", "mount.zero_copy"},
	{"umask", "mount.umask"},
}

// mountNoEffect are the generic options mrfs accepts and why they change
// nothing; mount(8) and mount.fuse3 pass some of them on every mount.
var mountNoEffect = []struct {
	names []string
	why   string
}{
	{[]string{"rw"}, "mrfs mounts are read-write"},
	{[]string{"dev", "nodev", "suid", "nosuid"}, "mrfs always mounts nodev,nosuid: it holds neither device files nor set-id bits (mount.fuse3 adds dev,suid to every mount)"},
	{[]string{"exec", "async", "default_permissions"}, "what mrfs does anyway"},
	{[]string{"defaults", "auto", "noauto", "_netdev", "nofail"}, "for mount(8) and systemd, which act on them before mrfs runs"},
	{[]string{"noatime", "relatime", "strictatime", "atime", "norelatime", "nostrictatime", "nodiratime", "diratime", "lazytime", "nolazytime"},
		"access times are kept in memory and change only when a client sets them (touch -a, utimensat): reads and listings never update them, " +
			"and there is no disk to write them to lazily; accepted so that everyday fstab lines mount"},
}

// mountRefused are generic options that would mean something mrfs does
// not do: refusing them beats a mount that silently differs.
var mountRefused = map[string]string{
	"ro":      "mrfs has no read-only mode (a new mount is empty; files are created to be registered)",
	"noexec":  "mrfs mounts cannot be noexec",
	"sync":    "mrfs has no storage to write synchronously",
	"dirsync": "mrfs has no storage to write synchronously",
}

// applyMountOptions applies a -o list ("backend=soft,allow_other") to
// cfg, in order: a later option overrides an earlier one. Options named
// x-* or comment=* are for mount(8) and systemd and are skipped; fsname
// is returned, for the mount's source. Call cfg.Validate afterwards.
func applyMountOptions(cfg *config.Config, list string) (fsname string, err error) {
	for _, opt := range strings.Split(list, ",") {
		name, value, hasValue := strings.Cut(opt, "=")
		switch {
		case opt == "", strings.HasPrefix(name, "x-"), name == "comment":
			continue
		case noEffect(name) && !hasValue:
			continue
		case name == "fsname" && value != "":
			fsname = value
			continue
		case mountRefused[name] != "":
			return "", &mountOptionError{opt, mountRefused[name]}
		}
		key := name
		for _, a := range mountAliases {
			if a.name == name {
				key = a.key
			}
		}
		if !strings.Contains(key, ".") { // a dotted key is Set's to judge
			return "", &mountOptionError{opt, fmt.Sprintf("unknown; mrfs takes the configuration keys (%s=...), the short names %s, fsname=, and %s (see MOUNT OPTIONS in `mrfs man`)",
				config.Keys()[0], aliasList(), strings.Join(noEffectNames(), ", "))}
		}
		if !hasValue {
			if !config.IsBool(key) {
				return "", &mountOptionError{opt, fmt.Sprintf("needs a value (%s=...)", name)}
			}
			value = "true"
		}
		if err := cfg.Set(key, value); err != nil {
			return "", fmt.Errorf("mount option %q: %w", opt, err)
		}
	}
	return fsname, nil
}

func noEffect(name string) bool { return slices.Contains(noEffectNames(), name) }

func noEffectNames() []string {
	var names []string
	for _, n := range mountNoEffect {
		names = append(names, n.names...)
	}
	return names
}

func aliasList() string {
	var names []string
	for _, a := range mountAliases {
		names = append(names, a.name)
	}
	return strings.Join(names, ", ")
}

// isHelperCall recognizes how mount.fuse3 runs a filesystem for `mount -t
// fuse.mrfs SOURCE DIR -o OPTIONS`: `mrfs SOURCE DIR -o OPTIONS`, SOURCE
// left out when empty. The first argument is then not a command, and
// mount.fuse3 always passes -o (it adds dev,suid or nodev,nosuid).
func isHelperCall(args []string) bool {
	for _, a := range args[1:] {
		if strings.HasPrefix(a, "-o") {
			return true
		}
	}
	return false
}

// cmdHelper mounts as mount(8) asks, through mount.fuse3: SOURCE is a
// config file, or none/mrfs (or nothing) for the defaults; the options
// are applied over it; and the daemon goes to the background once the
// mount is ready, since mount(8) waits for its helper to exit.
func cmdHelper(args []string, stderr io.Writer) error {
	var pos, opts []string
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "-o" && i+1 < len(args):
			opts = append(opts, args[i+1])
			i++
		case strings.HasPrefix(a, "-o") && a != "-o":
			opts = append(opts, a[2:])
		case strings.HasPrefix(a, "-"):
			return usageError("mount helper: unexpected %q; mount.fuse3 runs `mrfs [SOURCE] MOUNTPOINT -o OPTIONS`", a)
		default:
			pos = append(pos, a)
		}
	}
	var source, dir string
	switch len(pos) {
	case 1:
		dir = pos[0]
	case 2:
		source, dir = pos[0], pos[1]
	default:
		return usageError("mount helper: want [SOURCE] MOUNTPOINT -o OPTIONS, got %d arguments", len(pos))
	}
	if strings.HasPrefix(dir, "/dev/fd/") {
		// mount.fuse3's drop_privileges mounts itself and passes the
		// descriptor; mrfs must mount itself, with CAP_SYS_ADMIN kept
		// for FUSE passthrough.
		return &mountOptionError{"drop_privileges", "not supported: mrfs mounts itself, and needs CAP_SYS_ADMIN for FUSE passthrough"}
	}
	if source != "" && !strings.Contains(source, ",") {
		// mount(8) tells what is mounted by the source (mount -a skips
		// an fstab line whose source is mounted at its mount point).
		opts = append([]string{"fsname=" + source}, opts...)
	}
	margs := []string{"--daemon", "-o", strings.Join(opts, ",")}
	if source != "" && source != "none" && source != "mrfs" {
		margs = append(margs, "--config", source)
	}
	return cmdMount(append(margs, "--", dir), stderr)
}
