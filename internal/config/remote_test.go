package config

import (
	"net/netip"
	"reflect"
	"testing"
	"time"
)

func TestRemoteDefaults(t *testing.T) {
	r := Default().Remote
	want := Remote{
		Listen:          "", // off: nothing listens unless asked
		AllowFrom:       []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")},
		MaxConnections:  64,
		MaxFailures:     10,
		FailurePrefixV4: 24, // failures count per network, not per address
		FailurePrefixV6: 64,
		MaxMessageSize:  16 << 20,
		Timeout:         10 * time.Second,
	}
	if !reflect.DeepEqual(r, want) {
		t.Errorf("remote defaults = %+v, want %+v", r, want)
	}
}

func TestRemoteValues(t *testing.T) {
	for in, want := range map[string]string{
		`listen = ":7471"`:        ":7471",
		`listen = "[::1]:0"`:      "[::1]:0",
		`listen = "0.0.0.0:7471"`: "0.0.0.0:7471",
	} {
		if got := mustParse(t, "[remote]\n"+in).Remote.Listen; got != want {
			t.Errorf("%s: listen = %q", in, got)
		}
	}
	if r := mustParse(t, "[remote]\nfailure_prefix_v4 = 32\nfailure_prefix_v6 = 128").Remote; r.FailurePrefixV4 != 32 || r.FailurePrefixV6 != 128 {
		t.Errorf("failure prefixes 32, 128 give %d, %d", r.FailurePrefixV4, r.FailurePrefixV6)
	}
	if got := mustParse(t, "[remote]\nallow_from = []").Remote.AllowFrom; got == nil || len(got) != 0 {
		t.Errorf("allow_from = [] gives %v, want an empty list (nobody)", got)
	}
}

func TestRemoteErrors(t *testing.T) {
	for _, c := range []struct{ in, key, msg string }{
		{`listen = "7471"`, "remote.listen", "host:port"},
		{`listen = "localhost:7471"`, "remote.listen", "not an IP address"},
		{`listen = "127.0.0.1:http"`, "remote.listen", "port"},
		{`listen = "127.0.0.1:70000"`, "remote.listen", "port"},
		{`allow_from = "127.0.0.0/8"`, "remote.allow_from", "want a list"},
		{`allow_from = ["localhost"]`, "remote.allow_from", "not a network"},
		{`allow_from = ["10.1.2.3/8"]`, "remote.allow_from", "host bits"},
		{`allow_from = [8]`, "remote.allow_from", "integer"},
		{`failure_prefix_v4 = 0`, "remote.failure_prefix_v4", "1 to 32"},
		{`failure_prefix_v4 = 33`, "remote.failure_prefix_v4", "1 to 32"},
		{`failure_prefix_v6 = 0`, "remote.failure_prefix_v6", "1 to 128"},
		{`failure_prefix_v6 = 129`, "remote.failure_prefix_v6", "1 to 128"},
		{`failure_prefix_v6 = "64"`, "remote.failure_prefix_v6", "integer"},
		{`max_connections = 0`, "remote.max_connections", "at least 1"},
		{`max_message_size = 0`, "remote.max_message_size", "out of range"},
		{`max_message_size = "4GiB"`, "remote.max_message_size", "2 GiB"},
		{`timeout = 10`, "remote.timeout", "quoted duration"},
		{`timeout = "soon"`, "remote.timeout", "not a duration"},
		{`timeout = "0s"`, "remote.timeout", "positive"},
		{`port = 7471`, "remote.port", "unknown key"},
	} {
		wantErr(t, "[remote]\n"+c.in, c.key, c.msg)
	}
}
