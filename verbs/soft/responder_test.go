package soft

import (
	"bytes"
	"encoding/binary"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"mrfs/verbs"
	"mrfs/verbs/verbstest"
)

// mapAnon returns n bytes of anonymous shared memory (never the Go heap),
// unmapped at cleanup.
func mapAnon(t *testing.T, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

const rw = verbs.LocalWrite | verbs.RemoteRead | verbs.RemoteWrite | verbs.RemoteAtomic

func responderOf(t *testing.T, p verbs.PD) verbs.Responder {
	t.Helper()
	rp, ok := p.(verbs.ResponderPD)
	if !ok {
		t.Fatalf("%T is not a verbs.ResponderPD", p)
	}
	return rp.Responder()
}

func TestResponderOps(t *testing.T) {
	_, p := open(t, Options{})
	mem := mapAnon(t, 2*int(pageSize))
	mr := reg(t, p, addrOf(mem), uint64(len(mem)), rw)
	r := responderOf(t, p)
	base, key := mr.IOVA(), mr.RKey()

	if st := r.Write(base+10, key, []byte("hello")); st != verbs.WCSuccess {
		t.Fatalf("Write: %v", st)
	}
	if string(mem[10:15]) != "hello" {
		t.Errorf("memory after Write = %q", mem[10:15])
	}
	copy(mem[100:], "local")
	got := make([]byte, 5)
	if st := r.Read(got, base+100, key); st != verbs.WCSuccess || string(got) != "local" {
		t.Errorf("Read = %q, %v", got, st)
	}
	// The last byte of the region is in range.
	if st := r.Write(base+uint64(len(mem))-1, key, []byte{7}); st != verbs.WCSuccess || mem[len(mem)-1] != 7 {
		t.Errorf("Write of the last byte: %v", st)
	}

	binary.NativeEndian.PutUint64(mem[64:], 5)
	if old, st := r.CompareSwap(base+64, key, 5, 9); st != verbs.WCSuccess || old != 5 {
		t.Errorf("CompareSwap(5->9) = %d, %v", old, st)
	}
	if old, st := r.CompareSwap(base+64, key, 5, 11); st != verbs.WCSuccess || old != 9 {
		t.Errorf("CompareSwap that does not match = %d, %v", old, st)
	}
	if v := binary.NativeEndian.Uint64(mem[64:]); v != 9 {
		t.Errorf("word after a failed compare = %d, want 9", v)
	}
	if old, st := r.FetchAdd(base+64, key, 1<<64-2); st != verbs.WCSuccess || old != 9 {
		t.Errorf("FetchAdd = %d, %v", old, st)
	}
	if v := binary.NativeEndian.Uint64(mem[64:]); v != 7 {
		t.Errorf("word after adding -2 = %d, want 7 (wraps like a NIC's)", v)
	}
}

// TestResponderChecks: every rule of verbs-semantics.md §5, and that a
// refused operation changes no byte.
func TestResponderChecks(t *testing.T) {
	dev, p := open(t, Options{})
	other, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	defer other.Dealloc()
	mem := mapAnon(t, 3*int(pageSize))
	size := uint64(pageSize)
	full := reg(t, p, addrOf(mem), size, rw)
	ro := reg(t, p, addrOf(mem[pageSize:]), size, verbs.RemoteRead)
	wo := reg(t, p, addrOf(mem[2*pageSize:]), size, verbs.LocalWrite|verbs.RemoteWrite)
	elsewhere := reg(t, other, addrOf(mem), size, rw)
	r := responderOf(t, p)

	base, key := full.IOVA(), full.RKey()
	wrongByte := key ^ 0x01
	unknownIdx := key + 0x1000<<8
	var snapshot []byte
	for _, c := range []struct {
		name string
		op   func() verbs.WCStatus
		want verbs.WCStatus
	}{
		{"wrong rkey (key byte)", func() verbs.WCStatus { return r.Write(base, wrongByte, []byte("x")) }, verbs.WCRemAccessErr},
		{"rkey of no region", func() verbs.WCStatus { return r.Write(base, unknownIdx, []byte("x")) }, verbs.WCRemAccessErr},
		{"region of another PD", func() verbs.WCStatus { return r.Write(elsewhere.IOVA(), elsewhere.RKey(), []byte("x")) }, verbs.WCRemAccessErr},
		{"WRITE without remote_write", func() verbs.WCStatus { return r.Write(ro.IOVA(), ro.RKey(), []byte("x")) }, verbs.WCRemAccessErr},
		{"READ without remote_read", func() verbs.WCStatus { return r.Read(make([]byte, 1), wo.IOVA(), wo.RKey()) }, verbs.WCRemAccessErr},
		{"atomic without remote_atomic", func() verbs.WCStatus { _, st := r.FetchAdd(wo.IOVA(), wo.RKey(), 1); return st }, verbs.WCRemAccessErr},
		{"before the start", func() verbs.WCStatus { return r.Write(base-1, key, []byte("x")) }, verbs.WCRemAccessErr},
		{"past the end", func() verbs.WCStatus { return r.Write(base+size, key, []byte("x")) }, verbs.WCRemAccessErr},
		{"straddles the end", func() verbs.WCStatus { return r.Write(base+size-2, key, []byte("xyz")) }, verbs.WCRemAccessErr},
		{"length wraps iova", func() verbs.WCStatus { return r.Read(make([]byte, 16), ^uint64(0)-7, key) }, verbs.WCRemAccessErr},
		{"misaligned CAS", func() verbs.WCStatus { _, st := r.CompareSwap(base+4, key, 0, 1); return st }, verbs.WCRemInvReqErr},
		{"misaligned FADD", func() verbs.WCStatus { _, st := r.FetchAdd(base+1, key, 1); return st }, verbs.WCRemInvReqErr},
		// Order: range before alignment, access before alignment.
		{"misaligned and past the end", func() verbs.WCStatus { _, st := r.FetchAdd(base+size-4, key, 1); return st }, verbs.WCRemAccessErr},
		{"misaligned without remote_atomic", func() verbs.WCStatus { _, st := r.FetchAdd(wo.IOVA()+4, wo.RKey(), 1); return st }, verbs.WCRemAccessErr},
		{"misaligned with a wrong key", func() verbs.WCStatus { _, st := r.FetchAdd(base+4, wrongByte, 1); return st }, verbs.WCRemAccessErr},
		// C9-88: zero-length READ and WRITE check no key at all.
		{"zero-length WRITE, bad key", func() verbs.WCStatus { return r.Write(0, 0xdeadbeef, nil) }, verbs.WCSuccess},
		{"zero-length READ, bad key", func() verbs.WCStatus { return r.Read(nil, 0, 0xdeadbeef) }, verbs.WCSuccess},
	} {
		for i := range mem {
			mem[i] = byte(i * 7)
		}
		snapshot = append(snapshot[:0], mem...)
		if got := c.op(); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
		if !bytes.Equal(mem, snapshot) {
			t.Errorf("%s: memory changed", c.name)
		}
	}
}

// TestResponderAccessMatrix: for every combination of access flags the
// kernel accepts, each operation succeeds exactly when the region has
// the one flag it needs (local_write plays no part) and then does what
// it says; a refused one changes no byte.
func TestResponderAccessMatrix(t *testing.T) {
	_, p := open(t, Options{})
	r := responderOf(t, p)
	const off = verbstest.MatrixOff
	for _, a := range verbstest.ValidAccess {
		for _, op := range verbstest.Ops {
			t.Run(verbstest.AccessName(a)+"/"+op.Name, func(t *testing.T) {
				mem := mapAnon(t, int(pageSize))
				mr := reg(t, p, addrOf(mem), uint64(len(mem)), a)
				before := verbstest.MatrixBuffer(len(mem))
				copy(mem, before)
				iova, key, word := mr.IOVA()+off, mr.RKey(), verbstest.Word(before)
				var st verbs.WCStatus
				old := word
				switch op.Name {
				case "READ":
					got := make([]byte, 8)
					if st = r.Read(got, iova, key); st == verbs.WCSuccess && !bytes.Equal(got, before[off:off+8]) {
						t.Errorf("READ returned %x, memory holds %x", got, before[off:off+8])
					}
				case "WRITE":
					st = r.Write(iova, key, verbstest.MatrixData)
				case "CAS":
					old, st = r.CompareSwap(iova, key, word, verbstest.MatrixSwap)
				case "FADD":
					old, st = r.FetchAdd(iova, key, verbstest.MatrixAdd)
				}
				want, wantSt := before, verbs.WCRemAccessErr
				if a&op.Need != 0 {
					want, wantSt = op.Apply(before), verbs.WCSuccess
				}
				if st != wantSt || st == verbs.WCSuccess && old != word {
					t.Errorf("%s on a region with access %q: %v (old word %d), want %v (old word %d)", op.Name, verbstest.AccessName(a), st, old, wantSt, word)
				}
				if !bytes.Equal(mem, want) {
					t.Errorf("%s on a region with access %q: memory is not what it should be", op.Name, verbstest.AccessName(a))
				}
			})
		}
	}
}

// Old keys die with their registration: after a replacement that changes
// access (register anew, deregister the old: keys change), and after Dereg.
func TestResponderStaleKeys(t *testing.T) {
	_, p := open(t, Options{})
	mem := mapAnon(t, int(pageSize))
	r := responderOf(t, p)

	mr, err := p.RegMR(addrOf(mem), uint64(len(mem)), rw)
	if err != nil {
		t.Fatal(err)
	}
	old := mr.RKey()
	mr2, err := p.RegMR(addrOf(mem), uint64(len(mem)), verbs.LocalWrite|verbs.RemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	mr = mr2
	if st := r.Write(mr.IOVA(), old, []byte("x")); st != verbs.WCRemAccessErr {
		t.Errorf("old rkey after the replacement: %v", st)
	}
	if st := r.Write(mr.IOVA(), mr.RKey(), []byte("x")); st != verbs.WCSuccess {
		t.Errorf("new rkey after the replacement: %v", st)
	}
	if st := r.Read(make([]byte, 1), mr.IOVA(), mr.RKey()); st != verbs.WCRemAccessErr {
		t.Errorf("READ after the replacement dropped remote_read: %v", st)
	}
	key := mr.RKey()
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	if st := r.Write(mr.IOVA(), key, []byte("x")); st != verbs.WCRemAccessErr {
		t.Errorf("rkey after dereg: %v", st)
	}
}

func TestResponderClosedDevice(t *testing.T) {
	dev, err := New(Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	p, err := dev.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	mem := mapAnon(t, int(pageSize))
	mr, err := p.RegMR(addrOf(mem), uint64(len(mem)), rw)
	if err != nil {
		t.Fatal(err)
	}
	dev.Close()
	if st := responderOf(t, p).Write(mr.IOVA(), mr.RKey(), []byte("x")); st != verbs.WCRemAccessErr {
		t.Errorf("WRITE after the device closed: %v", st)
	}
}

// Peers' atomics on one word are atomic against each other.
func TestResponderAtomicsConcurrent(t *testing.T) {
	_, p := open(t, Options{})
	mem := mapAnon(t, int(pageSize))
	mr := reg(t, p, addrOf(mem), uint64(len(mem)), rw)
	r := responderOf(t, p)
	const peers, adds = 8, 2000
	var wg sync.WaitGroup
	for range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range adds {
				if _, st := r.FetchAdd(mr.IOVA()+8, mr.RKey(), 1); st != verbs.WCSuccess {
					t.Errorf("FetchAdd: %v", st)
					return
				}
				// A CAS increment loop contends on the same word.
				for {
					old := binary.NativeEndian.Uint64(mem[16:])
					got, st := r.CompareSwap(mr.IOVA()+16, mr.RKey(), old, old+1)
					if st != verbs.WCSuccess {
						t.Errorf("CompareSwap: %v", st)
						return
					}
					if got == old {
						break
					}
				}
			}
		}()
	}
	wg.Wait()
	if v := binary.NativeEndian.Uint64(mem[8:]); v != peers*adds {
		t.Errorf("FetchAdd total = %d, want %d", v, peers*adds)
	}
	if v := binary.NativeEndian.Uint64(mem[16:]); v != peers*adds {
		t.Errorf("CompareSwap total = %d, want %d", v, peers*adds)
	}
}

// Once Dereg returns, no responder touches the memory: the region is
// unmapped right after, as the buffer layer does, while peers keep
// hammering it. A touch after the unmap would crash the test binary.
func TestResponderDeregRace(t *testing.T) {
	_, p := open(t, Options{})
	r := responderOf(t, p)
	for range 50 {
		n := 16 * int(pageSize)
		b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		mr, err := p.RegMR(addrOf(b), uint64(n), rw)
		if err != nil {
			t.Fatal(err)
		}
		iova, key := mr.IOVA(), mr.RKey()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, n)
				for {
					select {
					case <-stop:
						return
					default:
					}
					var st verbs.WCStatus
					if g%2 == 0 {
						st = r.Read(buf, iova, key)
					} else {
						st = r.Write(iova, key, buf)
					}
					if st != verbs.WCSuccess && st != verbs.WCRemAccessErr {
						t.Errorf("status %v", st)
					}
				}
			}()
		}
		if err := mr.Dereg(); err != nil {
			t.Fatal(err)
		}
		if err := unix.Munmap(b); err != nil {
			t.Fatal(err)
		}
		close(stop)
		wg.Wait()
	}
}

// A client may truncate the memfd under the daemon's mapping; touching
// the pages past the new end faults (SIGBUS). The responder reports
// IBV_WC_REM_OP_ERR instead of crashing.
func TestResponderFault(t *testing.T) {
	_, p := open(t, Options{})
	fd, err := unix.MemfdCreate("responder-fault", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	n := 4 * int(pageSize)
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		t.Fatal(err)
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	mr := reg(t, p, addrOf(b), uint64(n), rw)
	if err := unix.Ftruncate(fd, int64(pageSize)); err != nil {
		t.Fatal(err)
	}
	r := responderOf(t, p)
	if st := r.Write(mr.IOVA(), mr.RKey(), []byte("inside")); st != verbs.WCSuccess {
		t.Errorf("WRITE inside the file: %v", st)
	}
	if st := r.Write(mr.IOVA()+2*uint64(pageSize), mr.RKey(), []byte("past")); st != verbs.WCRemOpErr {
		t.Errorf("WRITE past the truncated end: %v, want %v", st, verbs.WCRemOpErr)
	}
	if _, st := r.FetchAdd(mr.IOVA()+3*uint64(pageSize), mr.RKey(), 1); st != verbs.WCRemOpErr {
		t.Errorf("FADD past the truncated end: %v, want %v", st, verbs.WCRemOpErr)
	}
}
