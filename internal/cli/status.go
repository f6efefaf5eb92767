package cli

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"golang.org/x/sys/unix"

	"mrfs/internal/config"
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
	Limits          struct {
		MaxBuffers uint64 `json:"max_buffers"`
		MaxPinned  uint64 `json:"max_pinned"`
		MaxMR      uint64 `json:"max_mr"`
		Memlock    uint64 `json:"memlock"`
	} `json:"limits"`
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
	if err != nil {
		return fmt.Errorf("%s is not an mrfs mount (no user.mrfs.stats): %w", dir, err)
	}
	var st rootStats
	if err := json.Unmarshal(raw, &st); err != nil {
		return fmt.Errorf("%s: bad user.mrfs.stats: %w", dir, err)
	}

	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PATH\tPD\tLENGTH\tSTATE\tLKEY\tRKEY\tADDR\tACCESS")
	walkErr := filepath.WalkDir(dir, func(path string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(dir, path)
		x := func(name string) string {
			v, err := getxattr(path, "user.mrfs."+name)
			if err != nil {
				return "-"
			}
			return string(v)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", rel, x("pd"), x("length"),
			x("state"), x("lkey"), x("rkey"), x("addr"), x("access"))
		return nil
	})
	tw.Flush()
	if walkErr != nil {
		return fmt.Errorf("walk %s: %w", dir, walkErr)
	}

	zc := "on"
	if st.ZeroCopy != nil && !*st.ZeroCopy {
		zc = "off"
	}
	fmt.Fprintf(stdout, "\nbackend %s, device %s, zero copy %s\n", st.Backend, st.Device, zc)
	fmt.Fprintf(stdout, "totals: %d buffers in %d PDs, %s registered, %s pinned\n",
		st.Buffers, st.PDs, config.FormatSize(st.RegisteredBytes), config.FormatSize(st.PinnedBytes))
	l := st.Limits
	fmt.Fprintf(stdout, "limits: max_buffers %s, max_pinned %s, max_mr %s, RLIMIT_MEMLOCK %s\n",
		limit(l.MaxBuffers, false), limit(l.MaxPinned, true), limit(l.MaxMR, false), limit(l.Memlock, true))
	return nil
}

func limit(v uint64, bytes bool) string {
	switch {
	case v == 0:
		return "unlimited"
	case bytes:
		return config.FormatSize(v)
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
