package cli

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// rowsWriter notes, at the first row written after the header, how many
// rows had been asked for by then.
type rowsWriter struct {
	asked   *int
	firstAt int
	out     strings.Builder
}

func (w *rowsWriter) Write(p []byte) (int, error) {
	if w.firstAt == 0 && strings.Contains(string(p), "f") {
		w.firstAt = *w.asked
	}
	return w.out.Write(p)
}

// TestListBuffersStreams: mrfs status prints its rows a block at a time,
// so a mount of a million buffers streams: the first rows are out before
// the walk has gone much past the first block. Every file is listed once,
// depth first, and a subdirectory's files carry its path.
func TestListBuffersStreams(t *testing.T) {
	dir := t.TempDir()
	const n = 3 * statusBlock
	for i := range n {
		if err := os.WriteFile(filepath.Join(dir, "f"+strconv.Itoa(i)), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sub", "g"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	asked := 0
	w := &rowsWriter{asked: &asked}
	row := func(string) []string {
		asked++
		return []string{"1", "4096", "registered", "0x1", "0x2", "0x1000", "local_write"}
	}
	unreadable, pools, err := listBuffers(dir, w, rootStats{}, row)
	if err != nil || len(unreadable) != 0 || len(pools) != 0 {
		t.Fatalf("listBuffers: %v, unreadable %v, pools %v", err, unreadable, pools)
	}
	if asked != n+1 {
		t.Errorf("%d rows asked for, want %d", asked, n+1)
	}
	if w.firstAt == 0 || w.firstAt > statusBlock+1 {
		t.Errorf("the first rows came out after %d of %d were made; want after the first block of %d", w.firstAt, n+1, statusBlock)
	}
	lines := strings.Split(strings.TrimSpace(w.out.String()), "\n")
	if len(lines) != n+2 || !strings.HasPrefix(lines[0], "PATH") {
		t.Errorf("%d lines, want the header and %d rows", len(lines), n+1)
	}
	if !strings.Contains(w.out.String(), "\nsub/g ") {
		t.Errorf("no row for sub/g:\n%s", w.out.String()[:200])
	}
}
