//go:build rdma

package rdmacm

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/remote"
	"mrfs/verbs"
	"mrfs/verbs/ibv"
)

// DialOptions tune a client connection.
type DialOptions struct {
	// Timeout bounds each step: address and route resolution, the
	// connection, and every operation's completion. 0 is 10 s.
	Timeout time.Duration
	// BufSize is the local buffer registered at connect time; larger
	// operations register a larger one. 0 is 64 KiB.
	BufSize int
	// Token is the PD's (user.mrfs.token of the directory): without the
	// right one mrfs refuses the connection with EACCES.
	Token remote.Token
}

// Conn is a client connection: its own PD, an RC QP connected to a QP
// of mrfs in the PD of the directory it named, and a registered local
// buffer (a memfd mapping, never the Go heap) that operations go through.
// Its methods are not safe for concurrent use.
type Conn struct {
	ch      *ibv.EventChannel
	id      ibv.CMID
	dev     verbs.Device
	pd      verbs.PD
	qp      *ibv.QP
	timeout time.Duration

	memfd int
	mem   []byte
	mr    verbs.MR

	device string // mrfs's device the connection came through, from its accept
}

var _ remote.DeviceConn = (*Conn)(nil)

// MaxMessage is the largest RDMA message (2^31 bytes, the IB
// specification's bound and rxe's max_msg_sz).
const MaxMessage = 1 << 31

// DialContext is Dial with each step bounded by what is left of ctx's
// deadline (10 s without one).
func DialContext(ctx context.Context, peer, dir string, tok remote.Token) (*Conn, error) {
	timeout := 10 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	if timeout <= 0 {
		return nil, fmt.Errorf("connect to %s: %w", peer, context.DeadlineExceeded)
	}
	return Dial(peer, dir, DialOptions{Timeout: timeout, Token: tok})
}

// Dial connects to the mrfs at peer ("10.0.2.15:7471") and asks for a
// QP in the PD of dir (relative to the mount's root). A refusal by mrfs
// is a *remote.RefusedError with its errno (ENOENT: no such directory;
// EACCES: not in allow_from, a wrong token, or a source refused for a
// while after failures; EBUSY: too many connections);
// ECONNREFUSED when nothing listens there.
func Dial(peer, dir string, opt DialOptions) (*Conn, error) {
	if opt.Timeout <= 0 {
		opt.Timeout = 10 * time.Second
	}
	if opt.BufSize <= 0 {
		opt.BufSize = 64 << 10
	}
	priv, err := encodeConnect(dir, opt.Token)
	if err != nil {
		return nil, err
	}
	ap, err := parseAddrPort(peer)
	if err != nil {
		return nil, err
	}
	c := &Conn{timeout: opt.Timeout, memfd: -1}
	fail := func(err error) (*Conn, error) {
		c.Close()
		return nil, fmt.Errorf("connect to mrfs at %s (pd %q): %w", peer, dir, err)
	}
	if c.ch, err = ibv.NewEventChannel(); err != nil {
		return fail(err)
	}
	if c.id, err = c.ch.CreateID(); err != nil {
		return fail(err)
	}
	if err := c.id.ResolveAddr(ap, opt.Timeout); err != nil {
		return fail(err)
	}
	if _, err := c.expect(ibv.EventAddrResolved); err != nil {
		return fail(err)
	}
	if err := c.id.ResolveRoute(opt.Timeout); err != nil {
		return fail(err)
	}
	if _, err := c.expect(ibv.EventRouteResolved); err != nil {
		return fail(err)
	}
	// The device the route goes through, on the id's own context, so
	// the QP can live in a PD of it.
	if c.dev, err = ibv.OpenID(c.id); err != nil {
		return fail(err)
	}
	if c.pd, err = c.dev.AllocPD(); err != nil {
		return fail(err)
	}
	if err := c.grow(opt.BufSize); err != nil {
		return fail(err)
	}
	if c.qp, err = c.id.CreateQP(c.pd, 16); err != nil {
		return fail(err)
	}
	// initiator depth > 0: this side issues READs and atomics, and the
	// responder's QP allows them only then.
	if err := c.id.Connect(priv, 0, 4); err != nil {
		return fail(err)
	}
	ev, err := c.expect(ibv.EventEstablished)
	if err != nil {
		if ev.Type == ibv.EventRejected {
			if errno, msg, ok := decodeReject(ev.Private); ok {
				return fail(&remote.RefusedError{Errno: errno, Msg: msg})
			}
			return fail(fmt.Errorf("rejected (reason %d; nothing listens there?): %w", ev.Status, syscall.ECONNREFUSED))
		}
		return fail(err)
	}
	c.device, _ = decodeAccept(ev.Private)
	return c, nil
}

// Device is the name of mrfs's device the connection came through, ""
// when mrfs did not say: with buffers on several devices, the keys of
// that device (desc's devices) are the ones that work on it.
func (c *Conn) Device() string { return c.device }

// expect waits for the next event of the connection and wants typ; the
// event is returned also when it is another one.
func (c *Conn) expect(typ ibv.EventType) (ibv.Event, error) {
	ev, err := c.ch.Wait(c.timeout)
	if err != nil {
		return ev, fmt.Errorf("waiting for %s: %w", typ, err)
	}
	if ev.Type != typ {
		errno := syscall.EIO
		switch ev.Type {
		case ibv.EventAddrError, ibv.EventRouteError, ibv.EventUnreachable:
			errno = syscall.EHOSTUNREACH
		case ibv.EventRejected:
			errno = syscall.ECONNREFUSED
		}
		return ev, fmt.Errorf("got %s (status %d), want %s: %w", ev.Type, ev.Status, typ, errno)
	}
	return ev, nil
}

// grow makes the local buffer at least n bytes.
func (c *Conn) grow(n int) error {
	if n <= len(c.mem) {
		return nil
	}
	n = (n + 4095) &^ 4095
	c.freeBuf()
	fd, err := unix.MemfdCreate("mrfs-rdmacm-client", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("memfd_create: %w", err)
	}
	c.memfd = fd
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		return fmt.Errorf("ftruncate the local buffer to %d: %w", n, err)
	}
	mem, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap the local buffer: %w", err)
	}
	c.mem = mem
	// Local write: READs and atomics land here.
	if c.mr, err = c.pd.RegMR(uintptr(unsafe.Pointer(&mem[0])), uint64(n), verbs.LocalWrite); err != nil {
		return fmt.Errorf("register the local buffer: %w", err)
	}
	return nil
}

func (c *Conn) freeBuf() error {
	var errs []error
	if c.mr != nil {
		errs = append(errs, c.mr.Dereg())
		c.mr = nil
	}
	if c.mem != nil {
		errs = append(errs, unix.Munmap(c.mem))
		c.mem = nil
	}
	if c.memfd >= 0 {
		errs = append(errs, unix.Close(c.memfd))
		c.memfd = -1
	}
	return errors.Join(errs...)
}

func (c *Conn) do(name string, r ibv.Request) error {
	if c.qp == nil {
		return fmt.Errorf("%s: connection closed: %w", name, syscall.ENOTCONN)
	}
	r.Local, r.LKey = uintptr(unsafe.Pointer(&c.mem[0])), c.mr.LKey()
	st, err := c.qp.Do(r, c.timeout)
	if err != nil {
		return fmt.Errorf("%s at 0x%x rkey 0x%x: %w", name, r.RemoteAddr, r.RKey, err)
	}
	if st != verbs.WCSuccess {
		return &remote.StatusError{Op: name, Status: st}
	}
	return nil
}

// MaxMessage is the largest READ or WRITE: MaxMessage.
func (c *Conn) MaxMessage() uint32 { return MaxMessage }

// Write performs an RDMA WRITE of data to addr under rkey.
func (c *Conn) Write(addr uint64, rkey uint32, data []byte) error {
	if uint64(len(data)) > MaxMessage {
		return &remote.StatusError{Op: "RDMA WRITE", Status: verbs.WCLocLenErr}
	}
	if err := c.grow(max(len(data), 1)); err != nil {
		return err
	}
	copy(c.mem, data)
	return c.do("RDMA WRITE", ibv.Request{Op: ibv.OpWrite, Length: uint32(len(data)), RemoteAddr: addr, RKey: rkey})
}

// Read performs an RDMA READ of len(dst) bytes at addr under rkey into
// dst.
func (c *Conn) Read(dst []byte, addr uint64, rkey uint32) error {
	if uint64(len(dst)) > MaxMessage {
		return &remote.StatusError{Op: "RDMA READ", Status: verbs.WCLocLenErr}
	}
	if err := c.grow(max(len(dst), 1)); err != nil {
		return err
	}
	if err := c.do("RDMA READ", ibv.Request{Op: ibv.OpRead, Length: uint32(len(dst)), RemoteAddr: addr, RKey: rkey}); err != nil {
		return err
	}
	copy(dst, c.mem)
	return nil
}

// CompareSwap performs an 8-byte ATOMIC_CMP_AND_SWP and returns the old
// value (host order: the NIC works on the target's native order, as
// on any RoCE device).
func (c *Conn) CompareSwap(addr uint64, rkey uint32, compare, swap uint64) (uint64, error) {
	if err := c.do("ATOMIC_CMP_AND_SWP", ibv.Request{Op: ibv.OpCompareSwap, RemoteAddr: addr, RKey: rkey, CompareAdd: compare, Swap: swap}); err != nil {
		return 0, err
	}
	return binary.NativeEndian.Uint64(c.mem[:8]), nil
}

// FetchAdd performs an 8-byte ATOMIC_FETCH_AND_ADD and returns the old
// value.
func (c *Conn) FetchAdd(addr uint64, rkey uint32, add uint64) (uint64, error) {
	if err := c.do("ATOMIC_FETCH_AND_ADD", ibv.Request{Op: ibv.OpFetchAdd, RemoteAddr: addr, RKey: rkey, CompareAdd: add}); err != nil {
		return 0, err
	}
	return binary.NativeEndian.Uint64(c.mem[:8]), nil
}

// WaitDisconnect waits until mrfs ends the connection (rmdir of the
// directory, unmount) and reports DISCONNECTED; ETIMEDOUT otherwise.
func (c *Conn) WaitDisconnect(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ev, err := c.ch.Wait(time.Until(deadline))
		if err != nil {
			return fmt.Errorf("waiting for DISCONNECTED: %w", err)
		}
		switch ev.Type {
		case ibv.EventDisconnected:
			return nil
		case ibv.EventDeviceRemoval:
			// The device under the connection went: nothing more
			// comes, and this process must let go of it.
			return fmt.Errorf("waiting for DISCONNECTED: the local device was removed: %w", syscall.ENODEV)
		}
	}
}

// Close disconnects and frees the QP, the buffer, the PD and the device.
func (c *Conn) Close() error {
	var errs []error
	if c.qp != nil {
		c.id.Disconnect()
		errs = append(errs, c.qp.Destroy())
		c.qp = nil
	}
	errs = append(errs, c.freeBuf())
	if c.pd != nil {
		errs = append(errs, c.pd.Dealloc())
		c.pd = nil
	}
	if c.dev != nil {
		errs = append(errs, c.dev.Close())
		c.dev = nil
	}
	// Last: the device lives on the id's context.
	if c.id.Valid() {
		errs = append(errs, c.id.Destroy())
		c.id = ibv.CMID{}
	}
	if c.ch != nil {
		c.ch.Close()
		c.ch = nil
	}
	return errors.Join(errs...)
}
