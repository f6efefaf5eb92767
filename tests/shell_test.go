package tests

import (
	"bytes"
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// run runs a command with a timeout and returns its stdout, stderr and error.
func run(t *testing.T, name string, args ...string) (string, string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cmdTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.WaitDelay = 5 * time.Second // a leftover grandchild must not keep Run waiting on the pipes
	var out, errb bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func mustRun(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, errOut, err := run(t, name, args...)
	if err != nil {
		t.Fatalf("%s %s: %v\nstdout: %s\nstderr: %s", name, strings.Join(args, " "), err, out, errOut)
	}
	return out
}

// sh runs a bash script with `set -e`.
func sh(t *testing.T, script string) (string, string, error) {
	t.Helper()
	return run(t, "bash", "-c", "set -e\n"+script)
}

func mustSh(t *testing.T, script string) string {
	t.Helper()
	out, errOut, err := sh(t, script)
	if err != nil {
		t.Fatalf("bash script failed: %v\nscript:\n%s\nstdout: %s\nstderr: %s", err, script, out, errOut)
	}
	return out
}

func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err == nil {
		return 0
	}
	return -1
}
