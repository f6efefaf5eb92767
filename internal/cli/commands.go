package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"reflect"
	"slices"
	"sort"
	"strings"
)

// command is one subcommand. Its flags are not listed here: the command
// defines them where it parses them, and answers --help with that
// FlagSet (a *helpRequest), which is how usage, `--help`, the manual and
// the shell completions learn them. One definition, nothing to drift.
type command struct {
	name    string
	aliases []string
	ops     []string // operations that come first (remote's read, write, ...)
	args    string   // the positional arguments, as the synopsis shows them
	summary string
	run     func(args []string, stdout, stderr io.Writer) error
}

// commands lists the subcommands in the order usage and the manual show
// them. (A function: as a variable it would be an initialization cycle,
// since man and completion read it.)
func commands() []command {
	return []command{
		{name: "mount", args: "MOUNTPOINT", run: func(a []string, _, e io.Writer) error { return cmdMount(a, e) },
			summary: "Mount mrfs at MOUNTPOINT and serve it until SIGINT, SIGTERM or an unmount; in the foreground unless --daemon."},
		{name: "umount", aliases: []string{"unmount"}, args: "MOUNTPOINT", run: func(a []string, _, _ io.Writer) error { return cmdUmount(a) },
			summary: "Unmount an mrfs mount and wait until its daemon has torn down; also clears the mount of a daemon that was killed."},
		{name: "upgrade", args: "MOUNTPOINT", run: func(a []string, o, _ io.Writer) error { return cmdUpgrade(a, o) },
			summary: "Upgrade a mount's daemon in place: it executes the new program (--binary, or its own path) in its own process, which takes over the mount, its names, its buffers' bytes and the clients' open files and mappings; registrations are made anew, so keys change."},
		{name: "status", args: "MOUNTPOINT", run: func(a []string, o, _ io.Writer) error { return cmdStatus(a, o) },
			summary: "Print the buffers of a mount with their keys and access, the totals and the limits."},
		{name: "alloc", args: "SIZE FILE", run: cmdAlloc,
			summary: "Create FILE on an mrfs mount, or resize it, to SIZE bytes (64MiB, 8GiB, ...) and wait until it is registered, showing the progress; Ctrl-C stops the registration and leaves FILE as it was."},
		{name: "pool", args: "DIR", run: cmdPool,
			summary: "Make DIR a pool of fixed-size slots registered in a few big regions (files in it are ready at once, zeroed when unlinked), or change its slots. " + poolTrust},
		{name: "register", args: "SOURCE FILE", run: cmdRegister,
			summary: "Register SOURCE, a file of shared memory (/dev/shm, hugetlbfs, a memfd as /proc/PID/fd/N), in place as FILE on an mrfs mount: no copy, the same pages; unlinking FILE deregisters and leaves SOURCE alone. The daemon opens SOURCE as you would, and the access may not write what you may not. `ln -s SOURCE FILE` does the same with the directory's default access."},
		{name: "devices", run: func(a []string, o, _ io.Writer) error { return cmdDevices(a, o) },
			summary: "List the devices of the chosen verbs backend with their limits (max_mr and others)."},
		{name: "remote", ops: []string{"read", "write", "cas", "fadd"}, run: func(a []string, o, _ io.Writer) error { return cmdRemote(a, o) },
			summary: "Run one one-sided operation against a peer's mrfs: read prints the bytes, write sends stdin, cas and fadd print the old value."},
		{name: "peers", run: func(a []string, o, _ io.Writer) error { return cmdPeers(a, o) },
			summary: "List the buffers of all hosts published to etcd ([publish]): their names (HOST/MOUNT/PATH), where to connect, their PD and generation."},
		{name: "completion", args: "bash|zsh|fish", run: cmdCompletion,
			summary: "Print the shell completion script for bash, zsh or fish."},
		{name: "man", run: cmdMan,
			summary: "Print this manual page (roff)."},
		{name: "version", aliases: []string{"--version"}, run: cmdVersion,
			summary: "Print the version."},
		{name: "help", aliases: []string{"-h", "--help"}, run: cmdHelp,
			summary: "Print the usage."},
	}
}

func lookupCommand(name string) *command {
	for _, c := range commands() {
		if c.name == name || slices.Contains(c.aliases, name) {
			return &c
		}
	}
	return nil
}

// helpRequest is what parse returns for --help: the command's flags.
type helpRequest struct{ flags *flag.FlagSet }

func (h *helpRequest) Error() string { return h.flags.Name() + ": help requested" }

// flagsOf returns the flags c defines, by asking it for --help; nil for a
// command without flags.
func flagsOf(c command) *flag.FlagSet {
	args := []string{"--help"}
	if len(c.ops) > 0 {
		args = []string{c.ops[0], "--help"}
	}
	var h *helpRequest
	if errors.As(c.run(args, io.Discard, io.Discard), &h) {
		return h.flags
	}
	return nil
}

// option is one command-line flag as the documentation shows it: a flag
// and its aliases (flags sharing one variable, such as -d and --daemon).
type option struct {
	names   []string // without dashes, the long one last
	value   string   // the value's name (FILE, auto|rdma|soft), "" for a switch
	usage   string
	choices []string // the values when the name lists them (auto|rdma|soft)
}

// dashed gives a flag name as typed: -d for one letter, --name else.
func dashed(name string) string {
	if len(name) == 1 {
		return "-" + name
	}
	return "--" + name
}

// dashed gives the option's names as typed.
func (o option) dashed() []string {
	var out []string
	for _, n := range o.names {
		out = append(out, dashed(n))
	}
	return out
}

// heading is the names joined by sep, and the value's name: -d|--daemon,
// --config FILE.
func (o option) heading(sep string) string {
	s := strings.Join(o.dashed(), sep)
	if o.value != "" {
		s += " " + o.value
	}
	return s
}

// options lists a FlagSet's flags, merging aliases, sorted by long name.
// The value's name is the back-quoted word of the usage (as
// flag.PrintDefaults reads it), else the flag's name in capitals.
func options(fs *flag.FlagSet) []option {
	if fs == nil {
		return nil
	}
	var opts []option
	byValue := map[flag.Value]int{}
	fs.VisitAll(func(f *flag.Flag) {
		// Values are pointers in practice; a map key must be comparable.
		comparable := reflect.TypeOf(f.Value).Comparable()
		i, seen := 0, false
		if comparable {
			i, seen = byValue[f.Value]
		}
		if seen {
			// An alias: keep the longer name's usage, the short name first.
			o := &opts[i]
			o.names = append(o.names, f.Name)
			sort.Slice(o.names, func(a, b int) bool { return len(o.names[a]) < len(o.names[b]) })
			if len(f.Name) > 1 {
				_, o.usage = flag.UnquoteUsage(f)
			}
			return
		}
		if comparable {
			byValue[f.Value] = len(opts)
		}
		name, usage := flag.UnquoteUsage(f)
		if isBool(f) {
			name = ""
		} else if !strings.Contains(f.Usage, "`") {
			name = strings.ToUpper(f.Name)
		}
		o := option{names: []string{f.Name}, value: name, usage: usage}
		if strings.Contains(name, "|") {
			o.choices = strings.Split(name, "|")
		}
		opts = append(opts, o)
	})
	sort.SliceStable(opts, func(a, b int) bool {
		return opts[a].names[len(opts[a].names)-1] < opts[b].names[len(opts[b].names)-1]
	})
	return opts
}

func isBool(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// synopsis is one command's line of usage: mrfs mount [--config FILE] ... MOUNTPOINT.
func synopsis(c command) string {
	parts := []string{"mrfs", c.name}
	if len(c.ops) > 0 {
		parts = append(parts, strings.Join(c.ops, "|"))
	}
	for _, o := range options(flagsOf(c)) {
		parts = append(parts, "["+o.heading("|")+"]")
	}
	if c.args != "" {
		parts = append(parts, c.args)
	}
	return strings.Join(parts, " ")
}

// usage is the text of `mrfs help` and of usage errors.
func usage() string {
	var b strings.Builder
	b.WriteString("usage:\n")
	for _, c := range commands() {
		b.WriteString(wrap(synopsis(c), "  ", "      ", 80))
	}
	b.WriteString("  mrfs [SOURCE] MOUNTPOINT -o OPTIONS   (as mount.fuse3 runs it for mount -t fuse.mrfs)\n")
	b.WriteString("`mrfs COMMAND --help` lists a command's flags; `mrfs man` prints the manual.\n")
	return b.String()
}

// wrap breaks s at spaces into lines of at most width columns, but never
// inside a bracketed option.
func wrap(s, first, rest string, width int) string {
	var b strings.Builder
	line := first
	fresh := true
	for _, w := range splitOptions(s) {
		if !fresh && len(line)+1+len(w) > width {
			b.WriteString(line + "\n")
			line, fresh = rest, true
		}
		if !fresh {
			line += " "
		}
		line += w
		fresh = false
	}
	b.WriteString(line + "\n")
	return b.String()
}

// splitOptions splits a synopsis into words, a bracketed option being one.
func splitOptions(s string) []string {
	var words []string
	depth, start := 0, 0
	for i := 0; i <= len(s); i++ {
		switch {
		case i == len(s) || (s[i] == ' ' && depth == 0):
			if i > start {
				words = append(words, s[start:i])
			}
			start = i + 1
		case s[i] == '[':
			depth++
		case s[i] == ']':
			depth--
		}
	}
	return words
}

// printHelp answers `mrfs COMMAND --help`.
func printHelp(w io.Writer, fs *flag.FlagSet) {
	name := strings.Fields(fs.Name())[0]
	c := lookupCommand(name)
	if c == nil {
		fmt.Fprint(w, usage())
		return
	}
	fmt.Fprint(w, wrap(synopsis(*c), "usage: ", "       ", 80))
	fmt.Fprint(w, "\n"+wrap(c.summary, "", "", 80))
	opts := options(fs)
	if len(opts) > 0 {
		fmt.Fprintln(w, "\nflags:")
	}
	for _, o := range opts {
		fmt.Fprint(w, "  "+o.heading(", ")+"\n"+wrap(o.usage, "      ", "      ", 80))
	}
}

// Every command parses its flags, even none: --help then answers with
// them rather than running it.

func cmdVersion(args []string, stdout, _ io.Writer) error {
	if _, err := parse(flag.NewFlagSet("version", flag.ContinueOnError), args, 0); err != nil {
		return err
	}
	fmt.Fprintln(stdout, "mrfs", version())
	return nil
}

func cmdHelp(args []string, stdout, _ io.Writer) error {
	if _, err := parse(flag.NewFlagSet("help", flag.ContinueOnError), args, 0); err != nil {
		return err
	}
	fmt.Fprint(stdout, usage())
	return nil
}
