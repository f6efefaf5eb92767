package fs

import (
	"os"
	"slices"
	"testing"
)

// The supplementary groups are read from the calling thread's
// /proc/PID/status: here, this process's own.
func TestProcGroups(t *testing.T) {
	want, err := os.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	var got []int
	for _, g := range procGroups(uint32(os.Getpid())) {
		got = append(got, int(g))
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("procGroups(self) = %v, want %v", got, want)
	}
	if g := procGroups(0); g != nil {
		t.Errorf("procGroups(0) = %v, want none (no pid to read)", g)
	}
}
