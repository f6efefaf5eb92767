package cli

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// cmdRegister registers a shared-memory file in place: user.mrfs.register
// on FILE's directory (DESIGN "Memory you bring").
func cmdRegister(args []string, stdout, stderr io.Writer) error {
	f := flag.NewFlagSet("register", flag.ContinueOnError)
	access := f.String("access", "", "access `FLAGS` (local_write,remote_read,...; none for read-only); default: the directory's default_access. Flags that write need a source you may write")
	pos, err := parse(f, args, 2)
	if err != nil {
		return err
	}
	src, err := sourcePath(pos[0])
	if err != nil {
		return fmt.Errorf("register: %w", err)
	}
	dir, name := filepath.Dir(pos[1]), filepath.Base(pos[1])
	req := map[string]any{"name": name, "source": src}
	set := false
	f.Visit(func(fl *flag.Flag) { set = set || fl.Name == "access" })
	if set {
		req["access"] = *access
	}
	v, _ := json.Marshal(req)
	if err := unix.Setxattr(dir, "user.mrfs.register", v, 0); err != nil {
		if !errors.Is(err, unix.EPERM) || !stickyNotOwned(dir) {
			return fmt.Errorf("register %s as %s: %w; the mount's log says why", src, pos[1], err)
		}
		// The kernel lets only a sticky directory's owner set its
		// attributes; anyone who may write it makes a link, whose target
		// carries the request (DESIGN "Memory you bring").
		delete(req, "name")
		v, _ = json.Marshal(req)
		if err := os.Symlink(string(v), pos[1]); err != nil {
			return fmt.Errorf("register %s as %s (a link: %s is sticky and not yours, so its attribute cannot be set): %w; the mount's log says why", src, pos[1], dir, errors.Unwrap(err))
		}
	}
	// The kernel may have held the name as absent until the daemon's
	// word that it exists, which follows the reply, lands.
	state, err := getxattrString(pos[1], "user.mrfs.state")
	for i := 0; i < 100 && errors.Is(err, unix.ENOENT); i++ {
		time.Sleep(10 * time.Millisecond)
		state, err = getxattrString(pos[1], "user.mrfs.state")
	}
	if err != nil {
		return fmt.Errorf("register: %s: %w", pos[1], err)
	}
	keys, _ := getxattrString(pos[1], "user.mrfs.keys")
	fmt.Fprintf(stdout, "%s: %s from %s\n%s", pos[1], state, src, keys)
	return nil
}

// stickyNotOwned says whether dir is sticky and another user's: then the
// kernel refuses the caller its user.* attributes (EPERM).
func stickyNotOwned(dir string) bool {
	var st unix.Stat_t
	if unix.Stat(dir, &st) != nil {
		return false
	}
	return st.Mode&unix.S_ISVTX != 0 && st.Uid != uint32(os.Geteuid())
}

// sourcePath is p absolute, as the daemon resolves it in this process's
// mount namespace; /proc/self names this process, which the daemon's own
// /proc/self would not.
func sourcePath(p string) (string, error) {
	p, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	pid := "/proc/" + strconv.Itoa(os.Getpid())
	for _, self := range []string{"/proc/self", "/proc/thread-self"} {
		if rest, ok := strings.CutPrefix(p, self); ok && (rest == "" || rest[0] == '/') {
			return pid + rest, nil
		}
	}
	return p, nil
}
