package tests

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"regexp"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/remote/client"
	"mrfs/remote/proto"
)

// TestHostilePeersAdmission (issue 19): a legitimate peer (the right
// token, from 127.0.0.1) connects, WRITEs and READs back again and
// again, and is never refused, while hostile peers of other networks of
// 127.0.0.0/8 (each a local user of its own: dialFrom) send first frames that are not a HELLO (16 WRITEs
// announcing 16 MiB, which must not grow the daemon by their size), hold
// 64 idle sockets renewed every remote.timeout, and make 10,000 token
// guesses from rotating addresses of 100 /24s: no guess gets in, and
// the log names every guessing network as refused.
func TestHostilePeersAdmission(t *testing.T) {
	const timeout = 2 * time.Second // short, but no legitimate hello on a loaded machine takes so long
	d := startDaemon(t, daemonConfig{Remote: fmt.Sprintf("listen = \"%s:0\"\nallow_from = %s\ntimeout = \"%s\"\n",
		backend.host, backend.allowFrom, timeout)})
	peer := d.remotePeer(t)
	if !backend.soft() {
		// Over rdma_cm the port is an RDMA CM service: its hostile peers
		// (no private data, bad versions, wrong tokens, unknown
		// directories) are TestAdmissionRDMACM's, in tests/vm/guest.
		backend.differs(t, "peers reach mrfs only through rdma_cm, with no TCP byte stream and no hello phase to abuse")
		return
	}
	addr, key := remoteBuf(t, d.path("buf"), 4096, allRemote)
	tok, err := tokenOf(peer, "/")
	if err != nil {
		t.Fatal(err)
	}

	// The legitimate peer, throughout.
	var rounds atomic.Int64
	var legitErrs []error
	stop := make(chan struct{})
	legitDone := make(chan struct{})
	go func() {
		defer close(legitDone)
		for i := uint64(0); ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := legitRound(peer, tok, addr+8*(i%512), key, i); err != nil {
				legitErrs = append(legitErrs, fmt.Errorf("round %d: %w", i, err))
			}
			rounds.Add(1)
			time.Sleep(2 * time.Millisecond) // a peer's pace, not a flood
		}
	}()
	// during waits until the legitimate peer has done n more rounds.
	during := func(what string, n int64) {
		t.Helper()
		want := rounds.Load() + n
		for deadline := time.Now().Add(60 * time.Second); rounds.Load() < want; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Errorf("the legitimate peer did %d rounds during %s, want %d", n-(want-rounds.Load()), what, n)
				return
			}
		}
	}
	during("the start", 3)

	// 1. First frames that are not a HELLO, from 127.30.N.1: 16 WRITEs
	// announcing and sending 16 MiB each, at once, a READ and garbage.
	const body = 16 << 20 // remote.max_message_size's default
	rss0, hwm0 := procStatusKB(t, d.pid(), "VmRSS"), procStatusKB(t, d.pid(), "VmHWM")
	write := binary.BigEndian.AppendUint32([]byte{byte(proto.TypeWrite), 0, 0, 0}, 16+body)
	write = append(write, make([]byte, 8+16+body)...) // wr_id, iova, rkey, reserved, the data
	read, _ := proto.Append(nil, proto.Frame{Type: proto.TypeRead, IOVA: addr, RKey: key, Length: 8})
	firsts := [][]byte{read, []byte("GET / HTTP/1.1\r\nHost: mrfs\r\n\r\n")}
	for range 16 {
		firsts = append(firsts, write)
	}
	var wg sync.WaitGroup
	for i, first := range firsts {
		wg.Go(func() {
			got, err := hostileSend(peer, fmt.Sprintf("127.30.%d.1", i), first)
			if err != nil {
				t.Errorf("first frame %d: %v", i, err)
			}
			if got == proto.TypeHelloOK {
				t.Errorf("first frame %d (%s) was answered HELLO_OK", i, proto.Type(first[0]))
			}
		})
	}
	during("the first frames", 3)
	wg.Wait()
	rss1, hwm1 := procStatusKB(t, d.pid(), "VmRSS"), procStatusKB(t, d.pid(), "VmHWM")
	t.Logf("16 first frames announcing %d MiB: VmRSS %d -> %d kB, VmHWM %d -> %d kB", body>>20, rss0, rss1, hwm0, hwm1)
	if rss1-rss0 >= body/1024 || hwm1-hwm0 >= body/1024 {
		t.Errorf("the daemon grew by the body of a first frame: VmRSS %d -> %d kB, VmHWM %d -> %d kB", rss0, rss1, hwm0, hwm1)
	}

	// 2. 64 idle sockets, from 127.20.N.1, each renewed before
	// remote.timeout (also when the daemon closed it sooner), and 3.
	// 10,000 guesses from 127.50.N.H, N < 100, H rotating.
	idleStop := make(chan struct{})
	var idleConns, idleClosed atomic.Int64
	var idle, idleUp sync.WaitGroup
	idleUp.Add(64)
	for n := range 64 {
		idle.Go(func() {
			// Each renews its socket every hold, the 64 spread over it.
			time.Sleep(time.Duration(n) * timeout * 4 / 5 / 64)
			up := sync.OnceFunc(idleUp.Done)
			defer up()
			for {
				select {
				case <-idleStop:
					return
				default:
				}
				closed, err := idleSocket(peer, fmt.Sprintf("127.20.%d.1", n), timeout*4/5, up)
				if err != nil {
					t.Errorf("idle socket from 127.20.%d.1: %v", n, err)
					return
				}
				idleConns.Add(1)
				if closed {
					idleClosed.Add(1)
				}
			}
		})
	}
	idleUp.Wait() // all 64 held before the guesses start
	during("the idle sockets", 3)
	const guesses, networks, workers = 10000, 100, 8
	var refused, closedEarly, wrong atomic.Int64
	var next atomic.Int64
	start := rounds.Load()
	for range workers {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < guesses; i = next.Add(1) - 1 {
				src := fmt.Sprintf("127.50.%d.%d", i%networks, 1+(i/networks)%254)
				got, errno, err := guess(peer, src)
				switch {
				case err != nil:
					t.Errorf("guess %d from %s: %v", i, src, err)
					return
				case got == proto.TypeHelloOK:
					t.Errorf("guess %d from %s got in", i, src)
				case got == proto.TypeHelloErr && errno == syscall.EACCES:
					refused.Add(1)
				case got == 0:
					closedEarly.Add(1) // closed to make room for newer hellos
				case wrong.Add(1) <= 5:
					t.Errorf("guess %d from %s: %s, errno %s; want HELLO_ERR EACCES", i, src, got, errno)
				}
			}
		})
	}
	wg.Wait()
	if rounds.Load() == start {
		t.Error("the legitimate peer did no round during the guesses")
	}
	during("the idle sockets and the guesses", 3)
	close(idleStop)
	idle.Wait()
	close(stop)
	<-legitDone
	t.Logf("%d guesses: %d refused with EACCES, %d closed unanswered, %d otherwise; %d idle sockets (%d closed by the daemon); %d legitimate rounds",
		guesses, refused.Load(), closedEarly.Load(), wrong.Load(), idleConns.Load(), idleClosed.Load(), rounds.Load())
	for i, err := range legitErrs {
		if i == 5 {
			t.Errorf("... and %d more", len(legitErrs)-5)
			break
		}
		t.Errorf("the legitimate peer: %v", err)
	}
	if d.exited() {
		t.Fatal("the daemon exited")
	}

	// The log names every guessing network as refused, and never the
	// legitimate peer's.
	log := d.stderr.String()
	blocked := map[string]bool{}
	// By uid, or by network where the kernel cannot tell the daemon a
	// local socket's owner (no tcp_diag, as in the qemu guest).
	for _, m := range regexp.MustCompile(`level=WARN msg="remote: refusing a source whose attempts keep failing" peer=\S+ (?:uid=(\d+)|network=(\S+))`).FindAllStringSubmatch(log, -1) {
		blocked[m[1]+m[2]] = true
	}
	named := func(src string) bool {
		a := netip.MustParseAddr(src).As4()
		return blocked[fmt.Sprint(hostileUID(src))] || blocked[fmt.Sprintf("127.%d.%d.0/24", a[1], a[2])]
	}
	var unnamed []string
	for n := range networks {
		if src := fmt.Sprintf("127.50.%d.1", n); !named(src) {
			unnamed = append(unnamed, src)
		}
	}
	if len(unnamed) > 0 {
		t.Errorf("the log does not name %d networks that guessed %d times each as refused: %v", len(unnamed), guesses/networks, unnamed)
	}
	idlers := 0
	for n := range 64 {
		if named(fmt.Sprintf("127.20.%d.1", n)) {
			idlers++
		}
	}
	t.Logf("%d networks named refused, %d of them of idle sockets", len(blocked), idlers)
	if blocked["0"] || blocked["127.0.0.0/24"] {
		t.Error("the legitimate peer's network was refused")
	}
}

// legitRound connects with the right token, WRITEs 8 bytes of round i
// at addr and READs them back.
func legitRound(peer string, tok [16]byte, addr uint64, key uint32, i uint64) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, peer, "/", tok)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	want := binary.BigEndian.AppendUint64(nil, i)
	if err := c.Write(addr, key, want); err != nil {
		return err
	}
	got := make([]byte, 8)
	if err := c.Read(got, addr, key); err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("READ %x after WRITE %x", got, want)
	}
	return nil
}

// dialFrom connects to peer from the loopback address src, with a socket
// owned by hostileUID(src): the daemon counts a local peer's failures by
// the uid that owns its socket, so each network of 127.0.0.0/8 that
// stands for another host here is a user of its own.
func dialFrom(peer, src string) (net.Conn, error) {
	runtime.LockOSThread() // the socket takes the thread's fsuid
	defer runtime.UnlockOSThread()
	unix.RawSyscall(unix.SYS_SETFSUID, uintptr(hostileUID(src)), 0, 0)
	defer unix.RawSyscall(unix.SYS_SETFSUID, 0, 0, 0)
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 20 * time.Second}
	return d.Dial("tcp", peer)
}

// hostileUID is the uid that stands for src's /24 of 127.0.0.0/8.
func hostileUID(src string) uint32 {
	a := netip.MustParseAddr(src).As4()
	return 200000 + uint32(a[1])<<8 + uint32(a[2])
}

// hostileSend sends first from src and reads what the daemon answers
// until it closes the connection: the type of the first frame of the
// answer (0 for none).
func hostileSend(peer, src string, first []byte) (proto.Type, error) {
	nc, err := dialFrom(peer, src)
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(20 * time.Second))
	go nc.Write(first) // fails once the daemon has closed the connection
	answer, err := io.ReadAll(nc)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return 0, fmt.Errorf("the daemon kept the connection: %w", err)
	}
	if len(answer) == 0 {
		return 0, nil
	}
	return proto.Type(answer[0]), nil
}

// idleSocket connects from src, calls connected, says nothing, and
// closes after hold unless the daemon closed it first (closed). It
// returns after hold either way, so that a socket is renewed at most once
// per hold.
func idleSocket(peer, src string, hold time.Duration, connected func()) (closed bool, err error) {
	start := time.Now()
	nc, err := dialFrom(peer, src)
	if err != nil {
		return false, err
	}
	defer nc.Close()
	connected()
	nc.SetReadDeadline(start.Add(hold))
	_, err = io.Copy(io.Discard, nc)
	closed = !errors.Is(err, os.ErrDeadlineExceeded)
	time.Sleep(time.Until(start.Add(hold)))
	return closed, nil
}

// guess says a hello from src with a random token and returns the type
// and errno of the answer (0: the connection closed unanswered).
func guess(peer, src string) (proto.Type, syscall.Errno, error) {
	nc, err := dialFrom(peer, src)
	if err != nil {
		return 0, 0, err
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(20 * time.Second))
	var tok [proto.TokenSize]byte
	rand.Read(tok[:])
	hello, _ := proto.Append(nil, proto.Frame{Type: proto.TypeHello, Version: proto.Version, Path: "/", Token: tok})
	if _, err := nc.Write(hello); err != nil && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
		return 0, 0, err
	}
	f, err := proto.NewReader(nc, 0).Next()
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
		return 0, 0, nil
	case err != nil:
		return 0, 0, err
	}
	return f.Type, syscall.Errno(f.Errno), nil
}
