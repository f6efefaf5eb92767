package tests

import (
	"bytes"
	"crypto/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestTruncateGrowShrink: truncate grows and shrinks; size, length, keys,
// state and stats follow at once; size 0 deregisters.
func TestTruncateGrowShrink(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("rx")
	mustRun(t, "truncate", "-s", "4M", f)
	requireRegistered(t, f, 4<<20)
	if s := readStats(t, d.mnt); s.Buffers != 1 || s.RegisteredBytes != 4<<20 {
		t.Errorf("after truncate -s 4M: stats %+v", s)
	}
	mustRun(t, "truncate", "-s", "1M", f)
	requireRegistered(t, f, 1<<20)
	if s := readStats(t, d.mnt); s.RegisteredBytes != 1<<20 || s.PinnedBytes != 1<<20 {
		t.Errorf("after truncate -s 1M: stats %+v", s)
	}
	if out := mustRun(t, "stat", "-c", "%s", f); strings.TrimSpace(out) != "1048576" {
		t.Errorf("stat -c %%s = %q, want 1048576", out)
	}
	mustRun(t, "truncate", "-s", "6000", f) // not a page multiple
	requireRegistered(t, f, 6000)
	mustRun(t, "truncate", "-s", "0", f)
	requireEmpty(t, f)
	if s := readStats(t, d.mnt); s.Buffers != 1 || s.RegisteredBytes != 0 || s.PinnedBytes != 0 {
		t.Errorf("after truncate -s 0: stats %+v", s)
	}
	mustRun(t, "truncate", "-s", "8K", f)
	requireRegistered(t, f, 8192)
}

// TestResizeKeepsPrefix: a resize keeps the first min(old,new) bytes and the
// grown tail reads as zeros.
func TestResizeKeepsPrefix(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("buf")
	const big = 64<<10 + 123
	data := patternBytes(big)
	if err := os.WriteFile(f, data, 0o600); err != nil {
		t.Fatal(err)
	}
	requireRegistered(t, f, big)

	check := func(size, prefix int) {
		t.Helper()
		got, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != size {
			t.Fatalf("read %d bytes, want %d", len(got), size)
		}
		if !bytes.Equal(got[:prefix], data[:prefix]) {
			t.Errorf("size %d: first %d bytes differ from what was written", size, prefix)
		}
		if !bytes.Equal(got[prefix:], make([]byte, size-prefix)) {
			t.Errorf("size %d: bytes past %d are not zero", size, prefix)
		}
		requireRegistered(t, f, int64(size))
	}

	// Shrink through ftruncate on an open fd, then grow with truncate(2).
	fh, err := os.OpenFile(f, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := fh.Truncate(5000); err != nil {
		t.Fatal(err)
	}
	fh.Close()
	check(5000, 5000)
	if err := os.Truncate(f, 3*4096+7); err != nil {
		t.Fatal(err)
	}
	check(3*4096+7, 5000)
	mustRun(t, "truncate", "-s", "1M", f)
	check(1<<20, 5000)
	mustRun(t, "truncate", "-s", "100", f)
	check(100, 100)
}

// TestEchoHello: `echo hello > f` leaves a registered 6-byte file, also when
// f existed and was larger (O_TRUNC).
func TestEchoHello(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("msg")
	mustSh(t, "echo hello > "+f)
	requireRegistered(t, f, 6)
	if out := mustRun(t, "cat", f); out != "hello\n" {
		t.Errorf("cat = %q, want hello\\n", out)
	}
	if s := readStats(t, d.mnt); s.RegisteredBytes != 6 {
		t.Errorf("stats registered_bytes = %d, want 6", s.RegisteredBytes)
	}

	g := d.path("big")
	mustRun(t, "truncate", "-s", "4M", g)
	mustSh(t, "echo hello > "+g)
	requireRegistered(t, g, 6)
	if out := mustRun(t, "cat", g); out != "hello\n" {
		t.Errorf("cat after O_TRUNC = %q", out)
	}
	mustSh(t, "echo world >> "+g)
	requireRegistered(t, g, 12)
	if out := mustRun(t, "cat", g); out != "hello\nworld\n" {
		t.Errorf("cat after append = %q", out)
	}
}

// TestCpBinLs: cp of a binary; cmp equal; registered with its size.
func TestCpBinLs(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	mustRun(t, "cp", "/bin/ls", d.mnt+"/")
	mustRun(t, "cmp", "/bin/ls", d.path("ls"))
	requireRegistered(t, d.path("ls"), fileSize(t, "/bin/ls"))
}

// TestDd: dd in (O_TRUNC, block writes) and out.
func TestDd(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	src := filepath.Join(t.TempDir(), "src")
	data := make([]byte, 1<<20+4096)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f := d.path("dd")
	mustRun(t, "dd", "if="+src, "of="+f, "bs=64k", "status=none")
	requireRegistered(t, f, int64(len(data)))
	mustRun(t, "cmp", src, f)
	out := filepath.Join(t.TempDir(), "out")
	mustRun(t, "dd", "if="+f, "of="+out, "bs=1M", "status=none")
	mustRun(t, "cmp", src, out)
	// Partial overwrite in place keeps the size.
	mustRun(t, "dd", "if=/dev/zero", "of="+f, "bs=4096", "count=2", "seek=1", "conv=notrunc", "status=none")
	requireRegistered(t, f, int64(len(data)))
	got, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	copy(data[4096:3*4096], make([]byte, 2*4096))
	if !bytes.Equal(got, data) {
		t.Errorf("content after dd conv=notrunc differs")
	}
}

// TestFallocateGrows: fallocate -l grows the buffer and keeps its content.
func TestFallocateGrows(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("fa")
	makeBuffer(t, f, 0)
	mustRun(t, "fallocate", "-l", "2M", f)
	requireRegistered(t, f, 2<<20)
	if s := readStats(t, d.mnt); s.RegisteredBytes != 2<<20 {
		t.Errorf("stats after fallocate: %+v", s)
	}
	g := d.path("fb")
	if err := os.WriteFile(g, []byte("prefix"), 0o600); err != nil {
		t.Fatal(err)
	}
	mustRun(t, "fallocate", "-l", "8192", g)
	requireRegistered(t, g, 8192)
	got, err := os.ReadFile(g)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(got, []byte("prefix")) || !bytes.Equal(got[6:], make([]byte, 8192-6)) {
		t.Errorf("fallocate lost the content or did not zero the tail")
	}
}

// TestSizeVisibleWhileOpen: a write past EOF through a still-open fd is
// visible to stat, ls -l and the length xattr at once (timeouts 0).
func TestSizeVisibleWhileOpen(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("grow")
	fh, err := os.OpenFile(f, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	for _, size := range []int{10000, 3 * 4096, 300000} {
		if _, err := fh.WriteAt(patternBytes(size), 0); err != nil {
			t.Fatal(err)
		}
		want := strconv.Itoa(size)
		if got := fileSize(t, f); got != int64(size) {
			t.Errorf("stat size %d, want %d while the writer keeps the fd open", got, size)
		}
		if out := mustRun(t, "stat", "-c", "%s", f); strings.TrimSpace(out) != want {
			t.Errorf("stat(1) in another process: %q, want %s", out, want)
		}
		if out := mustRun(t, "ls", "-l", f); len(strings.Fields(out)) < 5 || strings.Fields(out)[4] != want {
			t.Errorf("ls -l: %q, want size %s", out, want)
		}
		if got := mustXattr(t, f, xLength); got != want {
			t.Errorf("length xattr %q, want %s", got, want)
		}
		if got := mustXattr(t, f, xState); got != "registered" {
			t.Errorf("state %q, want registered", got)
		}
	}
	if err := fh.Close(); err != nil {
		t.Fatal(err)
	}
	requireRegistered(t, f, 300000)
	if s := readStats(t, d.mnt); s.RegisteredBytes != 300000 {
		t.Errorf("stats registered_bytes = %d, want 300000", s.RegisteredBytes)
	}
}

// TestDefaultSizeAndUmask: buffers.default_size registers new files at once;
// mount.umask applies to the creator's mode.
func TestDefaultSizeAndUmask(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Buffers: `default_size = "64KiB"`, Mount: `umask = "027"`})
	f := d.path("f")
	fh, err := os.OpenFile(f, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		t.Fatal(err)
	}
	fh.Close()
	requireRegistered(t, f, 64<<10)
	fi, err := os.Stat(f)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o640 {
		t.Errorf("mode %v with umask 027 and requested 0666, want 0640", fi.Mode().Perm())
	}
}

// TestDefaultUmask: new files are 0600 by default whatever mode is asked.
func TestDefaultUmask(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	f := d.path("f")
	fh, err := os.OpenFile(f, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		t.Fatal(err)
	}
	fh.Close()
	requireEmpty(t, f)
	fi, err := os.Stat(f)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600 (default umask 077)", fi.Mode().Perm())
	}
}
