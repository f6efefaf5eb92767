package rdmacm

import (
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

// A fake /sys/class/infiniband: rxe0 on eth0, rxe1 on eth1 (IPv6 and
// IPv4: IPv4 wins), mlx5_0 on an IB port without a netdev, rxe2 on a
// netdev with a link-local address only.
func TestDeviceAddrs(t *testing.T) {
	sys := t.TempDir()
	for dev, netdev := range map[string]string{"rxe0": "eth0", "rxe1": "eth1", "mlx5_0": "", "rxe2": "eth2"} {
		dir := filepath.Join(sys, dev, "ports", "1", "gid_attrs", "ndevs")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if netdev != "" {
			if err := os.WriteFile(filepath.Join(dir, "0"), []byte(netdev+"\n"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	addrs := map[string][]netip.Addr{
		"eth0": {netip.MustParseAddr("10.0.2.15"), netip.MustParseAddr("fe80::1")},
		"eth1": {netip.MustParseAddr("fd00::3"), netip.MustParseAddr("10.0.3.15")},
		"eth2": {netip.MustParseAddr("fe80::2")},
	}
	got := deviceAddrs(sys, func(n string) []netip.Addr { return addrs[n] })
	want := map[string]netip.Addr{"rxe0": netip.MustParseAddr("10.0.2.15"), "rxe1": netip.MustParseAddr("10.0.3.15")}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("deviceAddrs = %v, want %v", got, want)
	}

	// Bound to every address: each device at its own, with the port.
	all := func() map[string]netip.Addr { return got }
	r := reach(netip.MustParseAddrPort("0.0.0.0:7471"), "", all)
	if len(r) != 2 || r["rxe1"] != netip.MustParseAddrPort("10.0.3.15:7471") || r["rxe0"] != netip.MustParseAddrPort("10.0.2.15:7471") {
		t.Errorf("reach of a wildcard listener = %v", r)
	}
	// Bound to one device's address: that device alone.
	r = reach(netip.MustParseAddrPort("10.0.3.15:7471"), "rxe1", all)
	if len(r) != 1 || r["rxe1"] != netip.MustParseAddrPort("10.0.3.15:7471") {
		t.Errorf("reach of a listener on rxe1's address = %v", r)
	}
}
