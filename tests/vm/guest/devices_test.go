//go:build rdma

package guest

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The second device: rxe1 on the guest's second virtio NIC (eth1), made
// by the test that needs it and deleted after it, so that every other
// test sees rxe0 alone.
const (
	device2 = "rxe1"
	addr0   = "10.0.2.15" // eth0's, rxe0's
	addr1   = "10.0.3.15" // eth1's, rxe1's
)

// addRxe1 gives eth1 its address and makes rxe1 on it until the test
// ends (after the daemon's cleanup, which t.Cleanup runs first).
func addRxe1(t *testing.T) {
	t.Helper()
	run := func(args ...string) error {
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if _, err := os.Stat("/sys/class/net/eth1"); err != nil {
		t.Fatalf("the guest has no eth1 (tests/vm/run gives it a second virtio NIC): %v", err)
	}
	if err := run("ip", "addr", "replace", addr1+"/24", "dev", "eth1"); err != nil {
		t.Fatal(err)
	}
	if err := run("ip", "link", "set", "eth1", "up"); err != nil {
		t.Fatal(err)
	}
	if err := run("rdma", "link", "add", device2, "type", "rxe", "netdev", "eth1"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := os.Stat("/sys/class/infiniband/" + device2); err != nil {
			return // the test deleted it
		}
		if err := deleteRxe1(30 * time.Second); err != nil {
			t.Errorf("delete %s: %v", device2, err)
		}
	})
}

// deleteRxe1 runs `rdma link delete rxe1`, which waits until every
// process closed its contexts of rxe1: the daemon must let go of it by
// itself. This test process never opens one (its peers through rxe1 are
// processes of their own): librdmacm keeps a context of a device this
// process connected through until it syncs its list after the device
// went, and that sync, done while the device went, once blocked in the
// kernel for good (6.12, the guest) and held the guest tests until their
// timeout.
func deleteRxe1(within time.Duration) error {
	del := exec.Command("rdma", "link", "delete", device2)
	var out bytes.Buffer
	del.Stdout, del.Stderr = &out, &out
	if err := del.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- del.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("%v: %s", err, out.String())
		}
		return nil
	case <-time.After(within):
		del.Process.Kill()
		return fmt.Errorf("did not complete in %v: a process holds %s", within, device2)
	}
}

// twoDeviceMount mounts on rxe0 and rxe1 with an rdma_cm listener on
// every address; its peer is rxe0's address and the port the listener
// got (user.mrfs.remote: "rdma_cm 0.0.0.0:PORT /").
func twoDeviceMount(t *testing.T, extra string) *remoteDaemon {
	t.Helper()
	d := mountVerbs(t, `devices = ["rxe0", "rxe1"]`, zeroCopy(),
		"[remote]\nlisten = \"0.0.0.0:0\"\nallow_from = [\"10.0.2.0/24\", \"10.0.3.0/24\"]\n\n"+extra)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		where := strings.Fields(getxattr(t, d.dir, "user.mrfs.remote"))
		if len(where) == 3 && where[0] == "rdma_cm" && strings.HasPrefix(where[1], "0.0.0.0:") {
			return &remoteDaemon{daemon: d, peer: addr0 + ":" + strings.TrimPrefix(where[1], "0.0.0.0:")}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no rdma_cm listener 20 s after the mount: user.mrfs.remote %q\n%s", where, d.log)
		}
	}
}

// idsOn is ids on each named device.
func idsOn(t testing.TB, kind string, devs ...string) snapshot {
	t.Helper()
	s := snapshot{}
	for _, dev := range devs {
		for _, e := range rdmaResOn(t, kind, dev) {
			s[e.id(kind)] = true
		}
	}
	return s
}

// deviceKeys reads user.mrfs.keys: "DEVICE LKEY RKEY" per line.
func deviceKeys(t testing.TB, path string) map[string][2]uint64 {
	t.Helper()
	keys := map[string][2]uint64{}
	for _, line := range strings.Split(strings.TrimSpace(getxattr(t, path, "user.mrfs.keys")), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			t.Fatalf("user.mrfs.keys line %q, want DEVICE LKEY RKEY", line)
		}
		l, err1 := strconv.ParseUint(f[1], 0, 32)
		r, err2 := strconv.ParseUint(f[2], 0, 32)
		if err1 != nil || err2 != nil {
			t.Fatalf("user.mrfs.keys line %q: %v %v", line, err1, err2)
		}
		keys[f[0]] = [2]uint64{l, r}
	}
	return keys
}

// TestTwoDevices is issue 22 on real verbs: a mount on rxe0 and rxe1
// registers each buffer on both (one MR per device in the kernel's
// tracking, with the keys user.mrfs.keys shows); rdma_cm listens on
// both devices' addresses; a peer that comes through either device
// writes with that device's keys (mrfs remote --desc picks them from the
// accept) and the bytes are in the client's mapping; the other device's
// rkey used through a device completes with IBV_WC_REM_ACCESS_ERR there;
// after rm neither device lists the buffer, and after the teardown
// neither lists anything of the daemon.
func TestTwoDevices(t *testing.T) {
	requireGuest(t)
	addRxe1(t)
	devs := []string{device, device2}
	mrsBefore, pdsBefore := idsOn(t, "mr", devs...), idsOn(t, "pd", devs...)
	etcdURL := startEtcd(t)
	rd := twoDeviceMount(t, "[publish]\nendpoints = [\""+etcdURL+"\"]\nname = \"m\"\n")
	d := rd.daemon

	// A buffer whose rkeys differ on the two devices (rxe draws a key's
	// low byte at random: 1 in 256 buffers has the same rkey on both).
	var f string
	var keys map[string][2]uint64
	for i := 0; ; i++ {
		f = filepath.Join(d.dir, "rx"+strconv.Itoa(i))
		createSized(t, f, 64<<10)
		if err := unix.Setxattr(f, "user.mrfs.access", []byte("local_write,remote_write,remote_read"), 0); err != nil {
			t.Fatal(err)
		}
		keys = deviceKeys(t, f)
		if len(keys) != 2 {
			t.Fatalf("user.mrfs.keys of %s lists %v, want rxe0 and rxe1", f, keys)
		}
		if keys[device][1] != keys[device2][1] || i == 8 {
			break
		}
	}
	if keys[device][1] == keys[device2][1] {
		t.Fatalf("nine buffers with the same rkey on both devices: %v", keys)
	}
	if l, r := xattrNum(t, f, "user.mrfs.lkey"), xattrNum(t, f, "user.mrfs.rkey"); l != keys[device][0] || r != keys[device][1] {
		t.Errorf("user.mrfs.lkey/rkey %#x/%#x, want rxe0's of user.mrfs.keys %v", l, r, keys)
	}
	// One MR per device, with that device's keys.
	for _, dev := range devs {
		hits := byLKey(rdmaResOn(t, "mr", dev), keys[dev][0])
		if len(hits) != 1 {
			t.Fatalf("%s lists %d MRs with lkey %#x, want 1", dev, len(hits), keys[dev][0])
		}
		if r, _ := hits[0].num("rkey"); r != keys[dev][1] {
			t.Errorf("%s: kernel rkey %#x, user.mrfs.keys %#x", dev, r, keys[dev][1])
		}
		t.Logf("%s: %v", dev, hits[0])
	}

	fh, err := os.OpenFile(f, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	m, err := unix.Mmap(int(fh.Fd()), 0, 64<<10, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	// What the client sees: its mapping with zero copy (the registered
	// pages), else the file.
	seen := func(off, n int) []byte {
		if zeroCopy() {
			return m[off : off+n]
		}
		b := make([]byte, n)
		if _, err := fh.ReadAt(b, int64(off)); err != nil {
			t.Fatal(err)
		}
		return b
	}
	descFile := filepath.Join(t.TempDir(), "desc")
	if err := os.WriteFile(descFile, []byte(getxattr(t, f, "user.mrfs.desc")), 0o600); err != nil {
		t.Fatal(err)
	}
	write := `PEER=$IP:${PEER##*:}; MRFS_TOKEN="$(tok /)" "$MRFS" remote write --peer "$PEER" --pd / --desc @"$DESC" --offset "$OFF" < "$DATA"`
	for i, c := range []struct{ ip, dev string }{{addr0, device}, {addr1, device2}} {
		msg := "written through " + c.dev
		data := filepath.Join(t.TempDir(), "data")
		if err := os.WriteFile(data, []byte(msg), 0o600); err != nil {
			t.Fatal(err)
		}
		off := strconv.Itoa(i * 4096)
		if code, out := cliPeer(t, rd, write, "IP", c.ip, "DESC", descFile, "OFF", off, "DATA", data); code != 0 {
			t.Fatalf("mrfs remote write through %s: exit %d: %s", c.dev, code, out)
		}
		if got := seen(i*4096, len(msg)); !bytes.Equal(got, []byte(msg)) {
			t.Errorf("after a WRITE through %s the client sees %q at %s, want %q", c.dev, got, off, msg)
		}
	}
	if !strings.Contains(d.log.String(), "device="+device2) {
		t.Errorf("the daemon's log names no connection through %s", device2)
	}

	// Published: each device's own address goes with its keys, and the
	// first device's is the entry's (not 0.0.0.0). By name, through
	// each device, with that device's keys.
	host, _ := os.Hostname()
	name := host + "/m/" + filepath.Base(f)
	byName := `echo "$MSG" | MRFS_TOKEN="$(tok /)" "$MRFS" remote write --name "$NAME" --endpoints "$ETCD" --offset "$OFF" --length ${#MSG} ${DEV:+--device "$DEV"}`
	for i, dev := range []string{"", device2} {
		via := map[string]string{"": device, device2: device2}[dev]
		before := accepted(d, via)
		msg := fmt.Sprintf("by name through %q", dev)
		off := 8192 + i*4096
		var code int
		var out string
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
			code, out = cliPeer(t, rd, byName, "NAME", name, "ETCD", etcdURL, "OFF", strconv.Itoa(off), "MSG", msg, "DEV", dev)
			if code == 0 || !strings.Contains(out, "no buffer is published") || time.Now().After(deadline) {
				break
			}
		}
		if code != 0 {
			t.Fatalf("mrfs remote write --name %s --device %q: exit %d: %s", name, dev, code, out)
		}
		if got := seen(off, len(msg)); !bytes.Equal(got, []byte(msg)) {
			t.Errorf("after a WRITE by name through %q the client sees %q, want %q", dev, got, msg)
		}
		if n := accepted(d, via); n != before+1 {
			t.Errorf("--device %q: %d connections accepted through %s, want 1", dev, n-before, via)
		}
	}

	// The other device's rkey, through each device: the NIC refuses it.
	addr := getxattr(t, f, "user.mrfs.addr")
	cross := `PEER=$IP:${PEER##*:}; echo x | MRFS_TOKEN="$(tok /)" "$MRFS" remote write --peer "$PEER" --pd / --addr "$ADDR" --rkey "$RKEY"`
	for _, c := range []struct{ ip, through, other string }{{addr0, device, device2}, {addr1, device2, device}} {
		code, out := cliPeer(t, rd, cross, "IP", c.ip, "ADDR", addr, "RKEY", fmt.Sprintf("%#x", keys[c.other][1]))
		if code != 1 || !strings.HasPrefix(out, "mrfs: IBV_WC_REM_ACCESS_ERR: ") {
			t.Errorf("a WRITE through %s with %s's rkey: exit %d, %s; want exit 1 and IBV_WC_REM_ACCESS_ERR", c.through, c.other, code, out)
		}
	}

	unix.Munmap(m)
	fh.Close()
	entries, err := os.ReadDir(d.dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if err := os.Remove(filepath.Join(d.dir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	for _, dev := range devs {
		if hits := byLKey(rdmaResOn(t, "mr", dev), keys[dev][0]); len(hits) != 0 {
			t.Errorf("after rm, %s still lists the buffer's MR: %v", dev, hits)
		}
	}
	if err := d.stop(t); err != nil {
		t.Fatalf("teardown: %v\n%s", err, d.log)
	}
	for _, kind := range []string{"mr", "pd"} {
		before := map[string]snapshot{"mr": mrsBefore, "pd": pdsBefore}[kind]
		for id := range idsOn(t, kind, devs...) {
			if !before[id] {
				t.Errorf("after the teardown %s %s remains", kind, id)
			}
		}
	}
}

// accepted counts the daemon's rdma_cm connections accepted through dev.
func accepted(d *daemon, dev string) int {
	n := 0
	for _, line := range strings.Split(d.log.String(), "\n") {
		if strings.Contains(line, "rdma_cm connection accepted") && strings.Contains(line, "device="+dev+" ") {
			n++
		}
	}
	return n
}

// startEtcd runs Debian's etcd on loopback for the test and returns its
// client URL.
func startEtcd(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Fatalf("no etcd (Debian's etcd-server; bash tests/vm/run installs it on the host): %v", err)
	}
	const client, peer = "http://127.0.0.1:23791", "http://127.0.0.1:23801"
	var out syncBuffer
	cmd := exec.Command(bin, "--name", "g", "--data-dir", t.TempDir(),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "g="+peer)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if exec.Command(mrfsBin(), "peers", "--endpoints", client).Run() == nil {
			return client
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd did not answer within 60 s:\n%s", out.String())
		}
	}
}

// TestDeviceLeavesAndReturns: `rdma link delete rxe1` while a peer
// works through rxe0. The deletion completes (it waits for every context
// of rxe1, so the daemon must let go of it: its regions, PDs and
// librdmacm's context), the peer's connection through rxe0 goes on
// working with the same keys, user.mrfs.keys and state, `mrfs status`
// and the log say rxe1 is gone. After `rdma link add rxe1`, every buffer
// is registered on the new rxe1 within seconds with new keys, which a
// peer through it uses; rxe0's keys never change; nothing is left
// after rm and the teardown.
func TestDeviceLeavesAndReturns(t *testing.T) {
	requireGuest(t)
	addRxe1(t)
	devs := []string{device, device2}
	mrsBefore, pdsBefore := idsOn(t, "mr", devs...), idsOn(t, "pd", devs...)
	etcdURL := startEtcd(t)
	rd := twoDeviceMount(t, "[publish]\nendpoints = [\""+etcdURL+"\"]\nname = \"m\"\n")
	d := rd.daemon
	f := filepath.Join(d.dir, "rx")
	createSized(t, f, 64<<10)
	if err := unix.Setxattr(f, "user.mrfs.access", []byte(allAccess), 0); err != nil {
		t.Fatal(err)
	}
	keys := deviceKeys(t, f)
	addr := getxattr(t, f, "user.mrfs.addr")
	p0 := startServingPeer(t, rd, "/")
	op := func(format string, a ...any) string {
		t.Helper()
		fmt.Fprintf(p0.in, format+"\n", a...)
		return p0.line(t)
	}
	rkey0 := fmt.Sprintf("%#x", keys[device][1])
	if got := op("write %s %s %x", addr, rkey0, "before"); got != "ok" {
		t.Fatalf("the peer through rxe0 before rxe1 goes: %q", got)
	}
	// A peer connected through rxe1 when it goes: the daemon closes its
	// connection (its QP is in rxe1's part of the PD, which must go).
	via1 := *rd
	via1.peer = addr1 + rd.peer[len(addr0):]
	p1 := holdPeer(t, &via1, "/")

	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- deleteRxe1(60 * time.Second) }()
	// While the deletion waits for the daemon, the peer through rxe0
	// works.
	if got := op("write %s %s %x", addr, rkey0, "during"); got != "ok" {
		t.Errorf("the peer through rxe0 while rxe1 goes: %q", got)
	}
	if err := <-done; err != nil {
		t.Fatalf("rdma link delete %s: %v\n%s", device2, err, d.log)
	}
	t.Logf("rdma link delete %s took %v", device2, time.Since(start).Round(time.Millisecond))
	// Closed by whichever came first: the peer's own DEVICE_REMOVAL (it
	// then disconnects), the daemon's, or the devices' watch.
	closed := false
	for _, line := range strings.Split(d.log.String(), "\n") {
		closed = closed || strings.Contains(line, "rdma_cm connection closed") && strings.Contains(line, "peer="+addr1+":")
	}
	if !closed {
		t.Errorf("the connection through %s was not closed when it went", device2)
	}
	select {
	case <-p1.done:
		t.Logf("the peer through %s: %s", device2, strings.TrimSpace(p1.out.String()))
	case <-time.After(30 * time.Second):
		t.Errorf("the peer through %s is still there 30 s after it went", device2)
	}
	if got := op("read %s %s 6", addr, rkey0); got != "ok "+fmt.Sprintf("%x", "during") {
		t.Errorf("the peer through rxe0 after rxe1 went: %q", got)
	}
	if k := deviceKeys(t, f); len(k) != 1 || k[device] != keys[device] {
		t.Errorf("user.mrfs.keys with rxe1 gone: %v, want rxe0's %v alone", k, keys[device])
	}
	if st := getxattr(t, f, "user.mrfs.state"); st != "registered; device rxe1 gone" {
		t.Errorf("user.mrfs.state with rxe1 gone: %q", st)
	}
	if out, err := exec.Command(mrfsBin(), "status", d.dir).CombinedOutput(); err != nil || !strings.Contains(string(out), "(gone: rxe1)") {
		t.Errorf("mrfs status with rxe1 gone: %v\n%s", err, out)
	}
	if !strings.Contains(d.log.String(), "device is gone") {
		t.Errorf("the log does not say rxe1 is gone")
	}

	if out, err := exec.Command("rdma", "link", "add", device2, "type", "rxe", "netdev", "eth1").CombinedOutput(); err != nil {
		t.Fatalf("rdma link add %s: %v: %s", device2, err, out)
	}
	var back map[string][2]uint64
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if back = deviceKeys(t, f); len(back) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("20 s after rdma link add %s, user.mrfs.keys %v\n%s", device2, back, d.log)
		}
	}
	t.Logf("%s back: keys %v, were %v", device2, back, keys)
	if back[device] != keys[device] {
		t.Errorf("rxe0's keys changed: %v, were %v", back[device], keys[device])
	}
	if hits := byLKey(rdmaResOn(t, "mr", device2), back[device2][0]); len(hits) != 1 {
		t.Errorf("the new %s lists %d MRs with lkey %#x, want 1", device2, len(hits), back[device2][0])
	}
	// A peer finds the buffer in etcd and writes through the new rxe1
	// with the keys published for it (the old ones fail there).
	host, _ := os.Hostname()
	byName := `echo -n "$MSG" | MRFS_TOKEN="$(tok /)" "$MRFS" remote write --name "$NAME" --endpoints "$ETCD" --device rxe1 --offset 4096`
	var code int
	var out string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		code, out = cliPeer(t, rd, byName, "NAME", host+"/m/rx", "ETCD", etcdURL, "MSG", "through the new rxe1")
		if code == 0 || time.Now().After(deadline) {
			break
		}
	}
	if code != 0 {
		t.Fatalf("mrfs remote write --name --device %s after it came back: exit %d: %s", device2, code, out)
	}
	if got := op("read %s %s 20", fmt.Sprintf("%#x", mustHex(t, addr)+4096), rkey0); got != "ok "+fmt.Sprintf("%x", "through the new rxe1") {
		t.Errorf("what the peer through the new rxe1 wrote, read through rxe0: %q", got)
	}
	p0.stop()

	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	if err := d.stop(t); err != nil {
		t.Fatalf("teardown: %v\n%s", err, d.log)
	}
	for _, kind := range []string{"mr", "pd"} {
		before := map[string]snapshot{"mr": mrsBefore, "pd": pdsBefore}[kind]
		for id := range idsOn(t, kind, devs...) {
			if !before[id] {
				t.Errorf("after the teardown %s %s remains", kind, id)
			}
		}
	}
}

func mustHex(t *testing.T, s string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(s, 0, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
