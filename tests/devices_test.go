package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
)

// descDevices is desc's devices list.
type descDevices struct {
	LKey    string `json:"lkey"`
	RKey    string `json:"rkey"`
	Device  string `json:"device"`
	Devices []struct {
		Device  string `json:"device"`
		LKey    string `json:"lkey"`
		RKey    string `json:"rkey"`
		Regions []struct {
			Addr string `json:"addr"`
			RKey string `json:"rkey"`
		} `json:"regions"`
	} `json:"devices"`
}

// keyLines reads user.mrfs.keys as DEVICE -> "LKEY RKEY".
func keyLines(t *testing.T, path string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, l := range strings.Split(strings.TrimSuffix(mustXattr(t, path, "user.mrfs.keys"), "\n"), "\n") {
		f := strings.Fields(l)
		if len(f) != 3 {
			t.Fatalf("user.mrfs.keys line %q: want DEVICE LKEY RKEY", l)
		}
		out[f[0]] = f[1] + " " + f[2]
	}
	return out
}

// With verbs.devices naming two soft devices every buffer is registered
// on both: user.mrfs.keys has a line per device, lkey and rkey are the
// first's, desc lists each device's keys and regions, and an access
// change gives new keys on both.
func TestSeveralDevices(t *testing.T) {
	if !backend.soft() {
		t.Skip("needs two devices: the guest has one rxe device (tests/vm covers rxe)")
	}
	t.Parallel()
	d := startDaemon(t, daemonConfig{Verbs: "soft_devices = 2\ndevices = [\"soft0\", \"soft1\"]", Remote: remoteConfig()})
	peer := d.remotePeer(t)
	f := d.path("f")
	makeBuffer(t, f, 64<<10)

	keys := keyLines(t, f)
	if len(keys) != 2 || keys["soft0"] == "" || keys["soft1"] == "" {
		t.Fatalf("user.mrfs.keys = %v, want a line for soft0 and soft1", keys)
	}
	lkey, rkey := mustXattr(t, f, "user.mrfs.lkey"), mustXattr(t, f, "user.mrfs.rkey")
	if keys["soft0"] != lkey+" "+rkey || keys["soft1"] == keys["soft0"] {
		t.Errorf("keys %v with lkey %s rkey %s: want soft0's to be the file's and soft1's others", keys, lkey, rkey)
	}
	if dev := mustXattr(t, f, "user.mrfs.device"); dev != "soft0" {
		t.Errorf("user.mrfs.device = %q, want the first device", dev)
	}
	var ds descDevices
	if err := json.Unmarshal([]byte(mustXattr(t, f, xDesc)), &ds); err != nil {
		t.Fatal(err)
	}
	if len(ds.Devices) != 2 || ds.Devices[0].Device != "soft0" || ds.Devices[1].Device != "soft1" {
		t.Fatalf("desc devices = %+v, want soft0 then soft1", ds.Devices)
	}
	for _, dv := range ds.Devices {
		if got := dv.LKey + " " + dv.RKey; got != keys[dv.Device] || len(dv.Regions) != 1 || dv.Regions[0].RKey != dv.RKey {
			t.Errorf("desc device %+v, want keys %q and one region with them", dv, keys[dv.Device])
		}
	}

	if err := setxattr(f, xAccess, "local_write,remote_read"); err != nil {
		t.Fatal(err)
	}
	after := keyLines(t, f)
	for dev, k := range keys {
		if after[dev] == "" || after[dev] == k {
			t.Errorf("after an access change %s's keys are %q, were %q: want new keys on every device", dev, after[dev], k)
		}
	}
	// The soft transport serves the first device's regions (DESIGN:
	// remote access per device is not built yet).
	if err := os.WriteFile(f, []byte("abcd"), 0); err != nil {
		t.Fatal(err)
	}
	addr, key := keysOf(t, f)
	c := dialPD(t, peer, "/")
	got := make([]byte, 4)
	if err := c.Read(got, addr, key); err != nil || string(got) != "abcd" {
		t.Errorf("READ with the first device's rkey: %q, %v", got, err)
	}
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}

	// A pool's chunk is registered on both devices too: its files have
	// both devices' keys.
	pool := makePool(t, d, "pool", "4KiB", 4)
	pf := pool + "/a"
	makeBuffer(t, pf, 0)
	if pk := keyLines(t, pf); len(pk) != 2 || pk["soft0"] == "" || pk["soft1"] == "" || pk["soft0"] == pk["soft1"] {
		t.Errorf("a pool file's user.mrfs.keys = %v, want soft0's and soft1's", pk)
	}
	if err := os.RemoveAll(pool); err != nil {
		t.Fatal(err)
	}
	if s := readStats(t, d.mnt); s.Regions != 0 {
		t.Errorf("stats after rm: %d regions, want 0", s.Regions)
	}
}

// mrfs devices lists every soft device verbs.soft_devices makes.
func TestSoftDevicesListed(t *testing.T) {
	cfg := t.TempDir() + "/mrfs.toml"
	if err := os.WriteFile(cfg, []byte("[verbs]\nbackend = \"soft\"\nsoft_devices = 3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, mrfsBin, "devices", "--config", cfg)
	for i := range 3 {
		if !strings.Contains(out, fmt.Sprintf("soft%d", i)) {
			t.Errorf("mrfs devices with soft_devices = 3 does not list soft%d:\n%s", i, out)
		}
	}
}
