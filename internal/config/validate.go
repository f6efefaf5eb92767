package config

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"mrfs/verbs"
)

// maxSoftMR is the most regions the soft device keeps: its keys are 32
// random bits, and at most one in 256 taken keeps a fresh one quick to
// draw (verbs/soft).
const maxSoftMR = 1<<24 - 1

// maxSoftDevices bounds verbs.soft_devices: a test of several NICs needs
// a few.
const maxSoftDevices = 16

// maxPopulateWorkers bounds buffers.populate_workers: more threads than
// this only contend for the same page allocator.
const maxPopulateWorkers = 256

// Validate checks the values, all of them, and joins one *Error per
// problem. Load and Parse call it; call it again after changing a Config
// (e.g. applying --backend), since command-line values are config too.
func (c Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, invalid(key, format, args...))
	}

	switch c.Verbs.Backend {
	case BackendAuto, BackendRDMA, BackendSoft:
	default:
		bad("verbs.backend", "%q is not a backend; use auto, rdma or soft", c.Verbs.Backend)
	}
	switch {
	case c.Verbs.SoftMaxMR < 0 || c.Verbs.SoftMaxMR > maxSoftMR:
		bad("verbs.soft_max_mr", "%d is out of range; use 0 (the device default) to %d", c.Verbs.SoftMaxMR, maxSoftMR)
	case c.Verbs.SoftMaxMR != 0 && c.Verbs.Backend == BackendRDMA:
		// A real device's max_mr is the hardware's; a cap that silently does
		// nothing would mislead.
		bad("verbs.soft_max_mr", "%d is set but the backend is rdma; it applies only to the soft backend (remove it or set it to 0)", c.Verbs.SoftMaxMR)
	}
	if d := c.Verbs.Device; d != "" && (c.Verbs.AllDevices || c.Verbs.Devices != nil && c.Verbs.Devices[0] != d) {
		bad("verbs.devices", "does not start with verbs.device %q; remove verbs.device (verbs.devices lists the first device first)", d)
	}
	switch n := c.Verbs.SoftDevices; {
	case n < 0 || n > maxSoftDevices:
		bad("verbs.soft_devices", "%d is out of range; use 0 or 1 (one device) to %d", n, maxSoftDevices)
	case n > 1 && c.Verbs.Backend == BackendRDMA:
		bad("verbs.soft_devices", "%d is set but the backend is rdma; it applies only to the soft backend (remove it or set it to 0)", n)
	}
	switch n := c.Verbs.SoftMaxPD; {
	case n < 0:
		bad("verbs.soft_max_pd", "%d is negative; use 0 (the device default) or a positive count", n)
	case n != 0 && c.Verbs.Backend == BackendRDMA:
		bad("verbs.soft_max_pd", "%d is set but the backend is rdma; it applies only to the soft backend (remove it or set it to 0)", n)
	}
	switch sz := c.Verbs.SoftMaxMRSize; {
	case sz != 0 && sz < 4096:
		bad("verbs.soft_max_mr_size", "%s is less than a page; use 0 (none) or at least 4096", sz)
	case sz != 0 && c.Verbs.Backend == BackendRDMA:
		bad("verbs.soft_max_mr_size", "%s is set but the backend is rdma; it applies only to the soft backend (remove it or set it to 0)", sz)
	}

	b := c.Buffers
	// Allowed access is a set of permissions, not one registration's flags,
	// so remote_write without local_write is accepted (merely useless);
	// adding local_write leaves only the unknown-bits check.
	if (b.AllowedAccess | verbs.LocalWrite).Validate() != nil {
		bad("buffers.allowed_access", "%q has bits no device accepts; use names from %s", b.AllowedAccess, accessNames)
	}
	switch {
	case (b.DefaultAccess | verbs.LocalWrite).Validate() != nil:
		bad("buffers.default_access", "%q has bits no device accepts; use names from %s", b.DefaultAccess, accessNames)
	case b.DefaultAccess.Validate() != nil:
		bad("buffers.default_access", "%q: remote_write and remote_atomic need local_write", b.DefaultAccess)
	}
	if extra := b.DefaultAccess &^ b.AllowedAccess; extra != 0 {
		bad("buffers.default_access", "%q is not a subset of buffers.allowed_access %q (%s not allowed)",
			b.DefaultAccess, b.AllowedAccess, extra)
	}
	if b.MaxBuffers < 0 {
		bad("buffers.max_buffers", "%d is negative; use 0 for no limit or a positive count", b.MaxBuffers)
	}
	if b.MaxPinned.Percent == 0 && b.MaxPinned.Bytes != 0 && b.DefaultSize > b.MaxPinned.Bytes {
		// Every create would fail with EFBIG.
		bad("buffers.default_size", "%s is more than buffers.max_pinned (%s), so no file could be created", b.DefaultSize, b.MaxPinned.Bytes)
	}
	if b.MaxPinnedPerUser != 0 && b.DefaultSize > b.MaxPinnedPerUser {
		bad("buffers.default_size", "%s is more than buffers.max_pinned_per_user (%s), so no file could be created", b.DefaultSize, b.MaxPinnedPerUser)
	}
	if b.PopulateWorkers < 0 || b.PopulateWorkers > maxPopulateWorkers {
		bad("buffers.populate_workers", "%d is out of range; use 0 (one per CPU the daemon may use) to %d", b.PopulateWorkers, maxPopulateWorkers)
	}
	if r := b.MaxRegionSize; r != 0 && int(r) < os.Getpagesize() {
		bad("buffers.max_region_size", "%s is less than a page (%d bytes); use 0 for the device's limit", r, os.Getpagesize())
	}
	if !slices.Contains(hugePolicies, b.HugePages) {
		bad("buffers.huge_pages", "%q is not a policy; use never, within_size, always or advise", b.HugePages)
	}
	if m := c.Metrics.Listen; m != "" {
		if err := checkListen(m); err != "" {
			bad("metrics.listen", "%q: %s", m, err)
		}
	}

	if c.Mount.Umask > 0o777 {
		bad("mount.umask", "0%s is more than 0777; a umask covers only the permission bits", strconv.FormatUint(uint64(c.Mount.Umask), 8))
	}

	if _, ok := knownLevel(c.Log.Level); !ok {
		bad("log.level", "%q is not a level; use debug, info, warn or error", c.Log.Level)
	}
	switch c.Log.Format {
	case FormatText, FormatJSON:
	default:
		bad("log.format", "%q is not a format; use text or json", c.Log.Format)
	}
	switch o := c.Log.Output; {
	case o == OutputStderr || o == OutputSyslog:
	case !filepath.IsAbs(o):
		// A daemon in the background changes to /: a relative path would
		// name another file then than now.
		bad("log.output", "%q is not stderr, syslog or an absolute file path", o)
	case strings.HasSuffix(o, "/"):
		bad("log.output", "%q is a directory; name the log file", o)
	}
	if c.Log.FuseRequests && c.Log.Level > slog.LevelDebug {
		bad("log.fuse_requests", "the requests are logged at debug level; set log.level = \"debug\" too")
	}
	if pb := c.Publish; len(pb.Endpoints) > 0 {
		for _, e := range pb.Endpoints {
			if u, err := url.Parse(e); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				bad("publish.endpoints", "%q is not an etcd client URL such as \"http://10.0.0.5:2379\"", e)
			}
		}
		if !strings.HasPrefix(pb.Prefix, "/") {
			bad("publish.prefix", "%q: want a key prefix starting with /", pb.Prefix)
		}
		if n := pb.Name; n != "" && (n != strings.Trim(n, "/") || strings.Contains(n, "//") || slices.Contains(strings.Split(n, "/"), "..") || slices.Contains(strings.Split(n, "/"), ".")) {
			bad("publish.name", "%q: want a name such as \"mnt/rdma\": no leading or trailing /, no empty, . or .. part", n)
		}
		if pb.Lease < 2*time.Second {
			bad("publish.lease", "%s: want at least 2s (etcd's shortest leases)", pb.Lease)
		}
		if c.Remote.Listen == "" {
			bad("publish.endpoints", "publication is for peers, but remote.listen is off: set it too")
		}
	}
	r := c.Remote
	if r.Listen != "" {
		if err := checkListen(r.Listen); err != "" {
			bad("remote.listen", "%q: %s", r.Listen, err)
		}
	}
	if r.MaxFailures < 0 {
		bad("remote.max_failures", "%d: want 0 (no limit) or more", r.MaxFailures)
	}
	if r.FailurePrefixV4 < 1 || r.FailurePrefixV4 > 32 {
		bad("remote.failure_prefix_v4", "%d: want a prefix length from 1 to 32 (24: failures count per /24)", r.FailurePrefixV4)
	}
	if r.FailurePrefixV6 < 1 || r.FailurePrefixV6 > 128 {
		bad("remote.failure_prefix_v6", "%d: want a prefix length from 1 to 128 (64: failures count per /64)", r.FailurePrefixV6)
	}
	if r.MaxConnections < 1 {
		bad("remote.max_connections", "%d: want at least 1", r.MaxConnections)
	}
	if r.MaxMessageSize < 1 || r.MaxMessageSize > MaxMessageLimit {
		bad("remote.max_message_size", "%s is out of range; use 1 B to 2 GiB (InfiniBand's largest message)", r.MaxMessageSize)
	}
	if r.Timeout <= 0 {
		bad("remote.timeout", "%s: want a positive duration such as \"10s\"", r.Timeout)
	}
	return join(errs)
}

// checkListen says what is wrong with a listen address, or "". The host
// must be an IP literal or empty (every address): a name would depend on
// the resolver at mount time, and what it bound to would be a surprise.
func checkListen(s string) string {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return "want host:port, e.g. \"127.0.0.1:7471\" or \"[::1]:7471\""
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Sprintf("port %q is not a number from 0 to 65535", port)
	}
	if host != "" {
		if _, err := netip.ParseAddr(host); err != nil {
			return fmt.Sprintf("host %q is not an IP address; write the address to listen on (or leave it empty for all)", host)
		}
	}
	return ""
}

// join is errors.Join, except that one error comes back as itself, so
// that a caller can type-assert the usual single *Error.
func join(errs []error) error {
	if len(errs) == 1 {
		return errs[0]
	}
	return errors.Join(errs...)
}
