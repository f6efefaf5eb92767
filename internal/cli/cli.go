// Package cli is mrfs's command line: mount, umount, status, devices,
// remote and version, with their flags, logging and signal handling.
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

const usage = `usage:
  mrfs mount [--config FILE] [--backend auto|rdma|soft] [--device NAME] MOUNTPOINT
  mrfs umount [--lazy] MOUNTPOINT
  mrfs status MOUNTPOINT
  mrfs devices [--config FILE] [--backend auto|rdma|soft]
  mrfs remote read|write|cas|fadd --peer HOST:PORT --pd DIR --addr 0x.. --rkey 0x..
              [--length N] [--compare X --swap Y] [--add N] [--timeout 10s]
              [--transport tcp|rdma_cm]
  mrfs version
`

// Main runs the command line and returns the exit code.
func Main(args []string) int {
	return run(args, os.Stdout, os.Stderr)
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	var err error
	switch args[0] {
	case "mount":
		err = cmdMount(args[1:], stderr)
	case "umount", "unmount":
		err = cmdUmount(args[1:])
	case "status":
		err = cmdStatus(args[1:], stdout)
	case "devices":
		err = cmdDevices(args[1:], stdout)
	case "remote":
		err = cmdRemote(args[1:], stdout)
	case "version", "--version":
		fmt.Fprintln(stdout, "mrfs", version())
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
	default:
		err = usageError("unknown command %q", args[0])
	}
	if err == nil {
		return exitOK
	}
	fmt.Fprintln(stderr, "mrfs:", err)
	var ue *usageErr
	if errors.As(err, &ue) {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	if errors.Is(err, config.ErrInvalid) {
		return exitUsage
	}
	return exitFailure
}

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
		if err := fs.Parse(args); err != nil {
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
