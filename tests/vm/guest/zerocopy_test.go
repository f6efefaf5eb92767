//go:build rdma

package guest

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/remote"
)

// The zero-copy proof on a real device: with FUSE passthrough (6.12), a
// client's MAP_SHARED mapping of an mrfs file holds the very pages rxe0
// registered, so a peer's RDMA WRITE shows in it at once and a store
// through it is what the peer's READ returns, with no FUSE READ or WRITE
// request on the way.

const allAccess = "local_write,remote_write,remote_read,remote_atomic"

// serve runs the operations named on in, one per line, on c and answers
// each on out: "read ADDR RKEY LEN" (ok HEX), "write ADDR RKEY HEX" (ok),
// "fill ADDR RKEY LEN COUNT" (ok: COUNT WRITEs of LEN bytes of 0x5a),
// "fadd ADDR RKEY ADD" and "cas ADDR RKEY COMPARE SWAP" (ok OLD), with
// numbers in Go's syntax; a failed operation answers "err STATUS".
func serve(c remote.Conn, in io.Reader, out io.Writer) int {
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		n := make([]uint64, len(f))
		for i := 1; i < len(f); i++ {
			n[i], _ = strconv.ParseUint(f[i], 0, 64)
		}
		if len(f) < 4 {
			fmt.Fprintf(out, "bad %q\n", sc.Text())
			continue
		}
		addr, rkey := n[1], uint32(n[2])
		var err error
		answer := "ok"
		switch f[0] {
		case "read":
			b := make([]byte, n[3])
			if err = c.Read(b, addr, rkey); err == nil {
				answer += " " + hex.EncodeToString(b)
			}
		case "write":
			var b []byte
			if b, err = hex.DecodeString(f[3]); err == nil {
				err = c.Write(addr, rkey, b)
			}
		case "fill":
			b := bytes.Repeat([]byte{0x5a}, int(n[3]))
			for i := 0; len(f) == 5 && uint64(i) < n[4] && err == nil; i++ {
				err = c.Write(addr, rkey, b)
			}
		case "fadd":
			var old uint64
			old, err = c.FetchAdd(addr, rkey, n[3])
			answer += fmt.Sprintf(" %d", old)
		case "cas":
			var old uint64
			if len(f) == 5 {
				old, err = c.CompareSwap(addr, rkey, n[3], n[4])
			}
			answer += fmt.Sprintf(" %d", old)
		default:
			answer = "bad " + f[0]
		}
		if err != nil {
			answer = "err " + remote.Status(err).String()
		}
		fmt.Fprintln(out, answer)
	}
	return 0
}

// servingPeer is a peer process holding one rdma_cm connection to a
// PD of the daemon, doing what the test asks (serve).
type servingPeer struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// startServingPeer starts one through d.peer, with env added to its
// environment (MRFS_PEER_BUFSIZE: its connection's buffer).
func startServingPeer(t *testing.T, d *remoteDaemon, dir string, env ...string) *servingPeer {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "MRFS_PEER_OP=serve", "MRFS_PEER_ADDR="+d.peer, "MRFS_PEER_DIR="+dir, "MRFS_PEER_TOKEN="+d.tokenHex(t, dir))
	cmd.Env = append(cmd.Env, env...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &servingPeer{cmd: cmd, in: in, out: bufio.NewReader(out)}
	t.Cleanup(p.stop)
	if line := p.line(t); line != "peer: connected" {
		t.Fatalf("serving peer of %s: %q", dir, line)
	}
	return p
}

// stop ends the peer: at the end of its input it closes its connection
// and exits.
func (p *servingPeer) stop() {
	if p.cmd.ProcessState != nil {
		return
	}
	p.in.Close()
	done := make(chan error, 1)
	go func() { done <- p.cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
}

func (p *servingPeer) line(t *testing.T) string {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		s, _ := p.out.ReadString('\n')
		got <- strings.TrimSpace(s)
	}()
	select {
	case s := <-got:
		return s
	case <-time.After(30 * time.Second):
		t.Fatal("the serving peer did not answer within 30 s")
		return ""
	}
}

// do sends one operation and returns the peer's answer.
func (p *servingPeer) do(t *testing.T, format string, args ...any) string {
	t.Helper()
	op := fmt.Sprintf(format, args...)
	if _, err := fmt.Fprintln(p.in, op); err != nil {
		t.Fatalf("peer: %s: %v", op, err)
	}
	answer := p.line(t)
	t.Logf("peer: %s -> %s", op, answer)
	return answer
}

// pagemapPFN is the frame number of the page at va in pid and whether
// it is present (/proc/PID/pagemap; root sees the frame numbers).
func pagemapPFN(t *testing.T, pid int, va uint64) (uint64, bool) {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[:], int64(va/uint64(os.Getpagesize()))*8); err != nil {
		t.Fatalf("pagemap of %d at %#x: %v", pid, va, err)
	}
	e := binary.LittleEndian.Uint64(b[:])
	return e & (1<<55 - 1), e>>63 == 1
}

// sink keeps the compiler from dropping the reads that fault pages in.
var sink byte

// samePages requires every page of the client's mapping m of file to be
// the very page at the same offset of the daemon's registered range
// (user.mrfs.addr, user.mrfs.length), and returns the frame numbers.
func samePages(t *testing.T, what string, daemonPID int, m []byte, file string) []uint64 {
	t.Helper()
	addr := xattrNum(t, file, "user.mrfs.addr")
	if n := xattrNum(t, file, "user.mrfs.length"); n != uint64(len(m)) {
		t.Fatalf("%s: registered length %d, the mapping is %d bytes", what, n, len(m))
	}
	page := os.Getpagesize()
	var pfns []uint64
	for off := 0; off < len(m); off += page {
		sink += m[off] // fault the client's page in (the daemon's is pinned)
		c, cok := pagemapPFN(t, os.Getpid(), uint64(uintptr(unsafe.Pointer(&m[off]))))
		r, rok := pagemapPFN(t, daemonPID, addr+uint64(off))
		if !cok || !rok || c == 0 || c != r {
			t.Fatalf("%s: page %d: client pfn %#x (present %v), daemon's registered pfn %#x (present %v): not the registered page",
				what, off/page, c, cok, r, rok)
		}
		pfns = append(pfns, c)
	}
	t.Logf("%s: the client's %d pages are the daemon's registered pages at %#x (first pfn %#x)", what, len(pfns), addr, pfns[0])
	return pfns
}

// fuseRequestRe is go-fuse's line for a request the daemon received
// (log.fuse_requests): "rx ID: OPCODE ...".
var fuseRequestRe = regexp.MustCompile(`msg="rx [0-9]+: ([A-Z_0-9]+) `)

// fuseRequests counts the FUSE requests the daemon has received so far,
// by opcode.
func fuseRequests(d *daemon) map[string]int {
	n := map[string]int{}
	for _, m := range fuseRequestRe.FindAllStringSubmatch(d.log.String(), -1) {
		n[m[1]]++
	}
	return n
}

// waitRequests waits until the daemon has logged more than before
// requests of op: the log arrives through a pipe, a moment after the
// reply.
func waitRequests(t *testing.T, d *daemon, op string, before int) int {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if n := fuseRequests(d)[op]; n > before || time.Now().After(deadline) {
			return n
		}
		time.Sleep(20 * time.Millisecond)
	}
}

const requestLog = "[log]\nlevel = \"debug\"\nfuse_requests = true\n"

// TestZeroCopyRxe is issue 11's proof on rxe0, with zero copy on.
func TestZeroCopyRxe(t *testing.T) {
	requireGuest(t)
	if !zeroCopy() {
		t.Skip("this guest's kernel has no FUSE passthrough (Linux >= 6.9; MRFS_VM_KERNEL=6.12 has it): no zero-copy mmap to prove")
	}
	mrsBefore := ids(t, "mr")
	d := remoteMountConf(t, requestLog)
	pid := d.cmd.Process.Pid

	// The PFN proof, before and after a resize, an access change and a
	// move to another PD.
	const size = 64 << 10
	f := filepath.Join(d.dir, "zc")
	buffer(t, f, size, allAccess)
	if got := getxattr(t, f, "user.mrfs.zero_copy"); got != "1" {
		t.Fatalf("user.mrfs.zero_copy is %q, want 1", got)
	}
	fh, err := os.OpenFile(f, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	mapFile := func(n int) []byte {
		m, err := unix.Mmap(int(fh.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatalf("mmap MAP_SHARED of %d bytes: %v", n, err)
		}
		return m
	}
	m := mapFile(size)
	first := samePages(t, "created", pid, m, f)

	if err := fh.Truncate(2 * size); err != nil {
		t.Fatalf("ftruncate to %d: %v", 2*size, err)
	}
	unix.Munmap(m)
	m = mapFile(2 * size)
	defer func() { unix.Munmap(m) }()
	if grown := samePages(t, "after a resize", pid, m, f); grown[0] != first[0] {
		t.Errorf("after the resize the first page is pfn %#x, was %#x: the file's pages moved", grown[0], first[0])
	}

	lkey := xattrNum(t, f, "user.mrfs.lkey")
	for _, a := range []string{"local_write,remote_read", allAccess} {
		if err := unix.Setxattr(f, "user.mrfs.access", []byte(a), 0); err != nil {
			t.Fatalf("set access %s: %v", a, err)
		}
		if k := xattrNum(t, f, "user.mrfs.lkey"); k == lkey {
			t.Fatalf("access change to %s kept lkey %#x: not re-registered", a, k)
		}
		lkey = xattrNum(t, f, "user.mrfs.lkey")
		samePages(t, "after an access change to "+a, pid, m, f)
	}

	pdnOf := func(lkey uint64) uint64 {
		hits := byLKey(newSince(t, "mr", mrsBefore, pid), lkey)
		if len(hits) != 1 {
			t.Fatalf("rdma resource show mr: %d regions with lkey %#x, want 1", len(hits), lkey)
		}
		n, _ := hits[0].num("pdn")
		return n
	}
	oldPD := pdnOf(lkey)
	if err := os.Mkdir(filepath.Join(d.dir, "tenant"), 0o755); err != nil {
		t.Fatal(err)
	}
	moved := filepath.Join(d.dir, "tenant", "zc")
	if err := os.Rename(f, moved); err != nil {
		t.Fatal(err)
	}
	f = moved
	lkey = xattrNum(t, f, "user.mrfs.lkey")
	if pd := pdnOf(lkey); pd == oldPD {
		t.Errorf("after the move the region is still in the kernel's pd %d", pd)
	}
	samePages(t, "after a move to another PD", pid, m, f)

	// The data path, through the client's existing mapping, and a peer
	// process with one rdma_cm connection to the file's PD.
	addr, rkey := xattrNum(t, f, "user.mrfs.addr"), xattrNum(t, f, "user.mrfs.rkey")
	peer := startServingPeer(t, d, "tenant")
	msg := []byte("written by the peer over rdma_cm")
	if got := peer.do(t, "write %#x %#x %x", addr+100, rkey, msg); got != "ok" {
		t.Fatalf("peer RDMA WRITE: %s", got)
	}
	if !bytes.Equal(m[100:100+len(msg)], msg) {
		t.Fatalf("the client's mapping holds %q after the peer's WRITE, want %q", m[100:100+len(msg)], msg)
	}
	stored := []byte("stored through the client's mapping")
	copy(m[5000:], stored)
	if got := peer.do(t, "read %#x %#x %d", addr+5000, rkey, len(stored)); got != "ok "+hex.EncodeToString(stored) {
		t.Fatalf("peer RDMA READ of the client's store: %s, want ok %x", got, stored)
	}
	word := func(off int) uint64 { return binary.NativeEndian.Uint64(m[off:]) }
	binary.NativeEndian.PutUint64(m[8192:], 40)
	if got := peer.do(t, "fadd %#x %#x 2", addr+8192, rkey); got != "ok 40" {
		t.Fatalf("peer FETCH_AND_ADD: %s, want the client's 40", got)
	}
	if w := word(8192); w != 42 {
		t.Fatalf("the client sees %d after the peer's fetch-and-add of 2 to 40", w)
	}
	binary.NativeEndian.PutUint64(m[8200:], 7)
	if got := peer.do(t, "cas %#x %#x 7 99", addr+8200, rkey); got != "ok 7" {
		t.Fatalf("peer COMPARE_AND_SWAP(7, 99) after the client stored 7: %s", got)
	}
	if w := word(8200); w != 99 {
		t.Fatalf("the client sees %d after the peer's compare-and-swap to 99", w)
	}

	// No READ or WRITE reached the daemon in all of this; the count is
	// not blind: the getxattr just made shows.
	reqs := fuseRequests(d.daemon)
	getx := reqs["GETXATTR"]
	getxattr(t, f, "user.mrfs.state")
	if n := waitRequests(t, d.daemon, "GETXATTR", getx); n <= getx {
		t.Fatalf("the request log shows no GETXATTR for the test's own getxattr (%v): it counts nothing", reqs)
	}
	if reqs["READ"] != 0 || reqs["WRITE"] != 0 {
		t.Errorf("the daemon received %d FUSE READ and %d WRITE requests: the data did not bypass it", reqs["READ"], reqs["WRITE"])
	}
	t.Logf("FUSE requests the daemon received in the whole test: %v", reqs)

	// Unlink while the client maps the file: the peer's next operation
	// fails, the client keeps its bytes, the kernel lists no region.
	keep := bytes.Clone(m)
	if err := os.Remove(f); err != nil {
		t.Fatal(err)
	}
	if got := peer.do(t, "read %#x %#x 8", addr, rkey); got != "err IBV_WC_REM_ACCESS_ERR" {
		t.Errorf("the peer's READ right after the unlink: %s, want err IBV_WC_REM_ACCESS_ERR", got)
	}
	if !bytes.Equal(m, keep) {
		t.Errorf("the client's mapping changed at the unlink")
	}
	peer.stop() // its own region would count as new too
	if hits := byLKey(newSince(t, "mr", mrsBefore, pid), lkey); len(hits) != 0 {
		t.Errorf("after the unlink rdma resource show mr still lists the region: %v", hits)
	}
	if err := d.stop(t); err != nil {
		t.Errorf("mrfs exited with %v after SIGINT", err)
	}
}

// TestFuseRequestCountSeesReads: the count TestZeroCopyRxe relies on
// sees READ and WRITE requests where there are some: without zero copy
// every read(2) and write(2) goes through the daemon.
func TestFuseRequestCountSeesReads(t *testing.T) {
	requireGuest(t)
	d := mountZeroCopy(t, false, requestLog)
	f := filepath.Join(d.dir, "plain")
	if err := os.WriteFile(f, []byte("through the daemon"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(f); err != nil || string(b) != "through the daemon" {
		t.Fatalf("read back %q, %v", b, err)
	}
	if n := waitRequests(t, d, "READ", 0); n == 0 {
		t.Errorf("no READ in the request log after a read(2) without zero copy: %v", fuseRequests(d))
	}
	if n := waitRequests(t, d, "WRITE", 0); n == 0 {
		t.Errorf("no WRITE in the request log after a write(2) without zero copy: %v", fuseRequests(d))
	}
}
