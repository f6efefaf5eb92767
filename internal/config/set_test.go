package config

import (
	"errors"
	"log/slog"
	"net/netip"
	"reflect"
	"strings"
	"testing"

	"mrfs/verbs"
)

func TestKeys(t *testing.T) {
	keys := Keys()
	known := map[string]bool{}
	schemaKeys(reflectFile(), "", known)
	for _, k := range keys {
		if !known[k] || !strings.Contains(k, ".") {
			t.Errorf("Keys() has %q, not a key of the schema", k)
		}
		delete(known, k)
	}
	for k := range known {
		if strings.Contains(k, ".") {
			t.Errorf("Keys() lacks %q", k)
		}
	}
	if keys[0] != "verbs.backend" || keys[len(keys)-1] != "publish.name" {
		t.Errorf("Keys() is not in the file's order: %q", keys)
	}
}

// Set reads each kind of value as the file does, and keeps what it does
// not set.
func TestSet(t *testing.T) {
	c := mustParse(t, "[verbs]\ndevice = \"soft0\"\n")
	for _, kv := range [][2]string{
		{"verbs.backend", "soft"},
		{"verbs.soft_max_mr", "16"},
		{"buffers.default_size", "64KiB"},
		{"buffers.default_access", "local_write|remote_read"},
		{"mount.allow_other", "true"},
		{"mount.zero_copy", "false"},
		{"mount.umask", "022"},
		{"log.level", "debug"},
		{"log.output", "syslog"},
		{"remote.allow_from", "10.0.0.0/8|::1"},
		{"remote.timeout", "2s"},
	} {
		if err := c.Set(kv[0], kv[1]); err != nil {
			t.Errorf("Set(%q, %q): %v", kv[0], kv[1], err)
		}
	}
	want := mustParse(t, `
[verbs]
device = "soft0"
backend = "soft"
soft_max_mr = 16
[buffers]
default_size = "64KiB"
default_access = ["local_write", "remote_read"]
[mount]
allow_other = true
zero_copy = false
umask = "022"
[log]
level = "debug"
output = "syslog"
[remote]
allow_from = ["10.0.0.0/8", "::1"]
timeout = "2s"
`)
	if !reflect.DeepEqual(c, want) {
		t.Errorf("after Set:\n got  %+v\n want %+v", c, want)
	}
	if c.Buffers.DefaultAccess != verbs.LocalWrite|verbs.RemoteRead || c.Log.Level != slog.LevelDebug ||
		c.Remote.AllowFrom[1] != netip.MustParsePrefix("::1/128") {
		t.Errorf("after Set: %+v", c)
	}
}

func TestSetErrors(t *testing.T) {
	for _, tc := range []struct{ key, value, msg string }{
		{"buffers.max_bufers", "1", "unknown key; [buffers] has"},
		{"Verbs.backend", "soft", "case sensitive"},
		{"verbs", "soft", "is a table"},
		{"verbs.backend.x", "1", "unknown key"},
		{"mount.allow_other", "yes", "want true or false"},
		{"buffers.max_buffers", "many", "not a whole number"},
		{"buffers.max_pinned", "1.5GiB", "fractions"},
		{"mount.umask", "99", "octal"},
		{"log.level", "verbose", "not a level"},
		{"remote.allow_from", "localhost", "not a network"},
	} {
		c := Default()
		err := c.Set(tc.key, tc.value)
		var ce *Error
		if !errors.Is(err, ErrInvalid) || !errors.As(err, &ce) {
			t.Errorf("Set(%q, %q) = %v, want a config error", tc.key, tc.value, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.msg) || strings.Contains(err.Error(), "line") {
			t.Errorf("Set(%q, %q) = %q, want it to say %q (and no line of a file the user never wrote)", tc.key, tc.value, err, tc.msg)
		}
		if !reflect.DeepEqual(c, Default()) {
			t.Errorf("Set(%q, %q) failed but changed the config", tc.key, tc.value)
		}
	}
}

// buffers.max_pinned takes a percentage as a mount option too.
func TestSetBudget(t *testing.T) {
	c := Default()
	if err := c.Set("buffers.max_pinned", "25%"); err != nil || c.Buffers.MaxPinned != (Budget{Percent: 25}) {
		t.Errorf("Set 25%%: %v, %+v", err, c.Buffers.MaxPinned)
	}
	if err := c.Set("buffers.max_pinned", "2GiB"); err != nil || c.Buffers.MaxPinned != (Budget{Bytes: 2 << 30}) {
		t.Errorf("Set 2GiB: %v, %+v", err, c.Buffers.MaxPinned)
	}
	if err := c.Set("buffers.max_pinned", "200%"); err == nil {
		t.Error("Set 200% succeeded")
	}
}
