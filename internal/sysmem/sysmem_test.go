package sysmem

import (
	"os"
	"path/filepath"
	"testing"
)

// fake writes a /proc and /sys tree under a temporary root.
func fake(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for name, data := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

const meminfo = "MemTotal:       24684084 kB\nMemFree:        1 kB\nMemAvailable:   23709912 kB\n"

func TestCgroupV1(t *testing.T) {
	root := fake(t, map[string]string{
		"proc/meminfo":        meminfo,
		"proc/self/cgroup":    "9:name=systemd:/\n4:memory:/jobs/a\n0::/\n",
		"proc/self/mountinfo": "30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
		"sys/fs/cgroup/memory/jobs/a/memory.limit_in_bytes": "2147483648\n",
		"sys/fs/cgroup/memory/jobs/a/memory.usage_in_bytes": "1610612736\n",
		// a parent's smaller limit applies
		"sys/fs/cgroup/memory/jobs/a/memory.stat": "cache 0\nhierarchical_memory_limit 1073741824\n",
	})
	m, err := readAt(root)
	if err != nil {
		t.Fatal(err)
	}
	if m.Total != 24684084<<10 || m.Available != 23709912<<10 {
		t.Errorf("meminfo: %+v", m)
	}
	if m.Cgroup != filepath.Join(root, "sys/fs/cgroup/memory/jobs/a") || m.CgroupLimit != 1<<30 || m.Limit() != 1<<30 {
		t.Errorf("cgroup: %+v, limit %d", m, m.Limit())
	}
	if h, ok := m.CgroupHeadroom(); !ok || h != 0 {
		t.Errorf("headroom %d %v: usage is past the hierarchical limit", h, ok)
	}
}

func TestCgroupV1Unlimited(t *testing.T) {
	root := fake(t, map[string]string{
		"proc/meminfo":        meminfo,
		"proc/self/cgroup":    "4:memory:/\n",
		"proc/self/mountinfo": "30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
		"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
		"sys/fs/cgroup/memory/memory.usage_in_bytes": "1\n",
	})
	m, err := readAt(root)
	if err != nil {
		t.Fatal(err)
	}
	if m.Cgroup != "" || m.Limit() != m.Total {
		t.Errorf("an unlimited cgroup limits: %+v", m)
	}
	if _, ok := m.CgroupHeadroom(); ok {
		t.Error("headroom of no cgroup")
	}
}

// v2: the smallest memory.max along the ancestors, inside a container
// whose cgroup namespace root is mounted at /sys/fs/cgroup.
func TestCgroupV2(t *testing.T) {
	root := fake(t, map[string]string{
		"proc/meminfo":                              meminfo,
		"proc/self/cgroup":                          "0::/svc/mrfs\n",
		"proc/self/mountinfo":                       "40 30 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
		"sys/fs/cgroup/cgroup.controllers":          "memory\n",
		"sys/fs/cgroup/svc/cgroup.controllers":      "memory\n",
		"sys/fs/cgroup/svc/memory.max":              "536870912\n",
		"sys/fs/cgroup/svc/mrfs/cgroup.controllers": "memory\n",
		"sys/fs/cgroup/svc/mrfs/memory.max":         "max\n",
		"sys/fs/cgroup/svc/mrfs/memory.current":     "104857600\n",
	})
	m, err := readAt(root)
	if err != nil {
		t.Fatal(err)
	}
	if m.CgroupLimit != 512<<20 || m.CgroupUsage != 100<<20 || m.Limit() != 512<<20 {
		t.Errorf("v2: %+v", m)
	}
	if h, ok := m.CgroupHeadroom(); !ok || h != 412<<20 {
		t.Errorf("headroom %d %v", h, ok)
	}
}

// The real machine answers.
func TestRead(t *testing.T) {
	m, err := Read()
	if err != nil {
		t.Fatal(err)
	}
	if m.Total == 0 || m.Available == 0 || m.Available > m.Total || m.Limit() == 0 {
		t.Errorf("%+v", m)
	}
}
