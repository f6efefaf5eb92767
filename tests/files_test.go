package tests

import (
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// makeBuffer creates path and sizes it with ftruncate.
func makeBuffer(t testing.TB, path string, size int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("create %s: %v", path, err)
	}
	defer f.Close()
	if size > 0 {
		if err := f.Truncate(size); err != nil {
			t.Fatalf("ftruncate %s to %d: %v", path, size, err)
		}
	}
}

// pattern is the byte the C and Python clients write at offset i.
func pattern(i int) byte { return byte((i*131 + (i >> 12) + 7) & 0xff) }

func patternBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = pattern(i)
	}
	return b
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("stat %s: %v", path, err)
	}
	return fi.Size()
}

// requireRegistered checks a file is registered with the given length: the
// key formats, length xattr, state and size.
func requireRegistered(t *testing.T, path string, length int64) {
	t.Helper()
	if got := mustXattr(t, path, xState); got != "registered" {
		t.Errorf("%s: state %q, want registered", path, got)
	}
	if got := mustXattr(t, path, xLength); got != strconv.FormatInt(length, 10) {
		t.Errorf("%s: length %q, want %d", path, got, length)
	}
	if got := fileSize(t, path); got != length {
		t.Errorf("%s: size %d, want %d", path, got, length)
	}
	for _, k := range []string{xLkey, xRkey, xAddr} {
		if v := mustXattr(t, path, k); !hexRe.MatchString(v) {
			t.Errorf("%s: %s = %q, want %s", path, k, v, hexRe)
		}
	}
}

// requireEmpty checks an empty, unregistered file.
func requireEmpty(t *testing.T, path string) {
	t.Helper()
	if got := mustXattr(t, path, xState); got != "empty" {
		t.Errorf("%s: state %q, want empty", path, got)
	}
	for _, k := range []string{xLkey, xRkey, xAddr, xKeys} {
		_, err := getxattr(path, k)
		wantErrno(t, err, unix.ENODATA, "getxattr "+k+" of an empty file")
	}
	if got := fileSize(t, path); got != 0 {
		t.Errorf("%s: size %d, want 0", path, got)
	}
}
