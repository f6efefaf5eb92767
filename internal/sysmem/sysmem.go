// Package sysmem reads what the kernel says about the memory this process
// may use: the machine's (MemTotal, MemAvailable in /proc/meminfo) and its
// memory cgroup's limit and usage (v1's memory.limit_in_bytes and
// hierarchical limit, or v2's memory.max along the ancestors). mrfs sizes
// its pinning budget from it and checks it before pinning, so that the
// kernel's OOM killer is never the limit.
package sysmem

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Memory is one reading.
type Memory struct {
	Total     uint64 // MemTotal
	Available uint64 // MemAvailable
	// Cgroup is the process's memory cgroup directory ("" when none
	// limits it), its limit (the smallest along the hierarchy) and usage.
	Cgroup      string
	CgroupLimit uint64
	CgroupUsage uint64
}

// Limit is the memory the process may use: the smaller of MemTotal and
// its cgroup's limit.
func (m Memory) Limit() uint64 {
	if m.Cgroup != "" && m.CgroupLimit < m.Total {
		return m.CgroupLimit
	}
	return m.Total
}

// CgroupHeadroom is what the cgroup still lets the process charge; ok is
// false when no cgroup limits it.
func (m Memory) CgroupHeadroom() (n uint64, ok bool) {
	if m.Cgroup == "" {
		return 0, false
	}
	if m.CgroupUsage >= m.CgroupLimit {
		return 0, true
	}
	return m.CgroupLimit - m.CgroupUsage, true
}

// Read reads the current values.
func Read() (Memory, error) { return readAt("/") }

// unlimited: a cgroup limit this large means none (v1 shows
// PAGE_COUNTER_MAX pages as 9223372036854771712).
const unlimited = 1 << 62

// readAt reads below root, so tests can give it a fake /proc and /sys.
func readAt(root string) (Memory, error) {
	var m Memory
	info, err := os.ReadFile(filepath.Join(root, "proc/meminfo"))
	if err != nil {
		return m, fmt.Errorf("read meminfo: %w", err)
	}
	for _, line := range strings.Split(string(info), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "MemTotal":
			m.Total = kb << 10
		case "MemAvailable":
			m.Available = kb << 10
		}
	}
	if m.Total == 0 {
		return m, fmt.Errorf("read meminfo: no MemTotal")
	}
	dir, v2, err := cgroupDir(root)
	if err != nil || dir == "" {
		return m, err
	}
	limit, usage, err := cgroupValues(dir, v2, root)
	if err != nil {
		return m, err
	}
	if limit < unlimited {
		m.Cgroup, m.CgroupLimit, m.CgroupUsage = dir, limit, usage
	}
	return m, nil
}

// cgroupDir finds the directory of the process's memory cgroup: the v1
// memory controller's when it is mounted, else the v2 hierarchy's.
func cgroupDir(root string) (dir string, v2 bool, err error) {
	cg, err := os.ReadFile(filepath.Join(root, "proc/self/cgroup"))
	if err != nil {
		return "", false, fmt.Errorf("read /proc/self/cgroup: %w", err)
	}
	var v1Path, v2Path string
	have1, have2 := false, false
	for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[0] == "0" && f[1] == "" {
			v2Path, have2 = f[2], true
		}
		for _, c := range strings.Split(f[1], ",") {
			if c == "memory" {
				v1Path, have1 = f[2], true
			}
		}
	}
	mi, err := os.Open(filepath.Join(root, "proc/self/mountinfo"))
	if err != nil {
		return "", false, fmt.Errorf("read mountinfo: %w", err)
	}
	defer mi.Close()
	var v2Mount string
	sc := bufio.NewScanner(mi)
	for sc.Scan() {
		left, right, ok := strings.Cut(sc.Text(), " - ")
		if !ok {
			continue
		}
		lf, rf := strings.Fields(left), strings.Fields(right)
		if len(lf) < 5 || len(rf) < 3 {
			continue
		}
		mroot, point := lf[3], lf[4]
		switch rf[0] {
		case "cgroup":
			if have1 && hasOption(rf[2], "memory") {
				return join(root, point, mroot, v1Path), false, nil
			}
		case "cgroup2":
			if have2 && v2Mount == "" {
				v2Mount = join(root, point, mroot, v2Path)
			}
		}
	}
	if v2Mount != "" {
		if _, err := os.Stat(filepath.Join(v2Mount, "memory.max")); err == nil || v2Path == "/" {
			return v2Mount, true, nil
		}
	}
	return "", false, nil
}

func hasOption(opts, want string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == want {
			return true
		}
	}
	return false
}

// join is the directory of cgroup path p on a mount of mroot at point.
func join(root, point, mroot, p string) string {
	rel := p
	if mroot != "/" {
		rel = strings.TrimPrefix(p, mroot)
	}
	return filepath.Join(root, point, rel)
}

// cgroupValues reads the limit (smallest along the hierarchy) and usage.
func cgroupValues(dir string, v2 bool, root string) (limit, usage uint64, err error) {
	if !v2 {
		limit, err = readUint(filepath.Join(dir, "memory.limit_in_bytes"))
		if err != nil {
			return 0, 0, err
		}
		if h, ok := statValue(filepath.Join(dir, "memory.stat"), "hierarchical_memory_limit"); ok && h < limit {
			limit = h
		}
		usage, err = readUint(filepath.Join(dir, "memory.usage_in_bytes"))
		return limit, usage, err
	}
	limit = ^uint64(0)
	mountRoot := filepath.Clean(root)
	for d := dir; ; d = filepath.Dir(d) {
		if v, err := readUint(filepath.Join(d, "memory.max")); err == nil && v < limit {
			limit = v
		}
		if d == mountRoot || d == filepath.Dir(d) || !strings.HasPrefix(d, mountRoot) {
			break
		}
		if _, err := os.Stat(filepath.Join(d, "cgroup.controllers")); err != nil {
			break // left the cgroup2 mount
		}
	}
	usage, _ = readUint(filepath.Join(dir, "memory.current"))
	return limit, usage, nil
}

// readUint reads a file holding one number, or "max" (unlimited).
func readUint(path string) (uint64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", path, err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return ^uint64(0), nil
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("read %s: %q is not a number", path, s)
	}
	return v, nil
}

func statValue(path, key string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}
