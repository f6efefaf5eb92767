package tests

import (
	"maps"
	"os"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestKernelForgetsIdleFiles: a second after the kernel is given a file
// (a create or a lookup), the daemon has it drop the name (fs/forget.go),
// so the daemon's and the kernel's nodes of unused files go: an idle
// file's FORGET comes at once, an open or mapped one's only after its
// last close. The files stay as they were: inode numbers, bytes,
// registration; a lookup brings a node back, forgotten again later, with
// the same node id: the file's inode number.
func TestKernelForgetsIdleFiles(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{Log: "fuse_requests = true"})
	forget := regexp.MustCompile(`: FORGET n([0-9]+) `)
	// The node ids forgotten, one for each FORGET.
	forgottenIDs := func() []uint64 {
		var ids []uint64
		for _, m := range forget.FindAllStringSubmatch(d.stderr.String(), -1) {
			id, _ := strconv.ParseUint(m[1], 10, 64)
			ids = append(ids, id)
		}
		return ids
	}
	forgotten := func() int { return len(forgottenIDs()) }
	waitForgotten := func(want int, what string) {
		t.Helper()
		deadline := time.Now().Add(readyTimeout)
		for forgotten() < want && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if got := forgotten(); got != want {
			t.Fatalf("%s: the kernel forgot %d nodes, want %d", what, got, want)
		}
	}

	if err := os.Mkdir(d.path("sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	names := []string{"idle", "sub/idle", "open", "mapped"}
	for _, n := range names {
		if err := os.WriteFile(d.path(n), []byte("bytes of "+n), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	open, err := os.Open(d.path("open"))
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	mf, err := os.OpenFile(d.path("mapped"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(mf.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	mf.Close()
	if err != nil {
		t.Fatal(err)
	}
	track(t, m)
	inos := map[string]uint64{}
	for _, n := range names {
		var st unix.Stat_t
		if err := unix.Stat(d.path(n), &st); err != nil {
			t.Fatal(err)
		}
		inos[n] = st.Ino
	}
	lkey := mustXattr(t, d.path("idle"), xLkey)

	waitForgotten(2, "the two idle files")
	time.Sleep(2 * time.Second)
	if got := forgotten(); got != 2 {
		t.Fatalf("the kernel forgot %d nodes while one file was open and one mapped, want only the 2 idle ones", got)
	}
	if err := open.Close(); err != nil {
		t.Fatal(err)
	}
	if err := munmap(m); err != nil {
		t.Fatal(err)
	}
	waitForgotten(4, "after the last close of the open and the mapped file")

	// Looked up again: the same files, with the inode numbers stat and
	// readdir gave before.
	for _, n := range names {
		var st unix.Stat_t
		if err := unix.Stat(d.path(n), &st); err != nil {
			t.Fatal(err)
		}
		if st.Ino != inos[n] {
			t.Errorf("%s: inode %d after the kernel forgot it, %d before", n, st.Ino, inos[n])
		}
		if b, err := os.ReadFile(d.path(n)); err != nil || string(b[:len("bytes of "+n)]) != "bytes of "+n {
			t.Errorf("%s read back %q, %v", n, b, err)
		}
	}
	for n, ino := range direntInos(t, d.mnt) {
		if want, ok := inos[n]; ok && ino != want {
			t.Errorf("readdir gives %s inode %d, stat %d", n, ino, want)
		}
	}
	if got := mustXattr(t, d.path("idle"), xLkey); got != lkey {
		t.Errorf("lkey %s after the kernel forgot the file, %s before: it was registered again", got, lkey)
	}
	// The lookups above made a node for each file; they go too.
	waitForgotten(8, "the files looked up again")
	// Node ids are inode numbers, the same at each lookup (a daemon that
	// adopts the connection knows them: DESIGN, Restart).
	want := map[uint64]int{}
	for _, ino := range inos {
		want[ino] += 2
	}
	got := map[uint64]int{}
	for _, id := range forgottenIDs() {
		got[id]++
	}
	if !maps.Equal(got, want) {
		t.Errorf("the node ids forgotten (id: times) %v, want each file's inode number twice %v", got, want)
	}
}

// direntInos is the inode number of each name readdir gives in dir.
func direntInos(t *testing.T, dir string) map[string]uint64 {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	inos := map[string]uint64{}
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			return inos
		}
		for b := buf[:n]; len(b) > 0; {
			de := (*syscall.Dirent)(unsafe.Pointer(&b[0]))
			name := unix.ByteSliceToString(b[19:de.Reclen])
			inos[name] = de.Ino
			b = b[de.Reclen:]
		}
	}
}
