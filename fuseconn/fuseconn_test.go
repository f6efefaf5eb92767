package fuseconn

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// The child server's environment: it serves fd 3, adopting the
// connection when childInit names a file with the INIT, else saving the
// INIT there; with childSlow set, an open of "slow" is never answered
// (the request stays read and unanswered when the child dies).
const (
	childEnv  = "FUSECONN_CHILD"
	childInit = "FUSECONN_INIT"
	childSlow = "FUSECONN_SLOW"
	childMark = "FUSECONN_MARK"
	// childGen counts the programs this process has been: a SIGHUP makes
	// the child execute itself in its place (an upgrade).
	childGen = "FUSECONN_GEN"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	os.Exit(m.Run())
}

// slowNode is a file whose open blocks forever in a slow child, after it
// says so by creating childMark.
type slowNode struct {
	fusefs.Inode
	slow bool
}

var _ = (fusefs.NodeOpener)((*slowNode)(nil))

func (n *slowNode) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	if n.slow {
		os.WriteFile(os.Getenv(childMark), nil, 0o644)
		select {}
	}
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

// whoNode reads as its server's pid and program (pid/gen), never from
// the page cache.
type whoNode struct{ fusefs.Inode }

var _ = (fusefs.NodeOpener)((*whoNode)(nil))
var _ = (fusefs.NodeReader)((*whoNode)(nil))

func (n *whoNode) Open(ctx context.Context, flags uint32) (fusefs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (n *whoNode) Read(ctx context.Context, f fusefs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	b := []byte(whoami())
	return fuse.ReadResultData(b[min(int(off), len(b)):]), 0
}

func whoami() string {
	gen := os.Getenv(childGen)
	if gen == "" {
		gen = "1"
	}
	return fmt.Sprintf("%d/%s", os.Getpid(), gen)
}

func child() int {
	zero := time.Duration(0)
	root := &fusefs.Inode{}
	opts := &fusefs.Options{EntryTimeout: &zero, AttrTimeout: &zero, NegativeTimeout: &zero,
		OnAdd: func(ctx context.Context) {
			who := &whoNode{}
			root.AddChild("who", root.NewPersistentInode(ctx, who, fusefs.StableAttr{Ino: 2}), false)
			slow := &slowNode{slow: os.Getenv(childSlow) != ""}
			root.AddChild("slow", root.NewPersistentInode(ctx, slow, fusefs.StableAttr{Ino: 3}), false)
		}}
	// Node ids are inode numbers, the same in every server.
	opts.ExternalNodeID = true
	raw := fusefs.NewNodeFS(root, opts)
	initPath := os.Getenv(childInit)
	fd, init, handed, err := Inherited()
	if err != nil {
		fmt.Println(err)
		return 1
	}
	if !handed {
		fd = 3
		if b, err := os.ReadFile(initPath); err == nil {
			init = b
		}
	}
	keep, err := unix.Dup(fd)
	if err != nil {
		fmt.Println("dup:", err)
		return 1
	}
	srv, got, err := Serve(fd, init, raw, &opts.MountOptions)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	if init == nil {
		os.WriteFile(initPath+".tmp", got, 0o644)
		os.Rename(initPath+".tmp", initPath)
	} else {
		// The kernel holds the dead server's node ids: a request for one
		// this server never answered a LOOKUP for is EIO in go-fuse.
		for _, name := range []string{"who", "slow"} {
			if st := raw.Lookup(nil, &fuse.InHeader{NodeId: fuse.FUSE_ROOT_ID}, name, &fuse.EntryOut{}); !st.Ok() {
				fmt.Println("lookup", name, st)
				return 1
			}
		}
		fmt.Println("resend:", Resend(keep))
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		<-hup
		gen, _ := strconv.Atoi(os.Getenv(childGen))
		env := []string{fmt.Sprintf("%s=%d", childGen, max(gen, 1)+1)}
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, childSlow+"=") && !strings.HasPrefix(kv, childGen+"=") {
				env = append(env, kv)
			}
		}
		fmt.Println(Exec(keep, got, "/proc/self/exe", os.Args, env))
		os.Exit(1)
	}()
	srv.Serve()
	return 0
}

// start runs a child server on the connection fd.
func start(t *testing.T, fd int, dir string, slow bool) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", childInit+"="+filepath.Join(dir, "init"), childMark+"="+filepath.Join(dir, "mark"))
	if slow {
		cmd.Env = append(cmd.Env, childSlow+"=1")
	}
	// The child's copy; the test's own stays the test's.
	dup, err := unix.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(dup), "/dev/fuse")
	defer f.Close()
	cmd.ExtraFiles = []*os.File{f}
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("child %d: %s", cmd.Process.Pid, out.String())
		}
	})
	return cmd
}

// within runs f, failing the test if it does not return in time (a FUSE
// request nobody answers blocks for good: the cleanup aborts the
// connection).
func within(t *testing.T, what string, f func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("%s: no answer in 20 s", what)
	}
}

func waitFor(t *testing.T, path string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return
		}
	}
	t.Fatalf("%s never appeared", path)
}

// wantWho requires that mnt's "who" reads as program gen of process pid.
func wantWho(t *testing.T, what, mnt string, pid, gen int) {
	t.Helper()
	within(t, what, func() error {
		b, err := os.ReadFile(filepath.Join(mnt, "who"))
		if want := fmt.Sprintf("%d/%d", pid, gen); err != nil || string(b) != want {
			return fmt.Errorf("%q, %v; want %s", b, err, want)
		}
		return nil
	})
}

// openSlow opens mnt's "slow" and returns once the (slow) server has
// read the OPEN; the open's outcome comes on the channel.
func openSlow(t *testing.T, dir, mnt string) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		f, err := os.Open(filepath.Join(mnt, "slow"))
		if err == nil {
			f.Close()
		}
		done <- err
	}()
	waitFor(t, filepath.Join(dir, "mark"))
	return done
}

// The connection outlives its server: the server is killed while it
// holds a request read and unanswered, and another process adopts the
// connection with the saved INIT (no second INIT reaches the kernel),
// asks for that request again, and serves it and the requests made
// while nobody served, without an error or ENOTCONN.
func TestAdoptAfterKill(t *testing.T) {
	dir, mnt, fd, _ := mount(t)
	a := start(t, fd, dir, true)
	waitFor(t, filepath.Join(dir, "init"))
	wantWho(t, "read through the first server", mnt, a.Process.Pid, 1)
	slowDone := openSlow(t, dir, mnt)
	a.Process.Kill()
	a.Wait()
	// Asked while nobody serves: it waits in the kernel's queue.
	whoDone := make(chan error, 1)
	go func() { _, err := os.ReadFile(filepath.Join(mnt, "who")); whoDone <- err }()

	b := start(t, fd, dir, false)
	within(t, "a read asked while nobody served", func() error { return <-whoDone })
	within(t, "an open the dead server read and never answered", func() error { return <-slowDone })
	wantWho(t, "read through the adopting server", mnt, b.Process.Pid, 1)
}

// mount mounts a FUSE filesystem in a new directory with a descriptor
// of the test's own, which it returns with the directory, the mount
// point and a function that closes it once; the cleanup aborts the
// connection, unmounts and closes the descriptor if it is not yet.
func mount(t *testing.T) (dir, mnt string, fd int, release func()) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE with a descriptor of our own needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no /dev/fuse: %v", err)
	}
	dir = t.TempDir()
	mnt = filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o755)
	fd, err := Mount(mnt, "fuseconn-test", "fuseconntest", []string{"allow_other"})
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { unix.Close(fd) }) }
	// The connection's number, for its abort file: a stat of mnt would
	// wait for a server.
	conn, err := connection(mnt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Unstick whatever still waits on the connection, then let go.
		os.WriteFile(fmt.Sprintf("/sys/fs/fuse/connections/%d/abort", conn), []byte("1"), 0)
		unix.Unmount(mnt, unix.MNT_DETACH)
		release()
	})
	return dir, mnt, fd, release
}

// An upgrade in place: the server executes a new program in its own
// process (the same pid), handing it the connection and its INIT; the
// new program adopts the connection and answers what the old one read
// and never answered. The test's own descriptor is closed first: the
// process being replaced holds the only one.
func TestExecInPlace(t *testing.T) {
	dir, mnt, fd, release := mount(t)
	a := start(t, fd, dir, true)
	waitFor(t, filepath.Join(dir, "init"))
	release()
	wantWho(t, "read through the first program", mnt, a.Process.Pid, 1)
	slowDone := openSlow(t, dir, mnt)
	a.Process.Signal(syscall.SIGHUP)
	within(t, "an open the old program read and never answered", func() error { return <-slowDone })
	wantWho(t, "read through the new program", mnt, a.Process.Pid, 2)
}

// TestHeld: the kernel says which node ids it holds: none it never
// looked up, one a client has open.
func TestHeld(t *testing.T) {
	dir, mnt, fd, _ := mount(t)
	start(t, fd, dir, false)
	waitFor(t, filepath.Join(dir, "init"))
	if held, err := Held(fd, 2); err != nil || held {
		t.Errorf("node 2 before any lookup: held %v, %v", held, err)
	}
	f, err := os.Open(filepath.Join(mnt, "who"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if held, err := Held(fd, 2); err != nil || !held {
		t.Errorf("node 2, open: held %v, %v", held, err)
	}
	if held, err := Held(fd, 3); err != nil || held {
		t.Errorf("node 3, never looked up: held %v, %v", held, err)
	}
}

// A saved INIT too short to be one is refused before anything is served.
func TestAdoptShortInit(t *testing.T) {
	fd, err := unix.Open("/dev/null", unix.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := Serve(fd, []byte{1, 2, 3}, nil, &fuse.MountOptions{}); err == nil || !strings.Contains(err.Error(), "saved INIT is 3 bytes") {
		t.Fatalf("adopt with a 3-byte INIT: %v", err)
	}
}

// connection is the minor device number of the FUSE mount at mnt, from
// mountinfo (which, unlike a stat, asks the server nothing).
func connection(mnt string) (uint32, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == mnt {
			var major, minor uint32
			if _, err := fmt.Sscanf(f[2], "%d:%d", &major, &minor); err != nil {
				return 0, err
			}
			return minor, nil
		}
	}
	return 0, fmt.Errorf("%s is not in mountinfo", mnt)
}
