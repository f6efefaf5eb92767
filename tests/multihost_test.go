package tests

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// testHost is one host of a multi-host test: a network namespace of its
// own, joined to the others' by a veth pair, and a host name of its own
// (a UTS namespace per process started there); the mount namespace is
// the test's, so the test sees every host's mount.
type testHost struct {
	name, netns, addr string
}

// network is h's network, 10.213.N.0/24.
func (h testHost) network() string { return h.addr[:strings.LastIndex(h.addr, ".")] + ".0/24" }

// in is the command prefix that runs a command on h.
func (h testHost) in(argv ...string) []string {
	return append([]string{"unshare", "--uts", "sh", "-c",
		`hostname "$0" && ns=$1 && shift && exec nsenter --net=/run/netns/"$ns" "$@"`, h.name, h.netns}, argv...)
}

// run runs argv on h and returns its output.
func (h testHost) run(t *testing.T, argv ...string) (string, string, error) {
	t.Helper()
	a := h.in(argv...)
	return run(t, a[0], a[1:]...)
}

// twoHosts makes hosts a and b on a network of their own (10.213.N.0/24),
// removed at cleanup.
func twoHosts(t *testing.T) (a, b testHost) {
	t.Helper()
	n := rand.IntN(250) + 1
	tag := fmt.Sprintf("mrfs%d-%d", os.Getpid()%10000, n)
	a = testHost{name: "hosta", netns: tag + "a", addr: fmt.Sprintf("10.213.%d.1", n)}
	b = testHost{name: "hostb", netns: tag + "b", addr: fmt.Sprintf("10.213.%d.2", n)}
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	for _, h := range []testHost{a, b} {
		ip("netns", "add", h.netns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", h.netns).Run() })
	}
	ip("link", "add", tag+"x", "netns", a.netns, "type", "veth", "peer", "name", tag+"y", "netns", b.netns)
	for _, c := range []struct {
		h    testHost
		link string
	}{{a, tag + "x"}, {b, tag + "y"}} {
		ip("-n", c.h.netns, "addr", "add", c.h.addr+"/24", "dev", c.link)
		ip("-n", c.h.netns, "link", "set", c.link, "up")
		ip("-n", c.h.netns, "link", "set", "lo", "up")
	}
	return a, b
}

// peersOn is `mrfs peers` run on h against etcd at url: the names it
// lists, or the error.
func peersOn(t *testing.T, h testHost, url string) ([]string, error) {
	t.Helper()
	out, errOut, err := h.run(t, mrfsBin, "peers", "--endpoints", url, "--prefix", "/mrfs-mh")
	if err != nil {
		return nil, fmt.Errorf("%v: %s", err, errOut)
	}
	var names []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
		if f := strings.Fields(line); len(f) > 0 {
			names = append(names, f[0])
		}
	}
	return names, nil
}

// waitPeers polls mrfs peers on h until it lists exactly want.
func waitPeers(t *testing.T, h testHost, url string, timeout time.Duration, want ...string) {
	t.Helper()
	var got []string
	var err error
	for deadline := time.Now().Add(timeout); ; time.Sleep(100 * time.Millisecond) {
		if got, err = peersOn(t, h, url); err == nil && strings.Join(got, " ") == strings.Join(want, " ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("mrfs peers on %s lists %q (%v) after %v, want %q", h.name, got, err, timeout, want)
		}
	}
}

// TestMultiHost: two hosts, each a network namespace with its own name,
// a real etcd on the first, one mrfs mount per host with [remote] and
// [publish]. A peer on host a finds a buffer of host b by name and
// writes to it, and b reads the bytes through the file; rm on b has
// made the key vanish when it returns, and the next write by name fails; a peer on a that
// guesses b's token is refused, also with the right one then, and b's
// log names it; SIGKILL of b's daemon lets its keys expire with the
// lease.
func TestMultiHost(t *testing.T) {
	if !backend.soft() {
		t.Skip("the hosts' veth pairs carry no RDMA device (rxe0 is on the guest's eth0): the multi-host test runs on the soft transport")
	}
	requireMountEnv(t)
	a, b := twoHosts(t)
	e := startEtcdOn(t, a)
	remoteOn := func(h testHost) string {
		return fmt.Sprintf("listen = \"%s:0\"\nallow_from = [\"%s\"]\nmax_failures = 3\n", h.addr, a.network())
	}
	publishTo := fmt.Sprintf("endpoints = [%q]\nprefix = \"/mrfs-mh\"\nlease = \"3s\"\nname = \"mr\"", e.url)
	da := startDaemon(t, daemonConfig{Wrapper: a.in(), Remote: remoteOn(a), Publish: publishTo})
	db := startDaemon(t, daemonConfig{Wrapper: b.in(), Remote: remoteOn(b), Publish: publishTo})
	remoteBuf(t, da.path("mine"), 4096, allRemote)
	shared := db.path("shared")
	remoteBuf(t, shared, 8192, allRemote)
	remoteBuf(t, db.path("other"), 4096, "local_write,remote_read")
	waitPeers(t, a, e.url, 10*time.Second, "hosta/mr/mine", "hostb/mr/other", "hostb/mr/shared")

	// A write by name from host a lands in host b's buffer.
	tok := mustXattr(t, db.mnt, xToken)
	write := func(tok string) (string, error) {
		argv := a.in(mrfsBin, "remote", "write", "--name", "hostb/mr/shared", "--offset", "64",
			"--endpoints", e.url, "--prefix", "/mrfs-mh")
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = append(os.Environ(), "MRFS_TOKEN="+tok)
		cmd.Stdin = strings.NewReader("across hosts")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := write(tok); err != nil {
		t.Fatalf("a write by name from host a: %v: %s", err, out)
	}
	if got, err := os.ReadFile(shared); err != nil || string(got[64:76]) != "across hosts" {
		t.Fatalf("host b's file holds %q (%v), want the write from host a", got[64:76], err)
	}

	// rm on the owner: the key is gone when rm returns, the next write
	// by name fails.
	if err := os.Remove(shared); err != nil {
		t.Fatal(err)
	}
	waitPeers(t, a, e.url, 0, "hosta/mr/mine", "hostb/mr/other")
	if out, err := write(tok); exitCode(err) != 1 || !strings.Contains(out, "no buffer is published as hostb/mr/shared") {
		t.Errorf("a write by name after rm: %v: %s; want exit 1, not published", err, out)
	}

	// A peer on host a guessing host b's token: refused, then refused
	// even with the right one, and host b's log names the source.
	remoteBuf(t, shared, 8192, allRemote)
	waitPeers(t, a, e.url, 5*time.Second, "hosta/mr/mine", "hostb/mr/other", "hostb/mr/shared")
	for i := range 3 {
		if out, err := write(fmt.Sprintf("%032x", i)); exitCode(err) != 1 || !strings.Contains(out, "wrong token") {
			t.Fatalf("guess %d: %v: %s; want exit 1, wrong token", i, err, out)
		}
	}
	if out, err := write(tok); exitCode(err) != 1 || !strings.Contains(out, "too many failed attempts") {
		t.Errorf("the right token after 3 guesses: %v: %s; want refused for a while", err, out)
	}
	warn := regexp.MustCompile(`level=WARN msg="remote: refusing a source whose attempts keep failing" peer=` + regexp.QuoteMeta(a.addr))
	if _, ok := db.waitLog(warn, readyTimeout); !ok {
		t.Errorf("host b's log does not name the guessing source %s:\n%s", a.addr, tail(db.stderr.String(), 10))
	}

	// SIGKILL of host b's daemon: its keys expire with its lease.
	db.stoppedByTest = true
	db.kill()
	waitPeers(t, a, e.url, 3*time.Second+5*time.Second*slowFactor(), "hosta/mr/mine")
}
