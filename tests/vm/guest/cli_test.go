//go:build rdma

package guest

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDevicesOnRxe: `mrfs devices` lists rxe0 with the limits rxe reports,
// and the default backend (auto) picks rdma because a device exists.
func TestDevicesOnRxe(t *testing.T) {
	requireGuest(t)
	for _, args := range [][]string{{"devices"}, {"devices", "--backend", "rdma"}} {
		out, err := exec.Command(mrfsBin(), args...).CombinedOutput()
		if err != nil {
			t.Fatalf("mrfs %v: %v\n%s", args, err, out)
		}
		t.Logf("mrfs %v:\n%s", args, out)
		var row []string
		for _, line := range strings.Split(string(out), "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == device {
				row = f
			}
		}
		// DEVICE BACKEND MAX_MR MAX_MR_SIZE MAX_PD PAGE_SIZE_CAP ACCESS
		if len(row) < 7 || row[1] != "rdma" || row[2] != "524287" || row[3] != "0xffffffffffffffff" ||
			row[4] != "1048576" || row[5] != "0xfffff000" || !strings.HasPrefix(row[6], "local_write,remote_write,remote_read,remote_atomic") {
			t.Errorf("mrfs %v: row for %s = %q; want backend rdma, max_mr 524287, max_mr_size 2^64-1, max_pd 1048576, page_size_cap 0xfffff000, access from local_write to remote_atomic", args, device, row)
		}
	}
	out, err := exec.Command(mrfsBin(), "devices", "--backend", "soft").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "soft0") {
		t.Errorf("mrfs devices --backend soft: %v\n%s", err, out)
	}
}
