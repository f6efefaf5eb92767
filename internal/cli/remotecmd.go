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

	"mrfs/remote/client"
)

// stdin is where `mrfs remote write` reads its data; tests replace it.
var stdin io.Reader = os.Stdin

// cmdRemote runs one one-sided operation against a peer's mrfs: read
// prints the bytes to stdout, write sends stdin, cas and fadd print the
// old value in hex. A completion in error is an error whose text starts
// with the status name (IBV_WC_REM_ACCESS_ERR), so scripts can match it.
func cmdRemote(args []string, stdout io.Writer) error {
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
	peer := f.String("peer", "", "host:port of the mrfs daemon (its remote.listen)")
	pd := f.String("pd", "/", "directory of the peer's mount whose PD to join")
	addrS := f.String("addr", "", "remote address (user.mrfs.addr)")
	rkeyS := f.String("rkey", "", "remote key (user.mrfs.rkey)")
	lengthS := f.String("length", "", "bytes to read; for write, send only the first N bytes of stdin")
	compareS := f.String("compare", "", "cas: the value expected")
	swapS := f.String("swap", "", "cas: the value to store")
	addS := f.String("add", "", "fadd: the value to add")
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

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	c, err := client.Dial(ctx, *peer, *pd)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(*timeout))
	var old uint64
	switch op {
	case "read":
		buf := make([]byte, length)
		if err = c.Read(buf, addr, uint32(rkey)); err == nil {
			_, err = stdout.Write(buf)
		}
	case "write":
		var data []byte
		// Read one byte past the peer's limit: more is a local length
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
	var se *client.StatusError
	if errors.As(err, &se) {
		return fmt.Errorf("%s: remote %s at 0x%x rkey 0x%x on %s", se.Status, op, addr, rkey, *peer)
	}
	if err != nil {
		return fmt.Errorf("remote %s: %w", op, err)
	}
	if op == "cas" || op == "fadd" {
		fmt.Fprintf(stdout, "0x%x\n", old)
	}
	return nil
}
