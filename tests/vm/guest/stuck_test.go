//go:build rdma

package guest

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// watchTimeout shows, a minute before go test's own timeout, every
// thread of the guest that sleeps in the kernel uninterruptibly (state
// D) with its kernel stack: go test's timeout shows only this process's
// goroutines, and the hangs met here (a device going while something
// lists devices) were in the kernel. Call after flag.Parse.
func watchTimeout() {
	f := flag.Lookup("test.timeout")
	if f == nil {
		return
	}
	d, ok := f.Value.(flag.Getter).Get().(time.Duration)
	if !ok || d <= 2*time.Minute {
		return
	}
	time.AfterFunc(d-time.Minute, func() {
		fmt.Printf("guest: %v after the start, a minute before the timeout; threads asleep in the kernel:\n", d-time.Minute)
		stats, _ := filepath.Glob("/proc/[0-9]*/task/[0-9]*/stat")
		for _, stat := range stats {
			b, err := os.ReadFile(stat)
			_, rest, found := strings.Cut(string(b), ") ")
			if err != nil || !found || !strings.HasPrefix(rest, "D") {
				continue
			}
			task := filepath.Dir(stat)
			cmd, _ := os.ReadFile(filepath.Join(task, "..", "..", "cmdline"))
			stack, _ := os.ReadFile(filepath.Join(task, "stack"))
			fmt.Printf("%s: %s\n%s", task, strings.ReplaceAll(string(cmd), "\x00", " "), stack)
		}
	})
}
