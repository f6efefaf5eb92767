package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"mrfs/internal/config"
)

// poolTrust is the one sentence every door to pools says (DESIGN
// "Pools").
const poolTrust = "A pool is one trust domain: a peer admitted to its directory's PD reaches every slot with the chunk's key, so a pool is for one owner or a cooperating group (as pools are in NCCL, UCX and Mooncake); separate tenants get separate pools or standalone buffers."

// cmdPool makes DIR (made if missing, else empty) a pool of fixed-size
// slots, or changes the slots of the pool DIR is: user.mrfs.pool.
func cmdPool(args []string, stdout, stderr io.Writer) error {
	f := flag.NewFlagSet("pool", flag.ContinueOnError)
	slot := f.String("slot", "", "`SIZE` of each slot (64KiB, 1MiB, ...), whole pages; needed to make a pool")
	slots := f.Int("slots", 0, "how many slots (`N`); on an existing pool, raising it adds a chunk, lowering it frees free chunks from the end")
	access := f.String("access", "", "access `FLAGS` of the pool's files (its default_access: local_write,remote_read,...); on an existing pool it re-registers the chunks (new keys)")
	pos, err := parse(f, args, 1)
	if err != nil {
		return err
	}
	if *slots <= 0 {
		return usageError("pool: --slots N is needed (N > 0)")
	}
	spec := fmt.Sprintf("slots=%d", *slots)
	if *slot != "" {
		n, err := config.ParseSize(*slot)
		if err != nil {
			return usageError("pool: --slot %q: %v", *slot, err)
		}
		spec = fmt.Sprintf("slot=%d,%s", n, spec)
	}
	dir := pos[0]
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("pool: %w", err)
	}
	if _, err := getxattrString(dir, "user.mrfs.pd"); err != nil {
		return fmt.Errorf("pool: %s is not a directory of an mrfs mount (%w)", dir, err)
	}
	if *access != "" {
		if err := unix.Setxattr(dir, "user.mrfs.default_access", []byte(*access), 0); err != nil {
			return fmt.Errorf("pool: set access %q on %s: %w", *access, dir, err)
		}
	}
	if err := unix.Setxattr(dir, "user.mrfs.pool", []byte(spec), 0); err != nil {
		why := ""
		switch {
		case errors.Is(err, syscall.ENOTEMPTY):
			why = " (a pool is made of an empty directory)"
		case errors.Is(err, syscall.EPERM):
			why = " (not the mount's root, nor inside a pool)"
		}
		return fmt.Errorf("pool: %s: %w%s; the mount's log says more", dir, err, why)
	}
	v, err := getxattrString(dir, "user.mrfs.pool")
	if err != nil {
		return fmt.Errorf("pool: %s: %w", dir, err)
	}
	fmt.Fprintf(stdout, "%s: %s\n", dir, v)
	return nil
}
