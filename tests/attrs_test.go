package tests

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The names of DESIGN.md, "Extended attributes".
const (
	xLkey     = "user.mrfs.lkey"
	xRkey     = "user.mrfs.rkey"
	xAddr     = "user.mrfs.addr"
	xLength   = "user.mrfs.length"
	xAccess   = "user.mrfs.access"
	xDevice   = "user.mrfs.device"
	xPD       = "user.mrfs.pd"
	xState    = "user.mrfs.state"
	xZeroCopy = "user.mrfs.zero_copy"
	xDesc     = "user.mrfs.desc"
	xKeys     = "user.mrfs.keys"
	xDefAcc   = "user.mrfs.default_access"
	xStats    = "user.mrfs.stats"
)

// fileXattrs are the xattrs every buffer file has (DESIGN.md, "Extended
// attributes").
var fileXattrs = []string{xLkey, xRkey, xAddr, xLength, xAccess, xDevice, xPD, xState, xZeroCopy, xDesc, xKeys}

func getxattr(path, name string) (string, error) {
	for {
		n, err := unix.Getxattr(path, name, nil)
		if err != nil {
			return "", err
		}
		buf := make([]byte, n)
		m, err := unix.Getxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew in between
		}
		if err != nil {
			return "", err
		}
		return string(buf[:m]), nil
	}
}

func mustXattr(t testing.TB, path, name string) string {
	t.Helper()
	v, err := getxattr(path, name)
	if err != nil {
		t.Fatalf("getxattr(%s, %s): %v", path, name, err)
	}
	return v
}

func setxattr(path, name, value string) error {
	return unix.Setxattr(path, name, []byte(value), 0)
}

func mustSetxattr(t *testing.T, path, name, value string) {
	t.Helper()
	if err := setxattr(path, name, value); err != nil {
		t.Fatalf("setxattr(%s, %s, %q): %v", path, name, value, err)
	}
}

func listxattr(path string) ([]string, error) {
	for {
		n, err := unix.Listxattr(path, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		m, err := unix.Listxattr(path, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, s := range strings.Split(string(buf[:m]), "\x00") {
			if s != "" {
				names = append(names, s)
			}
		}
		return names, nil
	}
}

func errnoString(err error) string {
	var e unix.Errno
	if errors.As(err, &e) {
		return unix.ErrnoName(e)
	}
	return err.Error()
}

// wantErrno requires err to be exactly errno want.
func wantErrno(t *testing.T, err error, want unix.Errno, what string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: succeeded, want %s", what, unix.ErrnoName(want))
		return
	}
	if !errors.Is(err, want) {
		t.Errorf("%s: got %v (%s), want %s", what, err, errnoString(err), unix.ErrnoName(want))
	}
}

type statsLimits struct {
	MaxBuffers       uint64 `json:"max_buffers"`
	MaxPinned        uint64 `json:"max_pinned"`
	MaxPinnedPerUser uint64 `json:"max_pinned_per_user"`
	MaxMR            uint64 `json:"max_mr"`
	MaxMRSize        uint64 `json:"max_mr_size"`
	Memlock          uint64 `json:"memlock"`
	OpenFiles        uint64 `json:"open_files"`
	MaxMapCount      int64  `json:"max_map_count"`
}

type statsUser struct {
	Buffers      int64 `json:"buffers"`
	PinnedBytes  int64 `json:"pinned_bytes"`
	ChargedBytes int64 `json:"charged_bytes"`
}

type mrfsStats struct {
	Backend         string               `json:"backend"`
	Device          string               `json:"device"`
	Buffers         int64                `json:"buffers"`
	PDs             int64                `json:"pds"`
	RegisteredBytes int64                `json:"registered_bytes"`
	PinnedBytes     int64                `json:"pinned_bytes"`
	Store           string               `json:"store"`
	StoreBytes      int64                `json:"store_bytes"`
	ChargedBytes    int64                `json:"charged_bytes"`
	OpenUnlinked    int64                `json:"open_unlinked"`
	Mappings        int64                `json:"mappings"`
	MapRoom         int64                `json:"map_room"`
	Regions         int64                `json:"regions"`
	OpenFiles       int64                `json:"open_files"`
	Limits          statsLimits          `json:"limits"`
	Users           map[string]statsUser `json:"users"`
	PID             int                  `json:"pid"`
	Devices         []string             `json:"devices"`
	DevicesGone     []string             `json:"devices_gone"`
	Started         string               `json:"started"`
	Restarts        int                  `json:"restarts"`
	UpgradeError    string               `json:"upgrade_error"`
}

func readStats(t testing.TB, mnt string) mrfsStats {
	t.Helper()
	raw := mustXattr(t, mnt, xStats)
	var s mrfsStats
	if err := json.Unmarshal([]byte(raw), &s); err != nil {
		t.Fatalf("user.mrfs.stats is not the documented JSON: %v\n%s", err, raw)
	}
	return s
}

// snapshot holds the observable state of some files and of the mount: every
// file xattr (or its errno), the size, and the stats.
type snapshot map[string]string

func takeSnapshot(t *testing.T, mnt string, files ...string) snapshot {
	t.Helper()
	s := snapshot{}
	for _, f := range files {
		for _, name := range []string{xLkey, xRkey, xAddr, xLength, xAccess, xState, xPD, xDesc} {
			v, err := getxattr(f, name)
			if err != nil {
				v = "error " + errnoString(err)
			}
			s[f+" "+name] = v
		}
		if fi, err := os.Stat(f); err != nil {
			s[f+" size"] = "error " + errnoString(err)
		} else {
			s[f+" size"] = strconv.FormatInt(fi.Size(), 10)
		}
	}
	st := readStats(t, mnt)
	s["stats buffers"] = strconv.FormatInt(st.Buffers, 10)
	s["stats pds"] = strconv.FormatInt(st.PDs, 10)
	s["stats registered_bytes"] = strconv.FormatInt(st.RegisteredBytes, 10)
	s["stats pinned_bytes"] = strconv.FormatInt(st.PinnedBytes, 10)
	return s
}

func (s snapshot) requireSame(t *testing.T, after snapshot, what string) {
	t.Helper()
	if reflect.DeepEqual(s, after) {
		return
	}
	var keys []string
	for k := range s {
		keys = append(keys, k)
	}
	for k := range after {
		if _, ok := s[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var diff []string
	for _, k := range keys {
		if s[k] != after[k] {
			diff = append(diff, fmt.Sprintf("  %s: %q -> %q", k, s[k], after[k]))
		}
	}
	t.Errorf("%s changed state:\n%s", what, strings.Join(diff, "\n"))
}
