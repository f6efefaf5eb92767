package tests

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeSystemdEnv makes this test binary a stand-in for systemd running
// one Type=notify service with FileDescriptorStoreMax=8 and
// Restart=on-failure (TestMain): its arguments are the service's
// command. The value is a file where it writes the names in its fd
// store, one per line, after each change.
const fakeSystemdEnv = "MRFS_TEST_FAKE_SYSTEMD"

// fakeSystemd plays systemd's side of the fd store as systemd.io's "File
// Descriptor Store" and sd_notify(3) describe it (no systemd >= 254 runs
// here: Debian 12 has 252): FDSTORE=1 keeps the datagram's descriptors
// under its FDNAME (a description already kept is not kept twice; one it
// cannot poll is refused unless FDPOLL=0), FDSTOREREMOVE=1 drops those of FDNAME; a service that dies by a signal
// or fails is started again with the store's descriptors from fd 3 on,
// LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID its own pid (a shell sets
// it, then executes the service); a stop signal goes to the service,
// whose clean exit ends this process and the store with it.
func fakeSystemd() int {
	stateFile, argv := os.Getenv(fakeSystemdEnv), os.Args[1:]
	os.Unsetenv(fakeSystemdEnv)
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "fake systemd:", err); return 1 }
	dir, err := os.MkdirTemp("", "fake-systemd-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)
	sockPath := filepath.Join(dir, "notify")
	sock, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	if err := unix.Bind(sock, &unix.SockaddrUnix{Name: sockPath}); err != nil {
		return fail(err)
	}
	type kept struct {
		name string
		fd   int
	}
	var mu sync.Mutex // guards: store
	var store []kept
	save := func() { // with mu held
		var names []string
		for _, k := range store {
			names = append(names, k.name)
		}
		slices.Sort(names)
		os.WriteFile(stateFile, []byte(strings.Join(names, "\n")), 0o644)
	}
	sameFile := func(a, b int) bool { // kcmp(KCMP_FILE), as systemd's same_fd
		pid := os.Getpid()
		r, _, errno := unix.Syscall6(unix.SYS_KCMP, uintptr(pid), uintptr(pid), 0, uintptr(a), uintptr(b), 0)
		if errno == unix.ENOSYS { // a kernel without kcmp: the same inode
			var sa, sb unix.Stat_t
			return unix.Fstat(a, &sa) == nil && unix.Fstat(b, &sb) == nil && sa.Dev == sb.Dev && sa.Ino == sb.Ino
		}
		return errno == 0 && r == 0
	}
	// flush waits until every notification sent before it is handled:
	// its own datagram comes after them.
	synced := make(chan struct{})
	flush := func() error {
		if err := unix.Sendto(sock, []byte("X-SYNC=1"), 0, &unix.SockaddrUnix{Name: sockPath}); err != nil {
			return err
		}
		<-synced
		return nil
	}
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return fail(err)
	}
	go func() {
		buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(64*4))
		for {
			n, oobn, _, _, err := unix.Recvmsg(sock, buf, oob, unix.MSG_CMSG_CLOEXEC)
			if err != nil {
				return
			}
			var fds []int
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				if r, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, r...)
				}
			}
			vars := map[string]string{}
			for _, line := range strings.Split(string(buf[:n]), "\n") {
				k, v, _ := strings.Cut(line, "=")
				vars[k] = v
			}
			if vars["X-SYNC"] == "1" { // ours: what came before is handled
				synced <- struct{}{}
				continue
			}
			mu.Lock()
			switch {
			case vars["FDSTORE"] == "1":
			next:
				for _, fd := range fds {
					for _, k := range store {
						if sameFile(k.fd, fd) {
							unix.Close(fd)
							continue next
						}
					}
					// systemd watches each for a hang-up unless FDPOLL=0,
					// and refuses one epoll refuses other than as not
					// pollable (EPERM): an O_PATH descriptor (EBADF).
					if vars["FDPOLL"] != "0" {
						err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{})
						if err != nil && err != unix.EPERM {
							fmt.Fprintf(os.Stderr, "fake systemd: %s refused: cannot poll it: %v\n", vars["FDNAME"], err)
							unix.Close(fd)
							continue
						}
					}
					store = append(store, kept{vars["FDNAME"], fd})
				}
				fds = nil
			case vars["FDSTOREREMOVE"] == "1":
				store = slices.DeleteFunc(store, func(k kept) bool {
					if k.name == vars["FDNAME"] {
						unix.Close(k.fd)
						return true
					}
					return false
				})
			}
			save()
			mu.Unlock()
			for _, fd := range fds {
				unix.Close(fd)
			}
		}
	}()

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	for starts := 0; ; starts++ {
		cmd := exec.Command("/bin/sh", append([]string{"-c", `LISTEN_PID=$$ exec "$0" "$@"`}, argv...)...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+sockPath, "FDSTORE=8")
		mu.Lock()
		var names []string
		for _, k := range store {
			c, err := unix.FcntlInt(uintptr(k.fd), unix.F_DUPFD_CLOEXEC, 0) // the store keeps its own
			if err != nil {
				mu.Unlock()
				return fail(err)
			}
			cmd.ExtraFiles = append(cmd.ExtraFiles, os.NewFile(uintptr(c), k.name))
			names = append(names, k.name)
		}
		mu.Unlock()
		if len(names) > 0 {
			cmd.Env = append(cmd.Env, "LISTEN_FDS="+strconv.Itoa(len(names)), "LISTEN_FDNAMES="+strings.Join(names, ":"))
		}
		err := cmd.Start()
		for _, f := range cmd.ExtraFiles {
			f.Close()
		}
		if err != nil {
			return fail(err)
		}
		done := make(chan struct{})
		go func() {
			for {
				select {
				case sig := <-sigs:
					cmd.Process.Signal(sig)
				case <-done:
					return
				}
			}
		}()
		cmd.Wait()
		close(done)
		if err := flush(); err != nil {
			return fail(err)
		}
		st := cmd.ProcessState.Sys().(syscall.WaitStatus)
		if !st.Signaled() && st.ExitStatus() == 0 || starts == 5 {
			return st.ExitStatus()
		}
		fmt.Fprintf(os.Stderr, "fake systemd: the service ended (%v); starting it again\n", cmd.ProcessState)
	}
}

// fdStoreNames is what the fake systemd of d keeps, by name.
func fdStoreNames(t *testing.T, state string) []string {
	t.Helper()
	raw, err := os.ReadFile(state)
	if err != nil {
		t.Fatalf("the fake systemd's store: %v", err)
	}
	return strings.Split(string(raw), "\n")
}

// TestCrashUnderFdStore: as TestCrashUnderKeeper, with systemd's fd store
// (a stand-in: fakeSystemd) holding the mount: the daemon hands it over,
// is SIGKILLed while a client holds what heldThrough holds, and the one
// started again with the store's descriptors takes the mount over. On
// another mount, upgrades and crashes in turn leave the store one
// journal, the newest, and the bytes of a file.
func TestCrashUnderFdStore(t *testing.T) {
	t.Parallel()
	base := []string{"mrfs-fuse", "mrfs-fuse-init", "mrfs-store"}
	want := func(what, state string, journal int) {
		t.Helper()
		w := append(slices.Clone(base), "mrfs-journal."+strconv.Itoa(journal))
		slices.Sort(w)
		deadline := time.Now().Add(10 * time.Second)
		for got := fdStoreNames(t, state); !slices.Equal(got, w); got = fdStoreNames(t, state) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: systemd's store holds %q, want %q", what, got, w)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	t.Run("held", func(t *testing.T) {
		t.Parallel()
		state := filepath.Join(t.TempDir(), "fdstore")
		d := startDaemon(t, daemonConfig{Remote: remoteConfig(), FakeSystemd: state})
		want("at the start", state, 0)
		heldThrough(t, d, "the crash", func() {
			killDaemon(t, d)
			want("after the crash", state, 1)
		}, false)
	})
	t.Run("turns", func(t *testing.T) {
		t.Parallel()
		state := filepath.Join(t.TempDir(), "fdstore")
		d := startDaemon(t, daemonConfig{FakeSystemd: state})
		data := patternBytes(1 << 20)
		if err := os.WriteFile(d.path("kept"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		for i := range 4 {
			if i%2 == 0 {
				if out, err := upgrade(t, d); err != nil || !strings.Contains(out, "upgraded in place") {
					t.Fatalf("mrfs upgrade: %v: %s", err, out)
				}
			} else {
				killDaemon(t, d)
			}
			want(fmt.Sprintf("after restart %d", i+1), state, i+1)
		}
		if s := readStats(t, d.mnt); s.Restarts != 4 {
			t.Errorf("after two upgrades and two crashes: %d restarts, want 4", s.Restarts)
		}
		if got, err := os.ReadFile(d.path("kept")); err != nil || !bytes.Equal(got, data) {
			t.Errorf("a file after two upgrades and two crashes: %d bytes, %v; want its 1 MiB as written", len(got), err)
		}
		// A clean stop takes the mount out of the store.
		if code := d.stop(syscall.SIGTERM); code != 0 {
			t.Fatalf("the daemon exited %d after SIGTERM", code)
		}
		if got := fdStoreNames(t, state); len(got) != 1 || got[0] != "" {
			t.Errorf("after a clean stop, systemd's store holds %q; want nothing", got)
		}
	})
}

// TestMountClearsDeadMount: a daemon killed without anything holding its
// connection leaves a mount that answers ENOTCONN; `mrfs mount` at the
// same place clears it and mounts (what a unit whose fd store systemd
// let go, or a user, finds).
func TestMountClearsDeadMount(t *testing.T) {
	t.Parallel()
	d := startDaemon(t, daemonConfig{})
	d.stoppedByTest = true
	if err := d.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-d.done
	var st unix.Statfs_t
	if err := unix.Statfs(d.mnt, &st); err != unix.ENOTCONN {
		t.Fatalf("statfs of a killed daemon's mount: %v, want ENOTCONN", err)
	}
	again := exec.Command(mrfsBin, "mount", "--config", d.cfgPath, d.mnt)
	out := &syncBuffer{}
	again.Stdout, again.Stderr = out, out
	if err := again.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- again.Wait() }()
	defer func() {
		if again.ProcessState == nil {
			again.Process.Kill()
			<-exited
		}
		if isMounted(d.mnt) {
			exec.Command("umount", "-l", d.mnt).Run()
		}
	}()
	deadline := time.Now().Add(readyTimeout)
	for {
		if _, err := getxattr(d.mnt, xStats); err == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("mrfs mount over a dead mount: %v\n%s", err, out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("mrfs mount over a dead mount: not ready within %v\n%s", readyTimeout, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	makeBuffer(t, filepath.Join(d.mnt, "buf"), 4096)
	if !strings.Contains(out.String(), "cleared the mount a daemon that died left here") {
		t.Errorf("no word of the dead mount cleared:\n%s", out)
	}
	again.Process.Signal(syscall.SIGINT)
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("mrfs mount after SIGINT: %v\n%s", err, out)
		}
	case <-time.After(stopTimeout):
		t.Fatalf("mrfs mount did not stop")
	}
	if isMounted(d.mnt) {
		t.Errorf("%s still mounted after the stop: the dead mount under it was left", d.mnt)
	}
}
