package tests

import (
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// pagemapEntry returns the PFN of the page holding va in pid's address space
// and whether it is present (bit 63). Needs root for the PFN bits.
func pagemapEntry(t *testing.T, pid int, va uintptr) (pfn uint64, present bool) {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		t.Fatalf("open pagemap of %d: %v", pid, err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[:], int64(va/uintptr(pageSize))*8); err != nil {
		t.Fatalf("read pagemap of %d at %#x: %v", pid, va, err)
	}
	e := binary.LittleEndian.Uint64(b[:])
	return e & (1<<55 - 1), e&(1<<63) != 0
}

// requireSamePages requires that npages pages from clientVA in clientPID and
// from daemonVA in the daemon are present and have equal, non-zero PFNs.
func requireSamePages(t *testing.T, clientPID int, clientVA uintptr, daemonPID int, daemonVA uintptr, npages int) {
	t.Helper()
	for i := 0; i < npages; i++ {
		off := uintptr(i * pageSize)
		cp, cok := pagemapEntry(t, clientPID, clientVA+off)
		dp, dok := pagemapEntry(t, daemonPID, daemonVA+off)
		if !cok || !dok || cp == 0 || dp == 0 {
			t.Fatalf("page %d: client pfn %#x present=%v, daemon pfn %#x present=%v; want both present", i, cp, cok, dp, dok)
		}
		if cp != dp {
			t.Fatalf("page %d: client pfn %#x != daemon pfn %#x at user.mrfs.addr+%#x: not zero copy", i, cp, dp, off)
		}
		// Control: distinct pages have distinct frames, so equality above
		// is not an artefact.
		if i > 0 {
			if prev, _ := pagemapEntry(t, clientPID, clientVA+off-uintptr(pageSize)); prev == cp {
				t.Fatalf("pages %d and %d share pfn %#x", i-1, i, cp)
			}
		}
	}
}

func parseHex(t *testing.T, s string) uint64 {
	t.Helper()
	if !hexRe.MatchString(s) {
		t.Fatalf("%q is not 0x-prefixed lower-case hex", s)
	}
	v, err := strconv.ParseUint(s[2:], 16, 64)
	if err != nil {
		t.Fatalf("parse %q: %v", s, err)
	}
	return v
}

// procStatusField returns the raw value of a /proc/PID/status line.
func procStatusField(t testing.TB, pid int, key string) string {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, key+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", key, pid)
	return ""
}

// procStatusKB reads a "Key:   N kB" line of /proc/PID/status.
func procStatusKB(t testing.TB, pid int, key string) int64 {
	t.Helper()
	v := procStatusField(t, pid, key)
	n, err := strconv.ParseInt(strings.TrimSuffix(v, " kB"), 10, 64)
	if err != nil {
		t.Fatalf("parse %s of %d: %q", key, pid, v)
	}
	return n
}

// sliceAddr is the virtual address of a mapping's first byte.
// mapShared opens path read-write and maps its first size bytes
// MAP_SHARED; the mapping and the file go at the test's end (or before,
// by the test: a second unmap or close does nothing).
func mapShared(t *testing.T, path string, size int) (*os.File, []byte) {
	t.Helper()
	fh, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fh.Close() })
	m, err := unix.Mmap(int(fh.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("mmap MAP_SHARED %s: %v", path, err)
	}
	track(t, m)
	return fh, m
}

// track unmaps m at the test's end unless munmap did before.
func track(t *testing.T, m []byte) {
	live.Lock()
	if live.m == nil {
		live.m = map[*byte]*int{}
	}
	tok := new(int)
	live.m[&m[0]] = tok
	live.Unlock()
	t.Cleanup(func() {
		live.Lock()
		defer live.Unlock()
		if live.m[&m[0]] == tok { // not unmapped, nor its address mapped again since
			delete(live.m, &m[0])
			unix.Munmap(m)
		}
	})
}

// live are the mappings of mapShared and track not yet unmapped, by address, each with
// a token of its own. unix.Munmap of a slice unmapped already unmaps
// whatever a parallel test has mapped at the same address since (the
// mmapper knows mappings by address): a cleanup unmaps only its own.
var live struct {
	sync.Mutex // guards: m
	m          map[*byte]*int
}

// munmap unmaps m before its test ends. A mapping a test unmaps and
// may unmap again (a defer) must be tracked instead.
func munmap(m []byte) error {
	live.Lock()
	defer live.Unlock()
	delete(live.m, &m[0])
	return unix.Munmap(m)
}

func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// memTotal is MemTotal of /proc/meminfo in bytes.
func memTotal(t *testing.T) uint64 {
	t.Helper()
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, "MemTotal:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("MemTotal %q", v)
			}
			return kb << 10
		}
	}
	t.Fatal("no MemTotal in /proc/meminfo")
	return 0
}
