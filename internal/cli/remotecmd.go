package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"mrfs/desc"
	"mrfs/remote"
	"mrfs/remote/client"
)

// stdin is where `mrfs remote write` reads its data; tests replace it.
var stdin io.Reader = os.Stdin

// dialer connects to peer and joins the PD of dir; ctx's deadline
// bounds the connection and every operation on it.
type dialer func(ctx context.Context, peer, dir string, tok remote.Token) (remote.Conn, error)

// Transport names, as user.mrfs.remote shows them.
const (
	transportTCP  = "tcp"     // the soft protocol (docs/PROTOCOL.md)
	transportRDMA = "rdma_cm" // real queue pairs (build tag rdma)
)

// transports are the dialers of `mrfs remote`; dialRDMA says how to get
// rdma_cm in a binary built without it. defaultTransport (rdma.go,
// nordma.go) is what the build's daemon serves.
var transports = map[string]dialer{transportTCP: dialSoft, transportRDMA: dialRDMA}

// dialSoft is the soft TCP client.
func dialSoft(ctx context.Context, peer, dir string, tok remote.Token) (remote.Conn, error) {
	c, err := client.Dial(ctx, peer, dir, tok)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	return c, nil
}

// transportName maps --transport to a transport name; "rdma" is short
// for rdma_cm.
func transportName(s string) (string, bool) {
	switch s {
	case transportTCP, "soft":
		return transportTCP, true
	case transportRDMA, "rdma":
		return transportRDMA, true
	}
	return "", false
}

// cmdRemote runs one one-sided operation against a peer's mrfs: read
// prints the bytes to stdout, write sends stdin, cas and fadd print the
// old value in hex. A completion in error is an error whose text starts
// with the status name (IBV_WC_REM_ACCESS_ERR), so scripts can match it.
func cmdRemote(args []string, stdout io.Writer) error { return runRemote(args, stdout, transports) }

// runRemote is cmdRemote over the given transports (tests fake them):
// the flags, then whom to reach with which token, then where in the
// buffer and with which operands, then the operation.
func runRemote(args []string, stdout io.Writer, transports map[string]dialer) error {
	if len(args) == 0 {
		return usageError("remote: want an operation: read, write, cas or fadd")
	}
	op := args[0]
	switch op {
	case "read", "write", "cas", "fadd":
	default:
		return usageError("remote: unknown operation %q; want read, write, cas or fadd", op)
	}
	if err := refuseTokenFlag(op, args[1:]); err != nil {
		return err
	}
	r := newRemoteCmd(op)
	if _, err := parse(r.f, args[1:], 0); err != nil {
		return err
	}
	r.f.Visit(func(fl *flag.Flag) { r.set[fl.Name] = true })
	if err := r.resolvePeer(); err != nil {
		return err
	}
	if r.named != nil {
		defer r.named.c.Close()
	}
	if err := r.resolveTarget(); err != nil {
		return err
	}
	if err := r.resolveOperands(); err != nil {
		return err
	}
	return r.run(stdout, transports)
}

// remoteCmd is one `mrfs remote` operation: its flags, and what they
// resolve to.
type remoteCmd struct {
	op  string
	f   *flag.FlagSet
	set map[string]bool // the flags given

	peer, pd, tokenFile, name, gen, device, addrS, rkeyS, descS, offsetS *string
	lengthS, compareS, swapS, addS, transportS                           *string
	timeout                                                              *time.Duration
	pf                                                                   publishFlags

	tok        remote.Token
	named      *published      // the buffer found by --name, or nil
	desc       *desc.Desc      // from --desc (or --name), else nil
	regions    []remote.Region // desc's, of the device connected through
	addr, rkey uint64
	length     uint64
	haveLength bool
	a, b       uint64 // cas: compare and swap; fadd: add
}

func newRemoteCmd(op string) *remoteCmd {
	f := flag.NewFlagSet("remote "+op, flag.ContinueOnError)
	return &remoteCmd{op: op, f: f, set: map[string]bool{},
		peer:       f.String("peer", "", "host:port of the mrfs daemon (its remote.listen, as user.mrfs.remote shows it)"),
		pd:         f.String("pd", "", "directory of the peer's mount whose PD to join (/ is its root), or that directory's path where it is mounted here: then --peer and --transport default to what it says, and without --token-file or "+tokenEnv+" its own user.mrfs.token goes to that peer alone"),
		tokenFile:  f.String("token-file", "", "read the PD's token (user.mrfs.token of the directory, 32 hex digits) from `FILE`; default: the "+tokenEnv+" environment variable"),
		name:       f.String("name", "", "HOST/MOUNT/PATH: the buffer as published to etcd ([publish]), which gives --peer, --pd, --transport and its regions (--desc); the token must come from --token-file or "+tokenEnv),
		gen:        f.String("generation", "", "with --name: refuse unless the buffer's registration is still this generation (as mrfs peers showed it)"),
		device:     f.String("device", "", "with --name, on a mount of several devices: connect through this device's published address (by default the first device's); the keys are always those of the device the connection comes through"),
		pf:         addPublishFlags(f),
		addrS:      f.String("addr", "", "remote address (user.mrfs.addr)"),
		rkeyS:      f.String("rkey", "", "remote key (user.mrfs.rkey)"),
		descS:      f.String("desc", "", "the buffer's user.mrfs.desc (JSON, or @FILE): its regions give each part of the range its key, so a range may span regions; replaces --addr and --rkey"),
		offsetS:    f.String("offset", "", "with --desc: where in the buffer to start (default 0)"),
		lengthS:    f.String("length", "", "bytes to read; for write, send only the first N bytes of stdin"),
		compareS:   f.String("compare", "", "cas: the value expected"),
		swapS:      f.String("swap", "", "cas: the value to store"),
		addS:       f.String("add", "", "fadd: the value to add"),
		transportS: f.String("transport", defaultTransport, "tcp (the soft protocol) or rdma_cm (alias rdma; needs -tags rdma); default: the build's"),
		timeout:    f.Duration("timeout", 10*time.Second, "bound on connecting and the operation"),
	}
}

// num parses flag name's value s (decimal or 0x hex, of bits bits); ok
// is false when it was not given.
func (r *remoteCmd) num(name, s string, bits int, required bool) (v uint64, ok bool, err error) {
	if s == "" {
		if required {
			return 0, false, usageError("remote %s: --%s is required", r.op, name)
		}
		return 0, false, nil
	}
	v, err = strconv.ParseUint(s, 0, bits)
	if err != nil {
		return 0, false, usageError("remote %s: --%s %q is not a number (decimal or 0x hex, %d bits)", r.op, name, s, bits)
	}
	return v, true, nil
}

// resolvePeer settles the peer, the PD, the transport and the token. A
// token goes only to the peer named by the source that gave it: the
// user's (--token-file, MRFS_TOKEN) to the peer the user chose, or one
// published; a local directory's own to the peer that directory names.
// A PD path found in etcd is the peer's, never a directory here.
func (r *remoteCmd) resolvePeer() error {
	op := r.op
	tok, fromUser, err := userToken(op, *r.tokenFile)
	if err != nil {
		return err
	}
	r.tok = tok
	if *r.name != "" {
		for _, other := range []string{"peer", "pd", "desc", "addr", "rkey", "transport"} {
			if r.set[other] {
				return usageError("remote %s: --name gives --%s; give one or the other", op, other)
			}
		}
		if !fromUser {
			return usageError("remote %s: --name needs the PD's token from --token-file or %s (the owner hands it over; it is never published)", op, tokenEnv)
		}
		if r.named, err = lookupName(op, r.pf, *r.name, *r.gen, *r.device); err != nil {
			return err
		}
		*r.peer, *r.pd, *r.transportS, *r.descS = r.named.peer, r.named.e.Desc.PDPath, r.named.transport, string(r.named.e.Value)
	} else if *r.gen != "" || *r.device != "" {
		return usageError("remote %s: --generation and --device need --name", op)
	}
	if *r.pd == "" {
		return usageError("remote %s: --pd is required (a directory of the peer's mount, / for its root)", op)
	}
	var here localDir
	local := false
	if r.named == nil {
		here, local = localPD(*r.pd)
	}
	switch {
	case local:
		if !fromUser {
			if r.tok, err = here.ownToken(op, *r.peer, *r.transportS, r.set); err != nil {
				return err
			}
		}
		*r.pd = here.dir
		if *r.peer == "" {
			*r.peer = here.peer
		}
		if !r.set["transport"] {
			*r.transportS = here.transport
		}
	case !fromUser:
		return usageError("remote %s: no token: give the PD's token (user.mrfs.token of the directory) with --token-file FILE or %s, or name the directory by its path where it is mounted here (--pd)", op, tokenEnv)
	}
	if *r.peer == "" {
		return usageError("remote %s: --peer is required", op)
	}
	return nil
}

// resolveTarget settles the address and key: from --desc (its regions
// give each part of the range its key) or from --addr and --rkey.
func (r *remoteCmd) resolveTarget() error {
	op := r.op
	if *r.descS == "" {
		if *r.offsetS != "" {
			return usageError("remote %s: --offset needs --desc", op)
		}
		var err error
		if r.addr, _, err = r.num("addr", *r.addrS, 64, true); err != nil {
			return err
		}
		r.rkey, _, err = r.num("rkey", *r.rkeyS, 32, true)
		return err
	}
	if *r.addrS != "" || *r.rkeyS != "" {
		return usageError("remote %s: --desc replaces --addr and --rkey; give one or the other", op)
	}
	d, err := parseDesc(*r.descS)
	if err == nil {
		_, err = d.Span()
	}
	if err != nil {
		return usageError("remote %s: --desc: %v", op, err)
	}
	off, _, err := r.num("offset", *r.offsetS, 64, false)
	if err != nil {
		return err
	}
	r.desc, r.addr = &d, uint64(d.Addr)+off
	if err := r.useDesc(d); err != nil {
		return usageError("remote %s: --offset %d: %v", op, off, err)
	}
	return nil
}

// useDesc takes the regions (and the rkey at addr) of d.
func (r *remoteCmd) useDesc(d desc.Desc) error {
	span, err := d.Span()
	if err != nil {
		return err
	}
	r.regions = r.regions[:0]
	for _, g := range span {
		r.regions = append(r.regions, remote.Region{Addr: uint64(g.Addr), Length: uint64(g.Length), RKey: uint32(g.RKey)})
	}
	reg, err := remote.RegionAt(r.regions, r.addr)
	if err != nil {
		return err
	}
	r.rkey = uint64(reg.RKey)
	return nil
}

// onDevice switches to the keys of the device c came through, when the
// desc lists several (a buffer on several devices; the desc's own keys
// are the first device's).
func (r *remoteCmd) onDevice(c remote.Conn) error {
	dc, ok := c.(remote.DeviceConn)
	if !ok || r.desc == nil || len(r.desc.Devices) == 0 || dc.Device() == "" {
		return nil
	}
	d, err := r.desc.OnDevice(dc.Device())
	if err == nil {
		err = r.useDesc(d)
	}
	return err
}

// resolveOperands settles the length, the atomics' operands and the
// timeout.
func (r *remoteCmd) resolveOperands() error {
	var err error
	if r.length, r.haveLength, err = r.num("length", *r.lengthS, 32, r.op == "read"); err != nil {
		return err
	}
	switch r.op {
	case "cas":
		if r.a, _, err = r.num("compare", *r.compareS, 64, true); err != nil {
			return err
		}
		if r.b, _, err = r.num("swap", *r.swapS, 64, true); err != nil {
			return err
		}
	case "fadd":
		if r.a, _, err = r.num("add", *r.addS, 64, true); err != nil {
			return err
		}
	}
	if *r.timeout <= 0 {
		return usageError("remote %s: --timeout %s is not positive", r.op, *r.timeout)
	}
	return nil
}

// run connects and does the operation: read prints the bytes, write
// sends stdin, cas and fadd print the old value.
func (r *remoteCmd) run(stdout io.Writer, transports map[string]dialer) error {
	op := r.op
	transport, ok := transportName(*r.transportS)
	if !ok {
		return usageError("remote %s: unknown --transport %q; want tcp or rdma_cm", op, *r.transportS)
	}
	ctx, cancel := context.WithTimeout(context.Background(), *r.timeout)
	defer cancel()
	c, err := transports[transport](ctx, *r.peer, *r.pd, r.tok)
	if err != nil {
		return fmt.Errorf("remote %s over %s: %w", op, transport, err)
	}
	defer c.Close()
	if err := r.onDevice(c); err != nil {
		return fmt.Errorf("remote %s: --desc: %w", op, err)
	}
	if r.named != nil {
		if err := r.named.still(ctx); err != nil {
			return fmt.Errorf("remote %s: %w", op, err)
		}
	}
	var old uint64
	switch op {
	case "read":
		err = r.read(c, stdout)
	case "write":
		err = r.write(c)
	case "cas":
		old, err = c.CompareSwap(r.addr, uint32(r.rkey), r.a, r.b)
	case "fadd":
		old, err = c.FetchAdd(r.addr, uint32(r.rkey), r.a)
	}
	var se *remote.StatusError
	if errors.As(err, &se) {
		return fmt.Errorf("%s: remote %s at 0x%x rkey 0x%x on %s over %s", se.Status, op, r.addr, r.rkey, *r.peer, transport)
	}
	if err != nil {
		return fmt.Errorf("remote %s over %s: %w", op, transport, err)
	}
	if op == "cas" || op == "fadd" {
		fmt.Fprintf(stdout, "0x%x\n", old)
	}
	return nil
}

func (r *remoteCmd) read(c remote.Conn, stdout io.Writer) error {
	buf := make([]byte, r.length)
	var err error
	if r.regions != nil {
		err = remote.ReadSpan(c, buf, r.addr, r.regions)
	} else {
		err = c.Read(buf, r.addr, uint32(r.rkey))
	}
	if err == nil {
		_, err = stdout.Write(buf)
	}
	return err
}

func (r *remoteCmd) write(c remote.Conn) error {
	// Read one byte past the path's limit: more is a local length error,
	// which the client reports without sending.
	limit := int64(c.MaxMessage()) + 1
	if r.regions != nil {
		limit = math.MaxInt64 // split into as many WRITEs as it takes
	}
	if r.haveLength {
		limit = int64(r.length)
	}
	data, err := io.ReadAll(io.LimitReader(stdin, limit))
	if err != nil {
		return fmt.Errorf("read stdin: %w", err)
	}
	if r.haveLength && uint64(len(data)) < r.length {
		return fmt.Errorf("--length %d but stdin had only %d bytes", r.length, len(data))
	}
	if r.regions != nil {
		return remote.WriteSpan(c, r.addr, r.regions, data)
	}
	return c.Write(r.addr, uint32(r.rkey), data)
}

// parseDesc reads a user.mrfs.desc, literal or @FILE. Its Span is the
// regions a peer may reach (a pool file's cut to its own slot).
func parseDesc(s string) (desc.Desc, error) {
	data := []byte(s)
	if name, ok := strings.CutPrefix(s, "@"); ok {
		var err error
		if data, err = os.ReadFile(name); err != nil {
			return desc.Desc{}, err
		}
	}
	return desc.Parse(data)
}

// tokenEnv is the environment variable `mrfs remote` takes a token
// from: unlike an argument, the environment is not for every user of
// the host to read.
const tokenEnv = "MRFS_TOKEN"

// refuseTokenFlag refuses --token, which would put the token in
// /proc/PID/cmdline, where every user of the host reads it.
func refuseTokenFlag(op string, args []string) error {
	for _, a := range args {
		if a == "--" {
			break
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "token" {
			return usageError("remote %s: --token is refused: a command line is readable by every user of the host (ps, /proc/PID/cmdline); give the token with --token-file FILE or the %s environment variable", op, tokenEnv)
		}
	}
	return nil
}

// userToken is the token the user gives, from --token-file (file) or
// else MRFS_TOKEN; ok is false when neither is given. The token is
// never repeated in an error.
func userToken(op, file string) (tok remote.Token, ok bool, err error) {
	switch {
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return tok, false, usageError("remote %s: --token-file: %v", op, err)
		}
		if tok, err = remote.ParseToken(string(b)); err != nil {
			return tok, false, usageError("remote %s: --token-file %s: %v", op, file, err)
		}
		return tok, true, nil
	case os.Getenv(tokenEnv) != "":
		if tok, err = remote.ParseToken(os.Getenv(tokenEnv)); err != nil {
			return tok, false, usageError("remote %s: %s: %v", op, tokenEnv, err)
		}
		return tok, true, nil
	}
	return tok, false, nil
}

// localDir is what an mrfs directory mounted here says of itself to
// remote peers.
type localDir struct{ path, transport, peer, dir string }

// localPD reads path's user.mrfs.remote ("TRANSPORT HOST:PORT DIR") when
// path is a directory of an mrfs mount here with remote access on; ok
// is false otherwise (path is then a PD's name in the peer's mount).
func localPD(path string) (localDir, bool) {
	if !filepath.IsAbs(path) {
		return localDir{}, false
	}
	where, err := getxattr(path, "user.mrfs.remote")
	if err != nil {
		return localDir{}, false
	}
	f := strings.SplitN(string(where), " ", 3)
	if len(f) != 3 {
		return localDir{}, false
	}
	return localDir{path: path, transport: f[0], peer: f[1], dir: f[2]}, true
}

// ownToken reads the directory's user.mrfs.token, for the peer the
// directory itself names: a --peer or --transport that names another is
// refused, since the token would then reach a peer no source vouched
// for.
func (l localDir) ownToken(op, peer, transport string, set map[string]bool) (remote.Token, error) {
	tr, _ := transportName(transport)
	if set["peer"] && peer != l.peer || set["transport"] && tr != l.transport {
		return remote.Token{}, usageError("remote %s: %s is mounted here, and its token goes only to the peer it names (%s %s); to reach another, give that PD's token with --token-file or %s",
			op, l.path, l.transport, l.peer, tokenEnv)
	}
	v, err := getxattr(l.path, "user.mrfs.token")
	if err != nil {
		return remote.Token{}, usageError("remote %s: read user.mrfs.token of %s: %v (only root and those who may write the directory may; or give the token with --token-file or %s)", op, l.path, err, tokenEnv)
	}
	tok, err := remote.ParseToken(string(v))
	if err != nil {
		return remote.Token{}, fmt.Errorf("remote %s: user.mrfs.token of %s: %w", op, l.path, err)
	}
	return tok, nil
}
