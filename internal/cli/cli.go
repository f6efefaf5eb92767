// Package cli is mrfs's command line: mount, umount, status, devices,
// remote and version, with their flags, logging and signal handling; the
// mount helper's calling convention (mount -t fuse.mrfs), the daemon's
// background mode and systemd notification; and the manual and shell
// completions, generated from the commands' own flag definitions.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"

	"mrfs/internal/config"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1 // a runtime failure
	exitUsage   = 2 // bad usage or configuration
)

// Main runs the command line and returns the exit code.
func Main(args []string) int {
	return run(args, os.Stdout, os.Stderr)
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage())
		return exitUsage
	}
	var err error
	switch c := lookupCommand(args[0]); {
	case c != nil:
		err = c.run(args[1:], stdout, stderr)
	case isHelperCall(args):
		err = cmdHelper(args, stderr)
	default:
		err = usageError("unknown command %q", args[0])
	}
	var help *helpRequest
	var status exitStatus
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &help):
		printHelp(stdout, help.flags)
		return exitOK
	case errors.As(err, &status):
		return int(status) // reported already (by a daemon's child)
	}
	fmt.Fprintln(stderr, "mrfs:", err)
	var ue *usageErr
	if errors.As(err, &ue) {
		fmt.Fprint(stderr, usage())
	}
	return exitCode(err)
}

// exitCode maps an error to the exit status: 2 for bad usage or
// configuration (a mount option included), 1 for the rest.
func exitCode(err error) int {
	var ue *usageErr
	var oe *mountOptionError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue), errors.As(err, &oe), errors.Is(err, config.ErrInvalid):
		return exitUsage
	}
	var status exitStatus
	if errors.As(err, &status) {
		return int(status)
	}
	return exitFailure
}

// exitStatus is an error whose message was printed already: only the
// status is left to return.
type exitStatus int

func (s exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(s)) }

type usageErr struct{ msg string }

func (e *usageErr) Error() string { return e.msg }

func usageError(format string, args ...any) error {
	return &usageErr{fmt.Sprintf(format, args...)}
}

// parse parses flags that may come before or after the positional
// arguments ("mrfs mount /mnt --backend soft"), and wants exactly npos of
// those.
func parse(fs *flag.FlagSet, args []string, npos int) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
			return nil, &helpRequest{fs}
		} else if err != nil {
			return nil, usageError("%s: %v", fs.Name(), err)
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	if len(pos) != npos {
		return nil, usageError("%s: want %d argument(s), got %d", fs.Name(), npos, len(pos))
	}
	return pos, nil
}

func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "(unknown)"
	}
	v := bi.Main.Version
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && len(s.Value) >= 12 {
			v += " " + s.Value[:12]
		}
	}
	return v
}
