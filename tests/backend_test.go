package tests

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

// testBackend is the verbs backend the mounted tests run on: soft (the
// default: every machine has it) or rdma (MRFS_TEST_BACKEND=rdma), which
// tests/vm/run sets in its Soft-RoCE guest, with an mrfs built with -tags
// rdma as MRFS_BIN and this package built with -tags rdma too. Tests
// check the same contract on both; where a real device legitimately
// differs from the soft model, the test says how and checks that instead.
type testBackend struct {
	name   string // verbs.backend
	device string // the device it mounts: soft0, or MRFS_TEST_DEVICE (rxe0)
	// host is the address peers reach the daemon at: loopback for the
	// soft transport; for rdma_cm the address of the device's netdev,
	// MRFS_TEST_REMOTE_HOST (rxe0 carries the guest's 10.0.2.15).
	host string
	// allowFrom is remote.allow_from for that host.
	allowFrom string
	// transport is user.mrfs.remote's transport name.
	transport string
	// pinned is the /proc/PID/status field in which the daemon's pinned
	// pages show: the soft backend pins with mlock (VmLck); the kernel's
	// ib_umem pins count in VmPin.
	pinned string
}

var backend = backendFromEnv()

func backendFromEnv() testBackend {
	env := func(k, def string) string {
		if v := os.Getenv(k); v != "" {
			return v
		}
		return def
	}
	switch b := env("MRFS_TEST_BACKEND", "soft"); b {
	case "soft":
		return testBackend{name: b, device: "soft0", host: "127.0.0.1", allowFrom: `["127.0.0.0/8"]`, transport: "tcp", pinned: "VmLck"}
	case "rdma":
		host := env("MRFS_TEST_REMOTE_HOST", "10.0.2.15")
		return testBackend{name: b, device: env("MRFS_TEST_DEVICE", "rxe0"), host: host,
			allowFrom: fmt.Sprintf("[%q]", host+"/32"), transport: "rdma_cm", pinned: "VmPin"}
	default:
		fmt.Fprintf(os.Stderr, "tests: MRFS_TEST_BACKEND=%q: use soft or rdma\n", b)
		os.Exit(2)
	}
	panic("unreachable")
}

func (b testBackend) soft() bool { return b.name == "soft" }

// verbs is the [verbs] table's backend and device lines.
func (b testBackend) verbs() string {
	return fmt.Sprintf("backend = %q\ndevice = %q\n", b.name, b.device)
}

// listen is the [remote] lines that turn remote access on at a free port
// of host, admitting peers from there. The tests fail remote operations
// on purpose, far more often than remote.max_failures lets a source:
// the rule is off here, and TestRemoteTokens checks it.
func (b testBackend) listen() string {
	return fmt.Sprintf("listen = \"%s:0\"\nallow_from = %s\nmax_failures = 0\n", b.host, b.allowFrom)
}

// differs notes in the test's log how the backend under test differs
// from the soft model in what the test checks next; the test then checks
// the backend's own behaviour instead.
func (b testBackend) differs(t testing.TB, how string) {
	t.Helper()
	t.Logf("on %s (%s): %s", b.device, b.name, how)
}

// deviceMaxMR is the device's max_mr as `mrfs devices` reports it.
func deviceMaxMR(t *testing.T) uint64 {
	t.Helper()
	out, errOut, err := run(t, mrfsBin, "devices", "--backend", backend.name)
	if err != nil {
		t.Fatalf("mrfs devices: %v: %s", err, errOut)
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 2 && f[0] == backend.device {
			n, err := strconv.ParseUint(f[2], 0, 64)
			if err != nil {
				t.Fatalf("mrfs devices: MAX_MR of %s is %q", backend.device, f[2])
			}
			return n
		}
	}
	t.Fatalf("mrfs devices does not list %s:\n%s", backend.device, out)
	return 0
}
