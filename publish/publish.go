// Package publish keeps this host's buffers that have remote access
// published to etcd, for peers on other hosts: one key per buffer,
// <prefix>/<host>/<path in the mount>, whose value is the buffer's desc
// (user.mrfs.desc, which carries the registration's generation) plus
// "host", "listen" (user.mrfs.remote's transport and address) and
// "pd_path" (the PD's directory). Every key lives
// under one lease the publisher keeps alive, so a daemon that dies takes
// its keys with it once the lease expires. The publisher reconciles what
// etcd holds with the tree: when told something changed (Poke) and every
// third of the lease's TTL, which renews it; while etcd cannot be reached the mount goes on, the log
// says so once, and the next reconciliation with etcd back publishes
// everything again under a new lease. Tokens are never published.
package publish

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"path"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"mrfs/buffer"
	"mrfs/tree"
	"mrfs/verbs"
)

// Options configure a Publisher.
type Options struct {
	Endpoints []string      // etcd's client URLs
	Prefix    string        // of every key, e.g. "/mrfs"
	Lease     time.Duration // the lease's TTL (at least a second)
	Host      string        // this host's name in the keys
	// Listen is where peers connect: user.mrfs.remote's transport and
	// address ("rdma_cm 10.0.0.5:7471"); "" while remote access is off.
	Listen func() string
	Tree   *tree.Tree
	// Describe is a buffer's desc JSON and its state, ok false when it
	// is not registered (fs.Desc).
	Describe func(*buffer.Buffer) (desc []byte, info buffer.Info, ok bool)
	Log      *slog.Logger
}

// remoteAccess is what makes a buffer worth publishing.
const remoteAccess = verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic

// opTimeout bounds one request to etcd: past it, etcd is unreachable.
const opTimeout = 3 * time.Second

// Publisher publishes; Close stops it.
type Publisher struct {
	opt    Options
	poke   chan struct{}
	stop   chan struct{}
	done   chan struct{}
	client *clientv3.Client

	mu sync.Mutex // guards: lease, published, down (the loop's; Close reads)
	// lease is the lease the published keys live under; 0: none yet.
	lease clientv3.LeaseID
	// published is what etcd holds of ours, key -> value, as last put.
	published map[string]string
	// down: etcd was unreachable at the last try (logged once).
	down bool
}

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
		done: make(chan struct{}), published: map[string]string{}}
	go p.run()
	return p, nil
}

// Poke says something may have changed (a registration, a rename, an
// unlink): the publisher reconciles at once.
func (p *Publisher) Poke() {
	select {
	case p.poke <- struct{}{}:
	default:
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
	// Every pass renews the lease, so a third of its TTL apart; changes
	// poke a pass at once (registrations, deregistrations, renames).
	tick := time.NewTicker(p.opt.Lease / 3)
	defer tick.Stop()
	for {
		p.reconcile()
		select {
		case <-p.stop:
			return
		case <-p.poke:
		case <-tick.C:
		}
	}
}

// want is what etcd should hold: a key for every registered buffer with
// remote access, while remote access is on.
func (p *Publisher) want() map[string]string {
	out := map[string]string{}
	listen := ""
	if p.opt.Listen != nil {
		listen = p.opt.Listen()
	}
	if listen == "" {
		return out
	}
	var walk func(d *tree.Dir)
	walk = func(d *tree.Dir) {
		for _, e := range d.Entries() {
			switch n := e.Node.(type) {
			case *tree.Dir:
				walk(n)
			case *tree.File:
				desc, info, ok := p.opt.Describe(n.Buffer())
				if !ok || info.Access&remoteAccess == 0 {
					continue
				}
				var v map[string]any
				if json.Unmarshal(desc, &v) != nil {
					continue
				}
				v["host"], v["listen"], v["pd_path"] = p.opt.Host, listen, d.Path()
				b, _ := json.Marshal(v)
				out[p.key(path.Join(d.Path(), e.Name))] = string(b)
			}
		}
	}
	walk(p.opt.Tree.Root())
	return out
}

// key is the etcd key of the buffer at path in the mount.
func (p *Publisher) key(inMount string) string {
	return strings.TrimSuffix(p.opt.Prefix, "/") + "/" + p.opt.Host + inMount
}

// reconcile makes etcd hold want(): puts what is new or changed under
// the lease, deletes what is gone. A failure leaves it for the next
// round; a lease that is lost (etcd restarted without it, or down past
// its TTL) is replaced and everything put again.
func (p *Publisher) reconcile() {
	want := p.want()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.reconcileLocked(want); err != nil {
		if !p.down {
			p.opt.Log.Warn("publish: etcd unreachable; the mount goes on, publication resumes when it is back",
				"endpoints", p.opt.Endpoints, "err", err)
		}
		p.down = true
		return
	}
	if p.down {
		p.opt.Log.Info("publish: etcd is back; published again", "keys", len(p.published))
		p.down = false
	}
}

func (p *Publisher) reconcileLocked(want map[string]string) error {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if p.lease != 0 {
		// A lease etcd no longer has (expired while unreachable) cannot
		// carry keys: start over with a new one.
		if r, err := p.client.TimeToLive(ctx, p.lease); err != nil {
			return err
		} else if r.TTL <= 0 {
			p.lease, p.published = 0, map[string]string{}
		} else if _, err := p.client.KeepAliveOnce(ctx, p.lease); err != nil {
			return err
		}
	}
	if p.lease == 0 {
		r, err := p.client.Grant(ctx, int64(p.opt.Lease/time.Second))
		if err != nil {
			return err
		}
		p.lease = r.ID
		// Keys a dead daemon of this host left under its old lease go
		// with that lease; any other of this host's is stale too.
		if _, err := p.client.Delete(ctx, p.key("/"), clientv3.WithPrefix()); err != nil {
			p.lease = 0
			return err
		}
	}
	published := maps.Clone(p.published)
	for k, v := range want {
		if published[k] == v {
			continue
		}
		if _, err := p.client.Put(ctx, k, v, clientv3.WithLease(p.lease)); err != nil {
			return err
		}
		published[k] = v
	}
	for k := range published {
		if _, ok := want[k]; ok {
			continue
		}
		if _, err := p.client.Delete(ctx, k); err != nil {
			return err
		}
		delete(published, k)
	}
	p.published = published
	return nil
}

// Entry is one published buffer, as a peer finds it.
type Entry struct {
	Key        string // <prefix>/<host>/<path>
	Host, Path string // the host and the buffer's path in its mount
	Listen     string // "TRANSPORT HOST:PORT" to connect to
	PDPath     string // the directory to name (whose token the peer needs)
	Generation uint64
	Value      []byte // the whole value: the desc and the fields above
}

// fields are what Entry reads of a value.
type fields struct {
	Listen     string `json:"listen"`
	PDPath     string `json:"pd_path"`
	Generation uint64 `json:"generation"`
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

// Lookup is the buffer published as name, "HOST/PATH".
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
	var f fields
	if err := json.Unmarshal(v, &f); err != nil {
		return Entry{}, fmt.Errorf("%s: not a published buffer: %w", key, err)
	}
	host, p, _ := strings.Cut(strings.TrimPrefix(key, c.prefix+"/"), "/")
	return Entry{Key: key, Host: host, Path: "/" + p, Listen: f.Listen, PDPath: f.PDPath, Generation: f.Generation, Value: v}, nil
}
