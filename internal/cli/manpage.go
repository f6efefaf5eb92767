package cli

import (
	"flag"
	"fmt"
	"io"
	"maps"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"mrfs/internal/config"
)

// cmdMan prints the manual page, mrfs(8), in roff: the commands and
// their flags come from the same definitions as usage and completion,
// the mount options from mountopts.go's tables and the config's keys.
func cmdMan(args []string, stdout, _ io.Writer) error {
	f := flag.NewFlagSet("man", flag.ContinueOnError)
	if _, err := parse(f, args, 0); err != nil {
		return err
	}
	manPage(stdout)
	return nil
}

// roff escapes text for roff: backslashes, hyphens (so that a flag
// prints as a minus, which copies and searches as one), and a line's
// leading dot or quote.
func roff(s string) string {
	s = strings.NewReplacer(`\`, `\e`, `-`, `\-`).Replace(s)
	lines := strings.Split(s, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "'") {
			lines[i] = `\&` + l
		}
	}
	return strings.Join(lines, "\n")
}

// buildDate is the date of the commit the binary was built from (the
// manual's date), or today's for a build without that.
func buildDate() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.time" && len(s.Value) >= 10 {
				return s.Value[:10]
			}
		}
	}
	return time.Now().Format(time.DateOnly)
}

// text is prose: filled into lines of at most 78 columns (mandoc's
// style), then escaped.
func text(s string) string {
	var lines []string
	line := ""
	for _, w := range strings.Fields(s) {
		// Measured as written out, escapes and all (mandoc wants lines
		// of at most 80 bytes).
		if line != "" && len(roff(line))+1+len(roff(w)) > 78 {
			lines = append(lines, line)
			line = ""
		}
		if line != "" {
			line += " "
		}
		line += w
	}
	return roff(strings.Join(append(lines, line), "\n"))
}

func bold(s string) string   { return `\fB` + roff(s) + `\fR` }
func italic(s string) string { return `\fI` + roff(s) + `\fR` }

// manOption is a flag's heading: \fB\-d\fR, \fB\-\-daemon\fR \fIFILE\fR.
func manOption(o option) string {
	var names []string
	for _, n := range o.names {
		names = append(names, bold(dashed(n)))
	}
	s := strings.Join(names, ", ")
	if o.value != "" {
		s += " " + italic(o.value)
	}
	return s
}

func manPage(w io.Writer) {
	p := func(format string, args ...any) { fmt.Fprintf(w, format+"\n", args...) }
	p(`.TH MRFS 8 "%s" "mrfs %s" "System Administration"`, buildDate(), roff(version()))
	p(".SH NAME")
	p(`mrfs \- RDMA\-registered memory buffers as files (a FUSE filesystem)`)
	p(".SH SYNOPSIS")
	p(".ad l")
	for _, c := range commands() {
		words := splitOptions(synopsis(c))
		p(".HP")
		if len(words) > 2 {
			p("%s", bold("mrfs "+c.name))
			p("%s", text(strings.Join(words[2:], " ")))
		} else {
			p("%s", bold("mrfs "+c.name))
		}
	}
	p(".HP")
	p("%s [%s] %s %s %s", bold("mrfs"), italic("SOURCE"), italic("MOUNTPOINT"), bold("-o"), italic("OPTIONS"))
	p(".ad")
	p(".SH DESCRIPTION")
	p("%s", text(`mrfs is a FUSE filesystem whose files are RDMA-registered memory buffers. `+
		`Directories are protection domains; creating and sizing a file allocates page-aligned memory and registers it `+
		`with an RDMA device; the extended attributes user.mrfs.lkey, rkey, addr, length and access describe the region, `+
		`and mmap of the file maps the very pages the device reads and writes (FUSE passthrough). `+
		`A pure-Go soft backend models a device where there is none.`))
	p(".PP")
	p("%s", text(`The daemon runs as root (FUSE passthrough needs CAP_SYS_ADMIN). It tears down on SIGINT, SIGTERM or an unmount `+
		`(mrfs umount, umount(8)): every region deregistered, every protection domain deallocated, the device closed, then the unmount.`))
	p(".SH COMMANDS")
	for _, c := range commands() {
		p(".SS %s", roff(strings.Join(append([]string{c.name}, c.aliases...), ", ")))
		p("%s", text(c.summary))
		for _, o := range options(flagsOf(c)) {
			p(".TP")
			p("%s", manOption(o))
			p("%s", text(o.usage))
		}
	}
	manMountOptions(p)
	p(".SH MOUNT(8) AND FSTAB")
	p("%s", text(`mount -t fuse.mrfs runs mount.fuse3(8), which runs "mrfs SOURCE MOUNTPOINT -o OPTIONS". `+
		`SOURCE is a config file, or none (or mrfs) for the built-in defaults. The options are applied over the file. `+
		`mrfs goes to the background once the mount answers, so that mount(8) returns with its status; umount(8) or `+
		`mrfs umount stop it. mount(8) runs helpers with an empty PATH, so the binary must be in a directory of the `+
		`shell's default path, such as /usr/local/bin or /usr/bin.`))
	p(".PP")
	p(".EX")
	p("%s", roff("mount -t fuse.mrfs none /mnt/mr -o backend=soft,allow_other"))
	p("")
	p("%s", roff("# /etc/fstab"))
	p("%s", roff("/etc/mrfs/mr.toml  /mnt/mr  fuse.mrfs  backend=soft,log.output=syslog,nofail  0 0"))
	p(".EE")
	p(".SH SYSTEMD")
	p("%s", text(`Under systemd, run mrfs mount in the foreground as a Type=notify service: it sends READY=1 to $NOTIFY_SOCKET `+
		`once the mount answers and STOPPING=1 when it starts to tear down. contrib/mrfs@.service in the source is a template `+
		`whose instance is the escaped mount point (systemctl start mrfs@mnt-mr) and whose config is /etc/mrfs/INSTANCE.toml. `+
		`With a file descriptor store ($FDSTORE of at least 4: FileDescriptorStoreMax=, which the template sets) the daemon keeps its `+
		`FUSE connection, its buffers' store and a journal of its namespace there; after a crash, the daemon systemd starts again `+
		`(Restart=on-failure) takes the mount over with every buffer's bytes and name (keys are new), as under mrfs mount --keeper. `+
		`systemctl reload runs mrfs upgrade. mrfs mount clears a dead mrfs mount (ENOTCONN) it finds at its mount point.`))
	p(".SH LOGGING")
	p("%s", text(`log.output says where the log goes: stderr (the default), syslog, or an absolute file path (appended to). `+
		`A daemon in the background (--daemon, mount(8)) has no stderr: there stderr means syslog, and when syslog cannot be `+
		`reached the log is discarded with a warning. Its last line, "daemon exiting", gives the exit status.`))
	p(".SH ENVIRONMENT")
	p(".TP")
	p("%s", bold("NOTIFY_SOCKET"))
	p("%s", text("The service manager's socket (sd_notify(3)); mrfs mount in the foreground reports READY=1 and STOPPING=1 to it, and "+
		"hands its mount to the file descriptor store (FDSTORE=1) when there is one."))
	p(".TP")
	p("%s", bold("FDSTORE, LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID"))
	p("%s", text("The size of the service manager's file descriptor store, and the descriptors it passes a daemon it starts again "+
		"(sd_listen_fds(3)): mrfs-fuse, mrfs-fuse-init, mrfs-store and mrfs-journal.N take a mount over."))
	p(".TP")
	p("%s", bold(tokenEnv))
	p("%s", text("The PD token mrfs remote presents when --token-file is not given. A command line is readable by every user of the host, so there is no --token."))
	p(".SH EXIT STATUS")
	p("%s", text("0 success, 1 a runtime failure, 2 bad usage, configuration or mount option."))
	p(".SH SEE ALSO")
	p(`\fBmount\fR(8), \fBmount.fuse3\fR(8), \fBfstab\fR(5), \fBumount\fR(8), \fBsystemd.service\fR(5), \fBsd_notify\fR(3)`)
}

func manMountOptions(p func(string, ...any)) {
	p(".SH MOUNT OPTIONS")
	p("%s", text(`mrfs mount -o and mount(8) take the same comma-separated options. `+
		`Each configuration key may be set by its dotted name (buffers.max_pinned=1GiB), its value read as config.toml reads it; `+
		`a boolean key alone means true; a list takes its elements separated by | (a comma ends the option). `+
		`Options are applied in order over the config file, and --backend and --device over them. An unknown option is an error (exit status 2).`))
	p(".PP")
	p("%s", text("Short names:"))
	for _, a := range mountAliases {
		p(".TP")
		if config.IsBool(a.key) {
			p("%s", bold(a.name))
		} else {
			p("%s=%s", bold(a.name), italic("VALUE"))
		}
		p("%s", text("sets "+a.key))
	}
	p(".TP")
	p("%s=%s", bold("fsname"), italic("NAME"))
	p("%s", text("the mount's source in mountinfo (default mrfs); as a mount helper, mrfs sets it to SOURCE so that mount -a sees the fstab line mounted"))
	p(".PP")
	p("%s", text("Configuration keys: "+strings.Join(config.Keys(), ", ")+"."))
	p(".PP")
	p("%s", text("Accepted without effect:"))
	for _, n := range mountNoEffect {
		p(".TP")
		p("%s", bold(strings.Join(n.names, ", ")))
		p("%s", text(n.why))
	}
	p(".TP")
	p("%s", bold("x-*, comment=*"))
	p("%s", text("for mount(8) and systemd"))

	p(".PP")
	p("%s", text("Refused:"))
	for _, name := range slices.Sorted(maps.Keys(mountRefused)) {
		p(".TP")
		p("%s", bold(name))
		p("%s", text(mountRefused[name]))
	}
}
