package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"mrfs/remote"
	"mrfs/remote/client"
)

// stdin is where `mrfs remote write` reads its data; tests replace it.
var stdin io.Reader = os.Stdin

// dialer connects to peer and joins the PD of dir; ctx's deadline
// bounds the connection and every operation on it.
type dialer func(ctx context.Context, peer, dir string) (remote.Conn, error)

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
func dialSoft(ctx context.Context, peer, dir string) (remote.Conn, error) {
	c, err := client.Dial(ctx, peer, dir)
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

// runRemote is cmdRemote over the given transports (tests fake them).
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
	f := flag.NewFlagSet("remote "+op, flag.ContinueOnError)
	peer := f.String("peer", "", "host:port of the mrfs daemon (its remote.listen, as user.mrfs.remote shows it)")
	pd := f.String("pd", "", "directory of the peer's mount whose PD to join; / is its root")
	addrS := f.String("addr", "", "remote address (user.mrfs.addr)")
	rkeyS := f.String("rkey", "", "remote key (user.mrfs.rkey)")
	lengthS := f.String("length", "", "bytes to read; for write, send only the first N bytes of stdin")
	compareS := f.String("compare", "", "cas: the value expected")
	swapS := f.String("swap", "", "cas: the value to store")
	addS := f.String("add", "", "fadd: the value to add")
	transportS := f.String("transport", defaultTransport, "tcp (the soft protocol) or rdma_cm (alias rdma; needs -tags rdma); default: the build's")
	timeout := f.Duration("timeout", 10*time.Second, "bound on connecting and the operation")
	if _, err := parse(f, args[1:], 0); err != nil {
		return err
	}
	num := func(name, s string, bits int, required bool) (uint64, bool, error) {
		if s == "" {
			if required {
				return 0, false, usageError("remote %s: --%s is required", op, name)
			}
			return 0, false, nil
		}
		v, err := strconv.ParseUint(s, 0, bits)
		if err != nil {
			return 0, false, usageError("remote %s: --%s %q is not a number (decimal or 0x hex, %d bits)", op, name, s, bits)
		}
		return v, true, nil
	}
	if *peer == "" {
		return usageError("remote %s: --peer is required", op)
	}
	if *pd == "" {
		return usageError("remote %s: --pd is required (a directory of the peer's mount, / for its root)", op)
	}
	addr, _, err := num("addr", *addrS, 64, true)
	if err != nil {
		return err
	}
	rkey, _, err := num("rkey", *rkeyS, 32, true)
	if err != nil {
		return err
	}
	length, haveLength, err := num("length", *lengthS, 32, op == "read")
	if err != nil {
		return err
	}
	var a, b uint64
	switch op {
	case "cas":
		if a, _, err = num("compare", *compareS, 64, true); err != nil {
			return err
		}
		if b, _, err = num("swap", *swapS, 64, true); err != nil {
			return err
		}
	case "fadd":
		if a, _, err = num("add", *addS, 64, true); err != nil {
			return err
		}
	}
	if *timeout <= 0 {
		return usageError("remote %s: --timeout %s is not positive", op, *timeout)
	}
	transport, ok := transportName(*transportS)
	if !ok {
		return usageError("remote %s: unknown --transport %q; want tcp or rdma_cm", op, *transportS)
	}
	dial := transports[transport]

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	c, err := dial(ctx, *peer, *pd)
	if err != nil {
		return fmt.Errorf("remote %s over %s: %w", op, transport, err)
	}
	defer c.Close()
	var old uint64
	switch op {
	case "read":
		buf := make([]byte, length)
		if err = c.Read(buf, addr, uint32(rkey)); err == nil {
			_, err = stdout.Write(buf)
		}
	case "write":
		var data []byte
		// Read one byte past the path's limit: more is a local length
		// error, which the client reports without sending.
		limit := int64(c.MaxMessage()) + 1
		if haveLength {
			limit = int64(length)
		}
		data, err = io.ReadAll(io.LimitReader(stdin, limit))
		if err != nil {
			return fmt.Errorf("remote write: read stdin: %w", err)
		}
		if haveLength && uint64(len(data)) < length {
			return fmt.Errorf("remote write: --length %d but stdin had only %d bytes", length, len(data))
		}
		err = c.Write(addr, uint32(rkey), data)
	case "cas":
		old, err = c.CompareSwap(addr, uint32(rkey), a, b)
	case "fadd":
		old, err = c.FetchAdd(addr, uint32(rkey), a)
	}
	var se *remote.StatusError
	if errors.As(err, &se) {
		return fmt.Errorf("%s: remote %s at 0x%x rkey 0x%x on %s over %s", se.Status, op, addr, rkey, *peer, transport)
	}
	if err != nil {
		return fmt.Errorf("remote %s over %s: %w", op, transport, err)
	}
	if op == "cas" || op == "fadd" {
		fmt.Fprintf(stdout, "0x%x\n", old)
	}
	return nil
}
