package cli

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode"

	"golang.org/x/sys/unix"

	"mrfs/desc"
	"mrfs/internal/bytesize"
)

// rootStats is the part of user.mrfs.stats status shows.
type rootStats struct {
	Backend         string `json:"backend"`
	Device          string `json:"device"`
	ZeroCopy        *bool  `json:"zero_copy"`
	Buffers         int    `json:"buffers"`
	PDs             int    `json:"pds"`
	RegisteredBytes uint64 `json:"registered_bytes"`
	PinnedBytes     uint64 `json:"pinned_bytes"`
	StoreBytes      uint64 `json:"store_bytes"`
	ChargedBytes    uint64 `json:"charged_bytes"`
	OpenUnlinked    int    `json:"open_unlinked"`
	Mappings        int    `json:"mappings"`
	MapRoom         int    `json:"map_room"`
	Regions         int    `json:"regions"`
	Limits          struct {
		MaxBuffers       uint64 `json:"max_buffers"`
		MaxPinned        uint64 `json:"max_pinned"`
		MaxPinnedPerUser uint64 `json:"max_pinned_per_user"`
		MaxMR            uint64 `json:"max_mr"`
		Memlock          uint64 `json:"memlock"`
		MaxMapCount      int    `json:"max_map_count"`
	} `json:"limits"`
	Users map[string]struct {
		Buffers      int    `json:"buffers"`
		ChargedBytes uint64 `json:"charged_bytes"`
	} `json:"users"`
	Pools       map[string]statusPool `json:"pools"`
	Devices     []string              `json:"devices"`
	DevicesGone []string              `json:"devices_gone"`
	PID         int                   `json:"pid"`
	Started     string                `json:"started"`
	Restarts    int                   `json:"restarts"`
}

// statusPool is the part of a pool's entry in user.mrfs.stats status shows.
type statusPool struct {
	Slots  int      `json:"slots"`
	Used   int      `json:"used"`
	RKeys  []string `json:"rkeys"`
	Access string   `json:"access"`
}

// poolLine is status's line for the pool directory rel (at path), whose
// user.mrfs.pool is v: its slots used and free, chunks and keys.
func poolLine(rel, path, v string, pools map[string]statusPool) string {
	line := fmt.Sprintf("pool %s: %s", rel, v)
	pd, err := getxattr(path, "user.mrfs.pd")
	if p, ok := pools[string(pd)]; err == nil && ok {
		line += fmt.Sprintf(", %d free, rkeys %s, access %s", p.Slots-p.Used, strings.Join(p.RKeys, " "), p.Access)
	}
	return line
}

// cmdStatus prints the buffers of a mount, read from its xattrs alone:
// the filesystem is the interface.
func cmdStatus(args []string, stdout io.Writer) error {
	f := flag.NewFlagSet("status", flag.ContinueOnError)
	pos, err := parse(f, args, 1)
	if err != nil {
		return err
	}
	dir := pos[0]
	raw, err := getxattr(dir, "user.mrfs.stats")
	switch {
	case errors.Is(err, unix.ENOTCONN):
		return fmt.Errorf("%s: the mrfs daemon is gone (%w); clear the mount with `mrfs umount %s`", dir, err, dir)
	case err != nil:
		return fmt.Errorf("%s is not the root of an mrfs mount (no user.mrfs.stats): %w", dir, err)
	}
	var st rootStats
	if err := json.Unmarshal(raw, &st); err != nil {
		return fmt.Errorf("%s: bad user.mrfs.stats: %w", dir, err)
	}
	unreadable, pools, err := listBuffers(dir, stdout, st, bufferRow)
	if err != nil {
		return err
	}
	for _, p := range pools {
		fmt.Fprintln(stdout, p)
	}
	printTotals(stdout, st, unreadable)
	return nil
}

// statusBlock is how many rows `mrfs status` prints at a time: a mount
// of a million buffers streams rather than waiting for the last row
// (each block has its own column widths).
const statusBlock = 1024

// listBuffers prints a row (row(path)) per buffer under dir, depth first
// in directory order (the mount lists names sorted), reading directories
// and printing rows a block at a time; it returns the directories this
// user may not read and a line per pool.
func listBuffers(dir string, stdout io.Writer, st rootStats, row func(path string) []string) (unreadable, pools []string, err error) {
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PATH\tPD\tLENGTH\tSTATE\tLKEY\tRKEY\tADDR\tACCESS")
	rows := 0
	var walk func(path string) error
	walk = func(path string) error {
		rel, _ := filepath.Rel(dir, path)
		if v, err := getxattr(path, "user.mrfs.pool"); err == nil {
			pools = append(pools, poolLine(rel, path, string(v), st.Pools))
		}
		d, err := os.Open(path)
		if errors.Is(err, os.ErrPermission) {
			// Its buffers are still in the totals.
			unreadable = append(unreadable, rel)
			return nil
		} else if err != nil {
			return err
		}
		defer d.Close()
		for {
			entries, err := d.ReadDir(statusBlock)
			for _, e := range entries {
				p := filepath.Join(path, e.Name())
				if e.IsDir() {
					if err := walk(p); err != nil {
						return err
					}
					continue
				}
				name, _ := filepath.Rel(dir, p)
				if strings.ContainsFunc(name, unicode.IsControl) {
					name = strconv.Quote(name) // keep one line per buffer
				}
				fmt.Fprintf(tw, "%s\t%s\n", name, strings.Join(row(p), "\t"))
				if rows++; rows%statusBlock == 0 {
					tw.Flush()
				}
			}
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
		}
	}
	err = walk(dir)
	tw.Flush()
	if err != nil {
		return nil, nil, fmt.Errorf("walk %s: %w", dir, err)
	}
	return unreadable, pools, nil
}

// printTotals prints the mount's totals, its owners and its limits.
func printTotals(stdout io.Writer, st rootStats, unreadable []string) {
	zc := "on"
	if st.ZeroCopy != nil && !*st.ZeroCopy {
		zc = "off"
	}
	dev := "device " + st.Device
	if len(st.Devices) > 1 || len(st.DevicesGone) > 0 {
		dev = "devices " + strings.Join(st.Devices, ", ")
	}
	if len(st.DevicesGone) > 0 {
		dev += " (gone: " + strings.Join(st.DevicesGone, ", ") + ")"
	}
	fmt.Fprintf(stdout, "\nbackend %s, %s, zero copy %s\n", st.Backend, dev, zc)
	if st.Started != "" {
		fmt.Fprintf(stdout, "daemon: pid %d, started %s, %s survived\n", st.PID, st.Started, plural(st.Restarts, "restart"))
	}
	if len(unreadable) > 0 {
		fmt.Fprintf(stdout, "not readable by this user: %s\n", strings.Join(unreadable, ", "))
	}
	fmt.Fprintf(stdout, "totals: %s in %s, %s registered in %s, %s pinned\n",
		plural(st.Buffers, "buffer"), plural(st.PDs, "PD"), bytesize.Format(st.RegisteredBytes), plural(st.Regions, "region"), bytesize.Format(st.PinnedBytes))
	open := ""
	if st.OpenUnlinked > 0 {
		open = fmt.Sprintf(", %s unlinked but open", plural(st.OpenUnlinked, "file"))
	}
	fmt.Fprintf(stdout, "memory: the store holds %s, %s charged to owners%s\n", bytesize.Format(st.StoreBytes), bytesize.Format(st.ChargedBytes), open)
	if len(st.Users) > 0 {
		uids := make([]string, 0, len(st.Users))
		for uid := range st.Users {
			uids = append(uids, uid)
		}
		sort.Slice(uids, func(i, j int) bool {
			return len(uids[i]) < len(uids[j]) || len(uids[i]) == len(uids[j]) && uids[i] < uids[j]
		})
		var us []string
		for _, uid := range uids {
			u := st.Users[uid]
			us = append(us, fmt.Sprintf("uid %s %s (%s)", uid, bytesize.Format(u.ChargedBytes), plural(u.Buffers, "buffer")))
		}
		fmt.Fprintf(stdout, "by owner: %s\n", strings.Join(us, ", "))
	}
	l := st.Limits
	fmt.Fprintf(stdout, "limits: max_buffers %s, max_pinned %s, max_pinned_per_user %s, max_mr %s, RLIMIT_MEMLOCK %s\n",
		limit(l.MaxBuffers, false), limit(l.MaxPinned, true), limit(l.MaxPinnedPerUser, true), limit(l.MaxMR, false), limit(l.Memlock, true))
	if l.MaxMapCount > 0 {
		fmt.Fprintf(stdout, "mappings: %d of vm.max_map_count %d, room for %d more buffers or pool slots (each is one mapping; %d kept for the daemon)\n",
			st.Mappings, l.MaxMapCount, st.MapRoom, max(l.MaxMapCount-st.Mappings-st.MapRoom, 0))
	}
}

// bufferRow is a buffer's PD, length, state, keys, address and access. A
// registered buffer's desc holds them all (one getxattr: a request to the
// daemon); one without a registration has no desc, and its few
// attributes are read one by one.
func bufferRow(path string) []string {
	if raw, err := getxattr(path, "user.mrfs.desc"); err == nil {
		if d, err := desc.Parse(raw); err == nil {
			return []string{strconv.FormatUint(uint64(d.PD), 10), d.Length.String(), d.State, d.LKey.String(), d.RKey.String(), d.Addr.String(), strings.Join(d.Access, ",")}
		}
	}
	x := func(name string) string {
		v, err := getxattr(path, "user.mrfs."+name)
		if err != nil {
			return "-"
		}
		return string(v)
	}
	return []string{x("pd"), x("length"), x("state"), "-", "-", "-", x("access")}
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func limit(v uint64, bytes bool) string {
	switch {
	case v == 0:
		return "unlimited"
	case bytes:
		return bytesize.Format(v)
	}
	return fmt.Sprint(v)
}

// getxattr reads a whole attribute value.
func getxattr(path, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Getxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, 2*len(buf))
			continue
		}
		if err != nil {
			return nil, err
		}
		return []byte(strings.TrimRight(string(buf[:n]), "\x00")), nil
	}
}
