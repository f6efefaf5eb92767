package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"mrfs/desc"
	"mrfs/internal/config"
	"mrfs/publish"
)

// publishFlags are the flags that say where published buffers are read
// from: --endpoints and --prefix, or else a config file's [publish].
type publishFlags struct {
	config, endpoints, prefix *string
}

func addPublishFlags(f *flag.FlagSet) publishFlags {
	return publishFlags{
		config:    f.String("config", "", "read --endpoints and --prefix from this config file's [publish]"),
		endpoints: f.String("endpoints", "", "etcd client URLs, comma-separated (default: the config's publish.endpoints)"),
		prefix:    f.String("prefix", "", "the keys' prefix (default: the config's publish.prefix, /mrfs)"),
	}
}

// dial connects to the etcd the flags name.
func (p publishFlags) dial(cmd string) (*publish.Client, error) {
	cfg, err := config.Load(*p.config)
	if err != nil {
		return nil, err
	}
	endpoints, prefix := cfg.Publish.Endpoints, cfg.Publish.Prefix
	if *p.endpoints != "" {
		endpoints = strings.Split(*p.endpoints, ",")
	}
	if *p.prefix != "" {
		prefix = *p.prefix
	}
	if len(endpoints) == 0 {
		return nil, usageError("%s: no etcd to ask: give --endpoints or a --config with publish.endpoints", cmd)
	}
	return publish.Dial(endpoints, prefix)
}

// cmdPeers lists the buffers published to etcd.
func cmdPeers(args []string, stdout io.Writer) error {
	f := flag.NewFlagSet("peers", flag.ContinueOnError)
	pf := addPublishFlags(f)
	if _, err := parse(f, args, 0); err != nil {
		return err
	}
	c, err := pf.dial("peers")
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := c.List(ctx)
	if err != nil {
		return fmt.Errorf("peers: %w", err)
	}
	w := tabwriter.NewWriter(stdout, 0, 8, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tLISTEN\tPD\tGENERATION")
	for _, e := range list {
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\n", e.Name, e.Desc.Listen, e.Desc.PDPath, e.Desc.Generation)
	}
	return w.Flush()
}

// published is a buffer found by --name, and the client that found it.
type published struct {
	c               *publish.Client
	e               publish.Entry
	name            string
	transport, peer string
}

// lookupName finds name in etcd; with gen, it must be that generation.
// With device, the peer is where that device of the mount is reached.
func lookupName(op string, pf publishFlags, name, gen, device string) (*published, error) {
	c, err := pf.dial("remote " + op)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e, err := c.Lookup(ctx, name)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("remote %s: %w", op, err)
	}
	if gen != "" && gen != fmt.Sprint(e.Desc.Generation) {
		c.Close()
		return nil, fmt.Errorf("remote %s: %s is at generation %d now, not %s: it was registered anew (new keys) since", op, name, e.Desc.Generation, gen)
	}
	listen, err := listenOf(e.Desc, device)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("remote %s: %s: %w", op, name, err)
	}
	transport, peer, ok := strings.Cut(listen, " ")
	if !ok {
		c.Close()
		return nil, fmt.Errorf("remote %s: %s: published without a listener (%q)", op, name, e.Desc.Listen)
	}
	return &published{c: c, e: e, name: name, transport: transport, peer: peer}, nil
}

// listenOf is where a peer connects to reach the buffer d describes:
// its listen address, or that of the named device.
func listenOf(d desc.Desc, device string) (string, error) {
	if device == "" {
		return d.Listen, nil
	}
	var names []string
	for _, dr := range d.Devices {
		if dr.Device == device && dr.Listen != "" {
			return dr.Listen, nil
		}
		if dr.Listen != "" {
			names = append(names, dr.Device)
		}
	}
	if len(names) == 0 {
		return "", fmt.Errorf("no device's address is published (--device %s); leave --device out", device)
	}
	return "", fmt.Errorf("no address of device %s is published; these devices have one: %s", device, strings.Join(names, ", "))
}

// lookupPauseEnv is a test hook: a duration `mrfs remote --name` waits
// between its lookup and its use, for a test to change the buffer then.
const lookupPauseEnv = "MRFS_TEST_PAUSE_AFTER_LOOKUP"

// still refuses a buffer whose generation changed since the lookup: its
// keys are not the ones found.
func (p *published) still(ctx context.Context) error {
	if d, err := time.ParseDuration(os.Getenv(lookupPauseEnv)); err == nil {
		fmt.Fprintf(os.Stderr, "mrfs: test hook %s: pausing %v\n", lookupPauseEnv, d)
		time.Sleep(d)
	}
	e, err := p.c.Lookup(ctx, p.name)
	switch {
	case err != nil:
		return fmt.Errorf("%s went between lookup and use: %w", p.name, err)
	case e.Desc.Generation != p.e.Desc.Generation:
		return fmt.Errorf("%s changed between lookup and use (generation %d, now %d): look it up again", p.name, p.e.Desc.Generation, e.Desc.Generation)
	}
	return nil
}
