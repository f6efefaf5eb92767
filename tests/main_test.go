package tests

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"
)

var (
	// mrfsBin is the binary built once by TestMain; its directory is first
	// on PATH so shell scripts can call `mrfs`.
	mrfsBin string
	// binDir holds the built binaries (mrfs, the C client); removed at exit.
	binDir string
	// skipReason, when set, skips every test: the environment cannot mount.
	skipReason string

	pageSize = os.Getpagesize()

	hexRe = regexp.MustCompile(`^0x[0-9a-f]+$`)
	decRe = regexp.MustCompile(`^[0-9]+$`)
)

var (
	readyTimeout = 10 * time.Second * slowFactor()
	stopTimeout  = 10 * time.Second * slowFactor()
)

// slowFactor stretches the start and stop timeouts under emulation, in
// the tests/vm guest.
func slowFactor() time.Duration {
	if os.Getenv("MRFS_VM_GUEST") == "1" {
		return 3
	}
	return 1
}

const (
	cmdTimeout = 60 * time.Second
	// hangTimeout bounds one test's use of its mount. A daemon that stops
	// answering would otherwise block the test in a syscall until go test's
	// own timeout; the watchdog dumps the daemon's goroutines (SIGQUIT) and
	// kills it, which aborts the FUSE connection and unblocks the test.
	hangTimeout = 90 * time.Second
)

func TestMain(m *testing.M) {
	if os.Getenv(churnEnv) != "" {
		os.Exit(churnWorker()) // a user of TestSharedMountChurn
	}
	if os.Getenv(fakeSystemdEnv) != "" {
		os.Exit(fakeSystemd()) // TestCrashUnderFdStore's service manager
	}
	switch {
	case os.Geteuid() != 0:
		skipReason = "mrfs end-to-end tests need root (FUSE mount, pagemap PFNs)"
	default:
		if _, err := os.Stat("/dev/fuse"); err != nil {
			skipReason = "mrfs end-to-end tests need /dev/fuse: " + err.Error()
		}
	}
	if skipReason == "" {
		var err error
		binDir, err = os.MkdirTemp("", "mrfs-e2e-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "tests: temp dir:", err)
			os.Exit(1)
		}
		root, err := filepath.Abs("..")
		if err != nil {
			fmt.Fprintln(os.Stderr, "tests: module root:", err)
			os.Exit(1)
		}
		mrfsBin = filepath.Join(binDir, "mrfs")
		if prebuilt := os.Getenv("MRFS_BIN"); prebuilt != "" {
			// A binary built elsewhere (the qemu guest has no compiler
			// cache; the rdma backend needs -tags rdma): under the same
			// name, so scripts find it on PATH.
			err = os.Symlink(prebuilt, mrfsBin)
		} else {
			build := exec.Command("go", "build", "-o", mrfsBin, "mrfs/cmd/mrfs")
			build.Dir = root
			var out []byte
			if out, err = build.CombinedOutput(); err != nil {
				err = fmt.Errorf("go build mrfs/cmd/mrfs: %w\n%s", err, out)
			}
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "tests: %v\n", err)
			os.RemoveAll(binDir)
			os.Exit(1)
		}
		os.Setenv("PATH", binDir+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// requireMountEnv skips only for the package-wide reasons (not root, no
// /dev/fuse). Nothing else may skip.
func requireMountEnv(t testing.TB) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}
