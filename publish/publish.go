// Package publish keeps this mount's buffers that have remote access
// published to etcd, for peers on other hosts: one key per buffer,
// <prefix>/<host>/<mount>/<path in the mount>, whose value is the
// buffer's desc (user.mrfs.desc, which carries the registration's
// generation) plus "host", "mount", "path", "listen" (user.mrfs.remote's
// transport and address) and "pd_path" (the PD's directory). Tokens are
// never published.
//
// Publication is incremental: the tree and the buffers say which file
// changed (Changed, ChangedBuffer), a record per file coalesces changes
// until the next pass, and a pass does for each record at most a delete
// and a put, batched into transactions: no walk of the tree. Changed
// waits for a removal, so a key is gone before the unlink or access
// change that removed it returns.
//
// Every key lives under one lease the publisher keeps alive (a pass every
// third of its TTL only renews it), so a daemon that dies takes its keys
// with it once the lease expires. A new lease (at start, or after the old
// one was lost while etcd was unreachable) first deletes what this mount
// left under its name, then publishes the whole tree again: the only
// walks. While etcd cannot be reached the mount goes on, the log says so
// once, and the records wait for it.
package publish

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"mrfs/buffer"
	"mrfs/desc"
	"mrfs/tree"
	"mrfs/verbs"
)

// Options configure a Publisher.
type Options struct {
	Endpoints []string      // etcd's client URLs
	Prefix    string        // of every key, e.g. "/mrfs"
	Lease     time.Duration // the lease's TTL (at least a second)
	Host      string        // this host's name in the keys
	// Mount is this mount's name in the keys (publish.name; by default
	// the mount point without its leading slash): two mounts of a host
	// keep apart.
	Mount string
	// Listen is where peers connect, asked at each pass.
	Listen func() Where
	Tree   *tree.Tree
	// Describe is a buffer's desc and its state, ok false when it is not
	// registered (desc.Buffer).
	Describe func(*buffer.Buffer) (d desc.Desc, info buffer.Info, ok bool)
	Log      *slog.Logger
	// Delay is a test hook: each pass waits this long before it writes.
	Delay time.Duration
}

// remoteAccess is what makes a buffer worth publishing.
const remoteAccess = verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic

// opTimeout bounds one request to etcd: past it, etcd is unreachable.
const opTimeout = 3 * time.Second

// maxTxnOps is the most operations one transaction carries: etcd's
// default --max-txn-ops.
const maxTxnOps = 128

// Publisher publishes; Close stops it.
type Publisher struct {
	opt    Options
	base   string // <prefix>/<host>/<mount>: every key of this mount
	poke   chan struct{}
	stop   chan struct{}
	done   chan struct{}
	client *clientv3.Client

	mu sync.Mutex // guards: every field below
	// files and dirs are the change records since the last pass: files
	// to look at again, directories whose every file is to (renamed, a
	// pool's keys changed).
	files map[*tree.File]struct{}
	dirs  map[*tree.Dir]struct{}
	// recorded counts the changes recorded; passed those in etcd (or
	// found to need nothing); each pass closes and replaces passCh.
	recorded, passed uint64
	passCh           chan struct{}
	// lease is the lease the published keys live under; 0: none yet,
	// and the next pass starts over (a new lease, the whole tree).
	lease clientv3.LeaseID
	// pubs is what etcd holds of ours, per file; owner, per key, the
	// file that put it (a rename over a published file takes its key).
	pubs   map[*tree.File]pub
	owner  map[string]*tree.File
	listen string // the Listen the keys were made with
	// down: etcd was unreachable at the last try (logged once).
	down bool
}

// pub is one published key and its value.
type pub struct{ key, value string }

// Start connects to etcd (lazily: an etcd that is not there yet is not
// an error) and starts publishing.
func Start(opt Options) (*Publisher, error) {
	// The client's own log would go to stderr; the publisher says what
	// matters itself.
	c, err := clientv3.New(clientv3.Config{Endpoints: opt.Endpoints, DialTimeout: opTimeout, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("etcd client for %v: %w", opt.Endpoints, err)
	}
	p := &Publisher{opt: opt, client: c, poke: make(chan struct{}, 1), stop: make(chan struct{}),
		done: make(chan struct{}), files: map[*tree.File]struct{}{}, dirs: map[*tree.Dir]struct{}{},
		passCh: make(chan struct{}), pubs: map[*tree.File]pub{}, owner: map[string]*tree.File{},
		base: strings.TrimSuffix(opt.Prefix, "/") + "/" + opt.Host + "/" + strings.Trim(opt.Mount, "/")}
	go p.run()
	return p, nil
}

// Changed is tree.Options.Changed: it records that n's name, existence
// or keys changed (a directory: of every file under it) and, when that
// may take a key away (n was published), waits until etcd holds the
// change, so an rm, an mv or an access taken away has removed the key
// by the time the call returns.
func (p *Publisher) Changed(n tree.Node) {
	was := p.published(n)
	if seq := p.record(n); was {
		p.wait(seq)
	}
}

// record records a change of n and starts a pass; the returned number
// is for wait.
func (p *Publisher) record(n tree.Node) uint64 {
	p.mu.Lock()
	switch n := n.(type) {
	case *tree.File:
		p.files[n] = struct{}{}
	case *tree.Dir:
		p.dirs[n] = struct{}{}
	}
	p.recorded++
	seq := p.recorded
	p.mu.Unlock()
	select {
	case p.poke <- struct{}{}:
	default:
	}
	return seq
}

// ChangedBuffer records a change of b's file (buffer.Events.Changed,
// called under b's lock: it never waits); nothing for a buffer no file
// holds yet, whose Create is recorded once it has its name.
func (p *Publisher) ChangedBuffer(b *buffer.Buffer) {
	if f, ok := b.Aux().(*tree.File); ok {
		p.record(f)
	}
}

// published says whether a change of n may take a key away: a file that
// has a key in etcd, and any directory (its files are not looked at).
func (p *Publisher) published(n tree.Node) bool {
	f, ok := n.(*tree.File)
	if !ok {
		return true
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok = p.pubs[f]
	return ok
}

// wait waits until the changes recorded up to seq are in etcd, or etcd
// is found unreachable, or opTimeout has passed.
func (p *Publisher) wait(seq uint64) {
	timeout := time.NewTimer(opTimeout)
	defer timeout.Stop()
	for {
		p.mu.Lock()
		if p.passed >= seq || p.down {
			p.mu.Unlock()
			return
		}
		ch := p.passCh
		p.mu.Unlock()
		select {
		case <-ch:
		case <-timeout.C:
			return
		case <-p.done:
			return
		}
	}
}

// Close stops publishing and revokes the lease: every key goes at once.
func (p *Publisher) Close() error {
	close(p.stop)
	<-p.done
	p.mu.Lock()
	lease := p.lease
	p.mu.Unlock()
	var err error
	if lease != 0 {
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		_, err = p.client.Revoke(ctx, lease)
		cancel()
	}
	if cerr := p.client.Close(); err == nil {
		err = cerr
	}
	return err
}

func (p *Publisher) run() {
	defer close(p.done)
	// A third of the TTL apart, a pass renews the lease; changes poke a
	// pass at once.
	tick := time.NewTicker(p.opt.Lease / 3)
	defer tick.Stop()
	renew := true
	for {
		p.pass(renew)
		select {
		case <-p.stop:
			return
		case <-p.poke:
			renew = false
		case <-tick.C:
			renew = true
		}
	}
}

// pass takes the change records and makes etcd hold what they say; a
// failure puts them back for the next pass.
func (p *Publisher) pass(renew bool) {
	p.mu.Lock()
	files, dirs, seq := p.files, p.dirs, p.recorded
	p.files, p.dirs = map[*tree.File]struct{}{}, map[*tree.Dir]struct{}{}
	down := p.down
	p.mu.Unlock()

	err := p.apply(files, dirs, renew || down)

	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		for f := range files {
			p.files[f] = struct{}{}
		}
		for d := range dirs {
			p.dirs[d] = struct{}{}
		}
		if !p.down {
			p.opt.Log.Warn("publish: etcd unreachable; the mount goes on, publication resumes when it is back",
				"endpoints", p.opt.Endpoints, "err", err)
		}
		p.down = true
		return
	}
	if p.down {
		p.opt.Log.Info("publish: etcd is back; published again", "keys", len(p.pubs))
		p.down = false
	}
	p.passed = seq
	close(p.passCh)
	p.passCh = make(chan struct{})
}

// apply renews the lease when asked to, starts over when there is none
// or the keys' listen address changed, and publishes the files recorded
// (those under dirs too). Only the loop calls it.
func (p *Publisher) apply(files map[*tree.File]struct{}, dirs map[*tree.Dir]struct{}, renew bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var listen Where
	if p.opt.Listen != nil {
		listen = p.opt.Listen()
	}
	p.mu.Lock()
	lease := p.lease
	fresh := lease == 0 || listen.key() != p.listen
	p.mu.Unlock()
	if lease != 0 && renew {
		if _, err := p.client.KeepAliveOnce(ctx, lease); errors.Is(err, rpctypes.ErrLeaseNotFound) {
			// Expired while etcd was unreachable: its keys went with it.
			lease, fresh = 0, true
		} else if err != nil {
			return err
		}
	}
	if lease == 0 {
		r, err := p.client.Grant(ctx, int64(p.opt.Lease/time.Second))
		if err != nil {
			return err
		}
		lease = r.ID
	}
	if fresh {
		// Keys this mount left (a daemon before this one, a lease lost)
		// go, and the whole tree is published again.
		if err := p.clearOwn(ctx); err != nil {
			return err
		}
		p.mu.Lock()
		p.lease, p.listen = lease, listen.key()
		p.pubs, p.owner = map[*tree.File]pub{}, map[string]*tree.File{}
		p.mu.Unlock()
		dirs = map[*tree.Dir]struct{}{p.opt.Tree.Root(): {}}
	}
	for d := range dirs {
		walk(d, func(f *tree.File) { files[f] = struct{}{} })
	}
	return p.publish(ctx, files, listen, lease)
}

// walk calls fn for every file under d.
func walk(d *tree.Dir, fn func(*tree.File)) {
	for _, e := range d.Entries() {
		switch n := e.Node.(type) {
		case *tree.Dir:
			walk(n, fn)
		case *tree.File:
			fn(n)
		}
	}
}

// clearOwn deletes the keys of this mount's name (whatever their lease):
// those of another mount of this host have another name and stay.
func (p *Publisher) clearOwn(ctx context.Context) error {
	r, err := p.client.Get(ctx, p.base+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return err
	}
	var ops []clientv3.Op
	for _, kv := range r.Kvs {
		ops = append(ops, clientv3.OpDelete(string(kv.Key)))
	}
	return p.commit(ctx, ops)
}

// commit runs ops in transactions of at most maxTxnOps.
func (p *Publisher) commit(ctx context.Context, ops []clientv3.Op) error {
	for len(ops) > 0 {
		n := min(len(ops), maxTxnOps)
		if _, err := p.client.Txn(ctx).Then(ops[:n]...).Commit(); err != nil {
			return err
		}
		ops = ops[n:]
	}
	return nil
}

// publish makes etcd hold, for each of files, its key if it is to be
// published and nothing otherwise, in as few transactions as the records
// allow. A key both deleted and put (a file renamed over another takes
// its key) is only put.
func (p *Publisher) publish(ctx context.Context, files map[*tree.File]struct{}, listen Where, lease clientv3.LeaseID) error {
	type put struct {
		f *tree.File
		pub
	}
	var dels []*tree.File
	puts := map[string]put{}
	p.mu.Lock()
	for f := range files {
		cur, had := p.pubs[f]
		p.mu.Unlock()
		want, ok := p.want(f, listen)
		p.mu.Lock()
		if had && (!ok || want.key != cur.key) {
			dels = append(dels, f)
		}
		if ok && want != cur {
			puts[want.key] = put{f, want}
		}
	}
	var ops []clientv3.Op
	for _, f := range dels {
		if k := p.pubs[f].key; puts[k].f == nil {
			ops = append(ops, clientv3.OpDelete(k))
		}
	}
	p.mu.Unlock()
	for _, w := range puts {
		ops = append(ops, clientv3.OpPut(w.key, w.value, clientv3.WithLease(lease)))
	}
	time.Sleep(p.opt.Delay)
	if err := p.commit(ctx, ops); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, f := range dels {
		if k := p.pubs[f].key; p.owner[k] == f {
			delete(p.owner, k)
		}
		delete(p.pubs, f)
	}
	for _, w := range puts {
		if prev := p.owner[w.key]; prev != nil && prev != w.f {
			delete(p.pubs, prev) // its key is w's now
		}
		p.owner[w.key] = w.f
		p.pubs[w.f] = w.pub
	}
	return nil
}

// want is what etcd should hold for f: its key and value when it is
// registered with remote access and remote access is on.
func (p *Publisher) want(f *tree.File, listen Where) (pub, bool) {
	if listen.Listen == "" {
		return pub{}, false
	}
	inMount, ok := f.Path()
	if !ok {
		return pub{}, false
	}
	d, info, ok := p.opt.Describe(f.Buffer())
	if !ok || info.Access&remoteAccess == 0 {
		return pub{}, false
	}
	d.Host, d.Mount, d.Path = p.opt.Host, strings.Trim(p.opt.Mount, "/"), inMount
	d.Listen, d.PDPath = listen.Listen, path.Dir(inMount)
	for i := range d.Devices {
		d.Devices[i].Listen = listen.Devices[d.Devices[i].Device]
	}
	if d.Pool != nil {
		d.Pool.Dir = d.PDPath
	}
	return pub{p.base + inMount, string(d.JSON())}, true
}

// Where is where peers connect.
type Where struct {
	// Listen is user.mrfs.remote's transport and an address a peer can
	// reach ("rdma_cm 10.0.0.5:7471"); "" while remote access is off.
	Listen string
	// Devices is, with buffers on several devices, where a peer reaches
	// each device ("rdma_cm 10.0.3.5:7471"), for desc's devices.
	Devices map[string]string
}

// key is w as a comparable string (fmt prints maps sorted).
func (w Where) key() string {
	if len(w.Devices) == 0 {
		return w.Listen
	}
	return w.Listen + " " + fmt.Sprint(w.Devices)
}

// Entry is one published buffer, as a peer finds it.
type Entry struct {
	Key   string    // <prefix>/<host>/<mount>/<path>
	Name  string    // the key without the prefix: what --name takes
	Desc  desc.Desc // the value: the desc, and where the buffer is
	Value []byte    // the value as etcd holds it
}

// Client reads what is published (mrfs peers, mrfs remote --name).
type Client struct {
	c      *clientv3.Client
	prefix string
}

// Dial connects to etcd at endpoints for the keys under prefix.
func Dial(endpoints []string, prefix string) (*Client, error) {
	c, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: opTimeout, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("etcd client for %v: %w", endpoints, err)
	}
	return &Client{c: c, prefix: strings.TrimSuffix(prefix, "/")}, nil
}

func (c *Client) Close() error { return c.c.Close() }

// List is every published buffer, sorted by key.
func (c *Client) List(ctx context.Context) ([]Entry, error) {
	r, err := c.c.Get(ctx, c.prefix+"/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return nil, fmt.Errorf("etcd: list %s/: %w", c.prefix, err)
	}
	var out []Entry
	for _, kv := range r.Kvs {
		if e, err := c.entry(string(kv.Key), kv.Value); err == nil {
			out = append(out, e)
		}
	}
	return out, nil
}

// Lookup is the buffer published as name, "HOST/MOUNT/PATH".
func (c *Client) Lookup(ctx context.Context, name string) (Entry, error) {
	key := c.prefix + "/" + strings.TrimPrefix(name, "/")
	r, err := c.c.Get(ctx, key)
	if err != nil {
		return Entry{}, fmt.Errorf("etcd: get %s: %w", key, err)
	}
	if len(r.Kvs) == 0 {
		return Entry{}, fmt.Errorf("no buffer is published as %s (key %s): %w", name, key, syscall.ENOENT)
	}
	return c.entry(key, r.Kvs[0].Value)
}

func (c *Client) entry(key string, v []byte) (Entry, error) {
	d, err := desc.Parse(v)
	if err != nil {
		return Entry{}, fmt.Errorf("%s: not a published buffer: %w", key, err)
	}
	return Entry{Key: key, Name: strings.TrimPrefix(key, c.prefix+"/"), Desc: d, Value: v}, nil
}
