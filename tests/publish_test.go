package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// etcdServer is a real etcd (Debian's etcd-server) on ports of its own,
// with its data in a temporary directory.
type etcdServer struct {
	t       testing.TB
	url     string
	args    []string
	cmd     *exec.Cmd
	done    chan struct{}
	out     syncBuffer
	dataDir string
	// answers says whether etcd answers (the test's client, or mrfs
	// peers on the host whose network it is on).
	answers func() error
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startEtcd starts etcd on loopback.
func startEtcd(t testing.TB) *etcdServer {
	t.Helper()
	e := newEtcd(t, nil, "127.0.0.1", freePort(t), freePort(t))
	e.answers = func() error {
		c := e.client()
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := c.Get(ctx, "ready?")
		return err
	}
	e.start()
	return e
}

// startEtcdOn starts etcd on host h, at h's address.
func startEtcdOn(t *testing.T, h testHost) *etcdServer {
	t.Helper()
	e := newEtcd(t, h.in(), h.addr, 2379, 2380)
	e.answers = func() error { _, err := peersOn(t, h, e.url); return err }
	e.start()
	return e
}

func newEtcd(t testing.TB, prefix []string, addr string, clientPort, peerPort int) *etcdServer {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("no etcd here (Debian's etcd-server; bash scripts/test installs it)")
	}
	client := fmt.Sprintf("http://%s:%d", addr, clientPort)
	peer := fmt.Sprintf("http://%s:%d", addr, peerPort)
	e := &etcdServer{t: t, url: client, dataDir: t.TempDir()}
	e.args = append(prefix, bin, "--name", "t", "--data-dir", e.dataDir,
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "t="+peer)
	t.Cleanup(e.stop)
	return e
}

func (e *etcdServer) start() {
	e.t.Helper()
	e.cmd = exec.Command(e.args[0], e.args[1:]...)
	e.cmd.Stdout, e.cmd.Stderr = &e.out, &e.out
	if err := e.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.done = make(chan struct{})
	go func() { e.cmd.Wait(); close(e.done) }()
	for deadline := time.Now().Add(readyTimeout); ; time.Sleep(50 * time.Millisecond) {
		err := e.answers()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("etcd did not answer within %v: %v\n%s", readyTimeout, err, tail(e.out.String(), 20))
		}
	}
}

func (e *etcdServer) stop() {
	if e.cmd == nil || e.cmd.ProcessState != nil {
		return
	}
	e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.done:
	case <-time.After(stopTimeout):
		e.cmd.Process.Kill()
		<-e.done
	}
}

func (e *etcdServer) client() *clientv3.Client {
	e.t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{e.url}, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// published is what etcd holds under prefix, key -> value.
func (e *etcdServer) published(prefix string) (map[string]map[string]any, error) {
	c := e.client()
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	r, err := c.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[string]map[string]any{}
	for _, kv := range r.Kvs {
		var v map[string]any
		if err := json.Unmarshal(kv.Value, &v); err != nil {
			return nil, fmt.Errorf("%s: %v: %s", kv.Key, err, kv.Value)
		}
		out[string(kv.Key)] = v
	}
	return out, nil
}

// waitKeys polls until the keys under prefix are exactly want (names
// after the prefix), or fails after timeout.
func (e *etcdServer) waitKeys(prefix string, timeout time.Duration, want ...string) map[string]map[string]any {
	e.t.Helper()
	var got map[string]map[string]any
	var err error
	for deadline := time.Now().Add(timeout); ; time.Sleep(50 * time.Millisecond) {
		got, err = e.published(prefix)
		if err == nil && len(got) == len(want) {
			all := true
			for _, k := range want {
				_, ok := got[prefix+k]
				all = all && ok
			}
			if all {
				return got
			}
		}
		if time.Now().After(deadline) {
			keys := []string{}
			for k := range got {
				keys = append(keys, k)
			}
			e.t.Fatalf("under %s etcd holds %q (%v) after %v, want %q", prefix, keys, err, timeout, want)
		}
	}
}

// TestPublish: with [publish], every buffer with remote access is one
// key <prefix>/<host>/<path> whose value is its desc with host, listen
// and pd_path; a buffer without remote access has none; removing the
// access or the file, or renaming it, changes the keys at once (the
// lease of 30 s makes the periodic pass 10 s apart, so each of the three
// checks in under a second (three under emulation) shows the change
// itself was heard); while
// etcd is down the mount goes on and the log says so, and once etcd is
// back what changed meanwhile is published; an unmount takes the keys
// at once, and a daemon killed with its lease.
func TestPublish(t *testing.T) {
	e := startEtcd(t)
	host, _ := os.Hostname()
	publish := func(lease string) string {
		return fmt.Sprintf("endpoints = [%q]\nprefix = \"/mrfs-test\"\nlease = %q", e.url, lease)
	}
	// Each pass waits a little before it writes: an rm that did not wait
	// for its key to go would return before it went.
	d := startDaemon(t, daemonConfig{Remote: backend.listen(), Publish: publish("30s"), Env: []string{"MRFS_TEST_PUBLISH_DELAY=200ms"}})
	// The mount's name in the keys is its mount point's.
	name := host + "/" + strings.Trim(d.mnt, "/")
	prefix := "/mrfs-test/" + name
	where := strings.SplitN(mustXattr(t, d.mnt, xRemote), " ", 3)
	makeBuffer(t, d.path("local"), 4096)
	a := d.path("a")
	remoteBuf(t, a, 8192, allRemote)
	if err := os.Mkdir(d.path("tenant"), 0o755); err != nil {
		t.Fatal(err)
	}
	remoteBuf(t, d.path("tenant", "b"), 4096, "local_write,remote_read")
	remoteBuf(t, d.path("r"), 4096, "local_write,remote_read")
	got := e.waitKeys(prefix, 5*time.Second, "/a", "/tenant/b", "/r")
	v := got[prefix+"/a"]
	var desc map[string]any
	if err := json.Unmarshal([]byte(mustXattr(t, a, xDesc)), &desc); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"addr", "rkey", "length", "generation", "regions"} {
		if fmt.Sprint(v[k]) != fmt.Sprint(desc[k]) {
			t.Errorf("published %s = %v, desc has %v", k, v[k], desc[k])
		}
	}
	if v["host"] != host || v["mount"] != strings.Trim(d.mnt, "/") || v["path"] != "/a" || v["listen"] != where[0]+" "+where[1] ||
		v["pd_path"] != "/" || got[prefix+"/tenant/b"]["pd_path"] != "/tenant" {
		t.Errorf("published host %v, mount %v, path %v, listen %v, pd_path %v / %v; want %s, %s, /a, %q, / and /tenant",
			v["host"], v["mount"], v["path"], v["listen"], v["pd_path"], got[prefix+"/tenant/b"]["pd_path"], host, d.mnt, where[0]+" "+where[1])
	}
	if _, ok := v["token"]; ok {
		t.Error("a token is published")
	}

	// A peer finds them by name: mrfs peers lists them, mrfs remote
	// --name writes (the token still comes from the owner), and a
	// generation that is not the buffer's any more is refused.
	etcd := fmt.Sprintf("--endpoints %s --prefix /mrfs-test", e.url)
	out := mustSh(t, "mrfs peers "+etcd)
	for _, p := range []string{"/a", "/tenant/b", "/r"} {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name+p) + `\s+` + regexp.QuoteMeta(where[0]+" "+where[1]) + `\s`).MatchString(out) {
			t.Errorf("mrfs peers lacks %s%s at %s %s:\n%s", name, p, where[0], where[1], out)
		}
	}
	tok := mustXattr(t, d.mnt, xToken)
	mustSh(t, fmt.Sprintf("printf 'by name' | MRFS_TOKEN=%s mrfs remote write --name '%s/a' --offset 100 %s", tok, name, etcd))
	if b, err := os.ReadFile(a); err != nil || string(b[100:107]) != "by name" {
		t.Errorf("the write by name did not land: %q, %v", b[100:107], err)
	}
	// A truncate re-registers: the buffer says so (the tree has nothing
	// to say), and the new length is published.
	if err := os.Truncate(a, 16384); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Second * slowFactor()); ; time.Sleep(20 * time.Millisecond) {
		if now, err := e.published(prefix); err == nil && fmt.Sprint(now[prefix+"/a"]["length"]) == "16384" {
			v = now[prefix+"/a"]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the new length of %s was not published", a)
		}
	}
	gen := fmt.Sprint(v["generation"])
	mustSetxattr(t, a, xAccess, allRemote) // registered anew: a new generation
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if now, err := e.published(prefix); err == nil && fmt.Sprint(now[prefix+"/a"]["generation"]) != gen {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the new generation of %s was not published", a)
		}
	}
	if _, errOut, err := sh(t, fmt.Sprintf("MRFS_TOKEN=%s mrfs remote read --name '%s/a' --generation %s --length 1 %s", tok, name, gen, etcd)); exitCode(err) != 1 || !strings.Contains(errOut, "not "+gen) {
		t.Errorf("mrfs remote --generation %s after a re-registration: exit %d, %q; want exit 1, refused", gen, exitCode(err), errOut)
	}
	// A re-registration between its own lookup and the operation: refused.
	cmd := exec.Command(mrfsBin, strings.Fields(fmt.Sprintf("remote read --name %s/a --length 1 %s", name, etcd))...)
	cmd.Env = append(os.Environ(), "MRFS_TEST_PAUSE_AFTER_LOOKUP=2s", "MRFS_TOKEN="+tok)
	var lookupErr syncBuffer
	cmd.Stderr = &lookupErr
	exited := started(t, cmd)
	for !strings.Contains(lookupErr.String(), "pausing") {
		select {
		case <-exited:
			t.Fatalf("mrfs remote --name exited before its pause: %s", lookupErr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	mustSetxattr(t, a, xAccess, "local_write,remote_read,remote_write")
	<-exited
	if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(lookupErr.String(), "changed between lookup and use") {
		t.Errorf("a re-registration between lookup and use: exit %d, %q; want exit 1, refused", code, lookupErr.String())
	}

	// A removal is in etcd before the call that made it returns.
	gone := func(what, key string) {
		t.Helper()
		if now, err := e.published(prefix); err != nil {
			t.Fatal(err)
		} else if _, ok := now[prefix+key]; ok {
			t.Errorf("%s: the key %s is still there when the call returned", what, key)
		}
	}
	mustSetxattr(t, a, xAccess, "local_write")
	gone("remote access removed", "/a")
	if err := os.Remove(d.path("tenant", "b")); err != nil {
		t.Fatal(err)
	}
	gone("rm", "/tenant/b")
	if err := os.Rename(d.path("r"), d.path("renamed")); err != nil {
		t.Fatal(err)
	}
	gone("mv", "/r")
	e.waitKeys(prefix, 900*time.Millisecond*slowFactor(), "/renamed")

	// etcd down: the mount goes on; back: what changed is published.
	e.stop()
	remoteBuf(t, d.path("c"), 4096, allRemote)
	if _, ok := d.waitLog(regexp.MustCompile(`level=WARN msg="publish: etcd unreachable`), 15*time.Second); !ok {
		t.Errorf("no warning that etcd is unreachable:\n%s", tail(d.stderr.String(), 20))
	}
	e.start()
	e.waitKeys(prefix, 20*time.Second, "/renamed", "/c")
	if _, ok := d.waitLog(regexp.MustCompile(`msg="publish: etcd is back`), 5*time.Second); !ok {
		t.Errorf("no word that publication resumed")
	}
	// An unmount revokes the lease: the keys go at once.
	if code := d.stop(syscall.SIGINT); code != 0 {
		t.Fatalf("exit %d after SIGINT", code)
	}
	e.waitKeys(prefix, 2*time.Second)

	// A daemon killed: its keys expire with its lease.
	k := startDaemon(t, daemonConfig{Remote: backend.listen(), Publish: publish("3s")})
	prefix = "/mrfs-test/" + host + "/" + strings.Trim(k.mnt, "/")
	remoteBuf(t, k.path("x"), 4096, allRemote)
	e.waitKeys(prefix, 5*time.Second, "/x")
	k.stoppedByTest = true
	k.kill()
	e.waitKeys(prefix, 3*time.Second+3*time.Second)
}

// TestPublishTokenSource: a PD path found in etcd is the peer's, never a
// directory here, so no local token goes to a published peer. A key
// forged into etcd names a fake peer's listener and, as pd_path, the
// root of a mount on this host: without --token-file or MRFS_TOKEN,
// `mrfs remote --name` is refused (exit 2) and sends nothing; with
// MRFS_TOKEN the hello carries that token and the path as published.
func TestPublishTokenSource(t *testing.T) {
	e := startEtcd(t)
	d, _ := startRemote(t)
	fake := startFakePeer(t)
	value := fmt.Sprintf(`{"addr":"0x1000","regions":[{"addr":"0x1000","length":"4096","lkey":"0x100","rkey":"0x100"}],`+
		`"generation":1,"host":"forged","listen":"tcp %s","pd_path":%q}`, fake.addr, d.mnt)
	c := e.client()
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.Put(ctx, "/mrfs-forged/forged/b", value); err != nil {
		t.Fatal(err)
	}
	cli := "mrfs remote read --name forged/b --length 4 --timeout 5s --endpoints " + e.url + " --prefix /mrfs-forged"
	if _, errOut, err := sh(t, cli); exitCode(err) != 2 || !strings.Contains(errOut, "--name needs the PD's token from --token-file or MRFS_TOKEN") {
		t.Errorf("--name without a token: exit %d, %q; want exit 2, refused", exitCode(err), errOut)
	}
	if h, ok := fake.hello(200 * time.Millisecond); ok {
		t.Errorf("--name without a token sent a hello for %q with token %x (the local directory's is %s)", h.Path, h.Token, mustXattr(t, d.mnt, xToken))
	}
	user := "0123456789abcdef0123456789abcdef"
	if _, errOut, err := sh(t, "MRFS_TOKEN="+user+" "+cli); exitCode(err) != 1 {
		t.Errorf("--name with MRFS_TOKEN to the fake peer: exit %d, %q; want 1 (the fake answers nothing)", exitCode(err), errOut)
	}
	if h, ok := fake.hello(5 * time.Second); !ok || fmt.Sprintf("%x", h.Token) != user || h.Path != d.mnt {
		t.Errorf("--name with MRFS_TOKEN: hello %v for %q with token %x; want the user's token for %q, as published", ok, h.Path, h.Token, d.mnt)
	}
}

// TestPublishTwoMounts: two mounts on one host, whose names ("m/a" and
// "m/ab") share a prefix, publish to one etcd. Mount a killed and mounted
// again under its name: the new daemon's lease clears the keys the dead
// one left at once (long before its lease of 30 s expires) and publishes
// its own; mount b's keys stay through all of it, and through a's
// unmount.
func TestPublishTwoMounts(t *testing.T) {
	e := startEtcd(t)
	host, _ := os.Hostname()
	publish := func(name string) string {
		return fmt.Sprintf("endpoints = [%q]\nprefix = \"/mrfs-two\"\nlease = \"30s\"\nname = %q", e.url, name)
	}
	prefix := "/mrfs-two/" + host
	a := startDaemon(t, daemonConfig{Remote: backend.listen(), Publish: publish("m/a")})
	b := startDaemon(t, daemonConfig{Remote: backend.listen(), Publish: publish("m/ab")})
	remoteBuf(t, a.path("x"), 4096, allRemote)
	remoteBuf(t, b.path("y"), 4096, allRemote)
	e.waitKeys(prefix, 5*time.Second, "/m/a/x", "/m/ab/y")

	a.stoppedByTest = true
	a.kill()
	e.waitKeys(prefix, 0, "/m/a/x", "/m/ab/y") // the dead daemon's key lives on with its lease
	a2 := startDaemon(t, daemonConfig{Remote: backend.listen(), Publish: publish("m/a")})
	remoteBuf(t, a2.path("z"), 4096, allRemote)
	e.waitKeys(prefix, 5*time.Second*slowFactor(), "/m/a/z", "/m/ab/y")
	remoteBuf(t, b.path("w"), 4096, allRemote)
	e.waitKeys(prefix, 5*time.Second, "/m/a/z", "/m/ab/w", "/m/ab/y")
	if code := a2.stop(syscall.SIGINT); code != 0 {
		t.Fatalf("exit %d after SIGINT", code)
	}
	e.waitKeys(prefix, 2*time.Second, "/m/ab/w", "/m/ab/y")
}
