package publish_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"mrfs/buffer"
	"mrfs/desc"
	"mrfs/publish"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

const allRemote = verbs.LocalWrite | verbs.RemoteWrite | verbs.RemoteRead | verbs.RemoteAtomic

// etcd is a real etcd (Debian's etcd-server) on ports of its own.
type etcd struct {
	url string
	c   *clientv3.Client
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func startEtcd(t *testing.T) *etcd {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Skip("no etcd here (Debian's etcd-server; bash scripts/test installs it)")
	}
	client := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	peer := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	cmd := exec.Command(bin, "--name", "t", "--data-dir", t.TempDir(),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "t="+peer)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
	})
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{client}, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Get(ctx, "ready?")
		cancel()
		if err == nil {
			return &etcd{url: client, c: c}
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd did not answer: %v", err)
		}
	}
}

// keys is what etcd holds under prefix, key -> value.
func (e *etcd) keys(t *testing.T, prefix string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := e.c.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, kv := range r.Kvs {
		out[string(kv.Key)] = string(kv.Value)
	}
	return out
}

// requests counts the KV requests etcd has answered (ranges, puts,
// deletes, transactions) and the keys it has written (put or deleted),
// from its own /metrics.
func (e *etcd) requests(t *testing.T) (requests, writes int) {
	t.Helper()
	r, err := http.Get(e.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	sc := bufio.NewScanner(r.Body)
	for sc.Scan() {
		line := sc.Text()
		name, value, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") {
			continue
		}
		n, err := strconv.ParseFloat(value, 64)
		if err != nil {
			continue
		}
		switch {
		case strings.HasPrefix(name, "grpc_server_handled_total{") && strings.Contains(name, `grpc_service="etcdserverpb.KV"`):
			requests += int(n)
		case name == "etcd_mvcc_put_total" || name == "etcd_mvcc_delete_total":
			writes += int(n)
		}
	}
	return requests, writes
}

// published is a tree on a soft device whose files get every remote
// access, with a publisher to e; describes counts the descs it built.
type published struct {
	tr        *tree.Tree
	p         *publish.Publisher
	describes atomic.Int64
	prefix    string
}

// delay is Options.Delay: each pass waits that long before it writes.
func startPublished(t *testing.T, e *etcd, lease time.Duration, mount string, delay time.Duration) *published {
	t.Helper()
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	var p atomic.Pointer[publish.Publisher]
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: allRemote, Events: events{&p}}, nil)
	s := &published{prefix: "/t/h/" + mount + "/"}
	tr, err := tree.New(mgr, tree.Options{DefaultSize: 4096, DefaultAccess: allRemote, Changed: func(n tree.Node) {
		if p := p.Load(); p != nil {
			p.Changed(n)
		}
	}}, allRemote, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	s.tr = tr
	s.p, err = publish.Start(publish.Options{
		Endpoints: []string{e.url}, Prefix: "/t", Lease: lease, Host: "h", Mount: mount,
		Listen: func() publish.Where {
			return publish.Where{Listen: "tcp 127.0.0.1:7471", Devices: map[string]string{"d1": "tcp 10.0.3.15:7471"}}
		},
		Tree: tr, Log: slog.New(slog.DiscardHandler), Delay: delay,
		Describe: func(b *buffer.Buffer) (desc.Desc, buffer.Info, bool) {
			s.describes.Add(1)
			in := b.Info()
			// As if on two devices, d1 reached at an address of its own.
			devs := []desc.DeviceRegions{{Device: "d0"}, {Device: "d1"}}
			return desc.Desc{RKey: desc.Key(in.RKey), Addr: desc.Hex(in.Addr), Generation: in.Generation, Devices: devs}, in, in.State == buffer.Registered
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	p.Store(s.p)
	t.Cleanup(func() {
		s.p.Close()
		mgr.Close()
		dev.Close()
	})
	return s
}

// events passes the buffers' changes to the publisher, as the mount's do.
type events struct {
	p *atomic.Pointer[publish.Publisher]
}

func (events) Registered(uint64, time.Duration) {}
func (events) Deregistered(uint64)              {}
func (events) LimitHit(string)                  {}
func (e events) Changed(b *buffer.Buffer) {
	if p := e.p.Load(); p != nil {
		p.ChangedBuffer(b)
	}
}

// waitKeys waits until e holds n keys under prefix.
func (e *etcd) waitKeys(t *testing.T, prefix string, n int, within time.Duration) map[string]string {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got := e.keys(t, prefix)
		if len(got) == n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys under %s after %v, want %d", len(got), prefix, within, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPerChangeCost: among 10,000 published buffers, one change (a
// create, an access removed, a rename, a truncate, an unlink) costs a constant
// amount of etcd work and builds at most two descs (the buffer's own
// event and the tree's may land in two passes), and an idle mount's
// periodic passes (a third of a 3 s lease apart) build none and send no
// KV request: nothing walks the tree. A removal is in etcd before the
// call returns.
func TestPerChangeCost(t *testing.T) {
	e := startEtcd(t)
	// Each pass waits before it writes: a removal that Changed did not
	// wait for is still in etcd when the call returns.
	s := startPublished(t, e, 3*time.Second, "mnt/a", 100*time.Millisecond)
	const n = 10000
	root := s.tr.Root()
	for i := range n {
		if _, err := root.Create(0, fmt.Sprintf("f%05d", i), tree.Owner{}, 0o600, nil); err != nil {
			t.Fatal(err)
		}
	}
	e.waitKeys(t, s.prefix, n, 60*time.Second)

	step := func(what string, do func() error, check func(map[string]string)) {
		t.Helper()
		time.Sleep(100 * time.Millisecond) // the last step's passes are over
		r0, w0 := e.requests(t)
		d0 := s.describes.Load()
		if err := do(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		check(e.keys(t, s.prefix))
		time.Sleep(600 * time.Millisecond) // every pass it started is over
		r1, w1 := e.requests(t)
		d1 := s.describes.Load()
		// The test's own Get in check is one request.
		if req, wr, ds := r1-r0-1, w1-w0, d1-d0; req > 2 || wr > 2 || ds > 2 {
			t.Errorf("%s among %d published buffers: %d etcd requests, %d keys written, %d descs built; want at most 2 of each",
				what, n, req, wr, ds)
		}
	}
	step("create", func() error {
		_, err := root.Create(0, "new", tree.Owner{}, 0o600, nil)
		return err
	}, func(map[string]string) {})
	e.waitKeys(t, s.prefix, n+1, 5*time.Second)
	step("access removed", func() error {
		f, err := root.Lookup("f00001")
		if err != nil {
			return err
		}
		return f.(*tree.File).SetAccess(verbs.LocalWrite)
	}, func(keys map[string]string) {
		if _, ok := keys[s.prefix+"f00001"]; ok {
			t.Error("the key of a buffer without remote access is still there after SetAccess returned")
		}
	})
	step("rename", func() error { return root.Rename(0, "f00002", root, "g", 0) }, func(keys map[string]string) {
		if _, ok := keys[s.prefix+"f00002"]; ok {
			t.Error("the key of a renamed buffer's old name is still there after Rename returned")
		}
	})
	if _, ok := e.waitKeys(t, s.prefix, n, 5*time.Second)[s.prefix+"g"]; !ok {
		t.Error("the renamed buffer is not published under its new name")
	}
	// A truncate re-registers: the buffer says so, not the tree.
	f4, err := root.Lookup("f00004")
	if err != nil {
		t.Fatal(err)
	}
	step("truncate", func() error { return f4.(*tree.File).Buffer().Resize(context.Background(), 8192) }, func(map[string]string) {})
	gen := fmt.Sprint(f4.(*tree.File).Buffer().Info().Generation)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var v struct{ Generation uint64 }
		json.Unmarshal([]byte(e.keys(t, s.prefix+"f00004")[s.prefix+"f00004"]), &v)
		if fmt.Sprint(v.Generation) == gen {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a truncated buffer is published with generation %d, want %s", v.Generation, gen)
		}
	}
	step("unlink", func() error { return root.Unlink(0, "f00003") }, func(keys map[string]string) {
		if _, ok := keys[s.prefix+"f00003"]; ok {
			t.Error("the key of an unlinked buffer is still there after Unlink returned")
		}
	})

	r0, _ := e.requests(t)
	d0 := s.describes.Load()
	time.Sleep(2500 * time.Millisecond) // two periodic passes at least
	r1, _ := e.requests(t)
	if req, ds := r1-r0, s.describes.Load()-d0; req != 0 || ds != 0 {
		t.Errorf("idle for 2.5 s: %d etcd KV requests, %d descs built; want none", req, ds)
	}
	if got := len(e.keys(t, s.prefix)); got != n-1 {
		t.Errorf("%d keys after the lease's renewals, want %d", got, n-1)
	}
}

// TestRenameOverTakesTheKey: a file renamed over a published one takes
// its key, and the key stays the new file's (the old file's removal
// does not delete it); exchanging two files swaps their values.
func TestRenameOverTakesTheKey(t *testing.T) {
	e := startEtcd(t)
	s := startPublished(t, e, 10*time.Second, "m", 0)
	root := s.tr.Root()
	a, err := root.Create(0, "a", tree.Owner{}, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := root.Create(0, "b", tree.Owner{}, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := e.waitKeys(t, s.prefix, 2, 5*time.Second)
	// Each device's address goes with its keys.
	if d, err := desc.Parse([]byte(keys[s.prefix+"a"])); err != nil || len(d.Devices) != 2 || d.Devices[1].Listen != "tcp 10.0.3.15:7471" || d.Devices[0].Listen != "" || d.Listen != "tcp 127.0.0.1:7471" {
		t.Errorf("published a: %+v, %v; want d1's listen address with d1", d, err)
	}
	rkey := func(keys map[string]string, name string) string {
		d, _ := desc.Parse([]byte(keys[s.prefix+name]))
		return fmt.Sprint(uint32(d.RKey))
	}
	ka, kb := fmt.Sprint(a.Buffer().Info().RKey), fmt.Sprint(b.Buffer().Info().RKey)
	if err := root.Rename(0, "a", root, "b", 0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	keys = e.keys(t, s.prefix)
	if len(keys) != 1 || rkey(keys, "b") != ka {
		t.Errorf("after a renamed over b: %v; want b alone, with a's rkey %s (b's was %s)", keys, ka, kb)
	}
	c, err := root.Create(0, "c", tree.Owner{}, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	kc := fmt.Sprint(c.Buffer().Info().RKey)
	e.waitKeys(t, s.prefix, 2, 5*time.Second)
	if err := root.Rename(0, "b", root, "c", tree.RenameExchange); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	keys = e.keys(t, s.prefix)
	if rkey(keys, "b") != kc || rkey(keys, "c") != ka {
		t.Errorf("after exchanging b and c: b has rkey %s, c %s; want %s and %s", rkey(keys, "b"), rkey(keys, "c"), kc, ka)
	}
}

// TestNewLeaseClearsOnlyItsMount: two mounts of one host publish under
// their own names; one restarting (a new publisher, a new lease) clears
// the keys its name left and not the other's.
func TestNewLeaseClearsOnlyItsMount(t *testing.T) {
	e := startEtcd(t)
	a := startPublished(t, e, 10*time.Second, "mnt/a", 0)
	b := startPublished(t, e, 10*time.Second, "mnt/ab", 0)
	for _, s := range []*published{a, b} {
		if _, err := s.tr.Root().Create(0, "x", tree.Owner{}, 0o600, nil); err != nil {
			t.Fatal(err)
		}
	}
	e.waitKeys(t, "/t/h/", 2, 5*time.Second)
	// A stale key of mount a, as a daemon killed before left it.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := e.c.Put(ctx, a.prefix+"stale", "{}"); err != nil {
		t.Fatal(err)
	}
	a2 := startPublished(t, e, 10*time.Second, "mnt/a", 0)
	if _, err := a2.tr.Root().Create(0, "y", tree.Owner{}, 0o600, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	keys := e.keys(t, "/t/h/")
	for _, k := range []string{a.prefix + "stale", a.prefix + "x"} {
		if _, ok := keys[k]; ok {
			t.Errorf("%s is still there after mount a's new lease", k)
		}
	}
	for _, k := range []string{b.prefix + "x", a.prefix + "y"} {
		if _, ok := keys[k]; !ok {
			t.Errorf("%s is missing: %v", k, keys)
		}
	}
}
