package mount

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"mrfs/fuseconn"
	"mrfs/internal/sdnotify"
)

// Under systemd with a file descriptor store (FileDescriptorStoreMax=,
// which systemd >= 254 announces as $FDSTORE; contrib/mrfs@.service sets
// both), the store holds what a keeper would (keeper.go): the daemon
// hands it over by name once it serves, and systemd passes the set back
// to the daemon it starts after a crash, which takes the mount over from
// the journal as under a keeper. The connection, its INIT and the store's
// root are the mount's for its whole life (an upgrade or a restart
// adopts the same descriptions; systemd keeps one of a description sent
// twice); the journal is each program's own, named with the restarts
// the mount has survived, so that a restart takes the newest and the
// restarts from its name.
const (
	fdsConn    = "mrfs-fuse"
	fdsInit    = "mrfs-fuse-init"
	fdsStore   = "mrfs-store"
	fdsJournal = "mrfs-journal."
	// fdsNeeded is what a restart needs: FDSTORE must allow as many.
	fdsNeeded = 4
)

// fdsOld: a program removes the journals of the programs this many
// restarts before its own (those a failed upgrade skipped included).
const fdsOld = 4

// fdStore says whether this daemon hands its mount to systemd's store.
func fdStore() bool { return keeperFd() < 0 && sdnotify.StoreMax() >= fdsNeeded }

// fdStoreTaken: fromFdStore runs once, before anything asks whether this
// program adopts a mount (Restarted, takeInherited).
var fdStoreTaken struct {
	sync.Once
	err error
}

func takeFdStore() error {
	fdStoreTaken.Do(func() { fdStoreTaken.err = fromFdStore() })
	return fdStoreTaken.err
}

// fromFdStore, at the start of a daemon systemd started, takes a mount's
// set from the descriptors systemd passed it (LISTEN_FDNAMES) and hands
// it on as a keeper does (its environment), with the restarts of the
// newest journal's name plus one; the rest are closed. Without a whole
// set it takes nothing: this daemon mounts afresh.
func fromFdStore() error {
	got := sdnotify.Listened()
	if got == nil {
		return nil
	}
	take := func(name string) int {
		if fds := got[name]; len(fds) > 0 {
			got[name] = fds[1:]
			return fds[0]
		}
		return -1
	}
	conn, init, store := take(fdsConn), take(fdsInit), take(fdsStore)
	newest, journal := -1, -1
	for name, fds := range got {
		num, ok := strings.CutPrefix(name, fdsJournal)
		if n, err := strconv.Atoi(num); ok && err == nil && len(fds) > 0 && n > newest {
			newest = n
		}
	}
	if newest >= 0 {
		journal = take(fdsJournal + strconv.Itoa(newest))
	}
	for _, fds := range got {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if set := []int{conn, init, store, journal}; slices.Contains(set, -1) {
		for _, fd := range set {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
		return fmt.Errorf("systemd passed descriptors, not a mount's (%s, %s, %s, %sN; these are %d, %d, %d, %d): mounting afresh",
			fdsConn, fdsInit, fdsStore, fdsJournal, conn, init, store, journal)
	}
	for _, kv := range append(fuseconn.Env(conn, init), envStore+"="+strconv.Itoa(store),
		envJournal+"="+strconv.Itoa(journal), envRestarts+"="+strconv.Itoa(newest+1)) {
		k, v, _ := strings.Cut(kv, "=")
		os.Setenv(k, v)
	}
	return nil
}

// handToFdStore sends systemd's store what a daemon it starts after this
// one dies takes the mount over with: the connection conn, its INIT
// (from the mount's first program only: it never changes), the store's
// root store and this program's journal, then removes the journals of
// the programs before. The store's root is an O_PATH descriptor, which
// systemd cannot poll: FDPOLL=0 (as for the memfds, which never hang
// up); the connection is polled, so that systemd lets a dead one go.
func handToFdStore(conn int, init []byte, first bool, store, journal, restarts int) error {
	send := func(name string, poll bool, fd int) error {
		state := "FDSTORE=1\nFDNAME=" + name
		if !poll {
			state += "\nFDPOLL=0"
		}
		return sdnotify.Notify(state, fd)
	}
	if first {
		initFd, err := fuseconn.InitFile(init)
		if err != nil {
			return fmt.Errorf("hand the mount to systemd: %w", err)
		}
		defer unix.Close(initFd)
		if err := send(fdsInit, false, initFd); err != nil {
			return fmt.Errorf("hand the mount to systemd: %w", err)
		}
	}
	if err := send(fdsConn, true, conn); err != nil {
		return fmt.Errorf("hand the mount to systemd: %w", err)
	}
	if err := send(fdsStore, false, store); err != nil {
		return fmt.Errorf("hand the mount to systemd: %w", err)
	}
	if err := send(fdsJournal+strconv.Itoa(restarts), false, journal); err != nil {
		return fmt.Errorf("hand the mount to systemd: %w", err)
	}
	for r := max(0, restarts-fdsOld); r < restarts; r++ {
		if err := sdnotify.Notify("FDSTOREREMOVE=1\nFDNAME=" + fdsJournal + strconv.Itoa(r)); err != nil {
			return fmt.Errorf("hand the mount to systemd: drop an old journal: %w", err)
		}
	}
	return nil
}

// dropFdStore removes from systemd's store all a daemon with restarts
// handed it.
func dropFdStore(restarts int) error {
	for _, name := range []string{fdsConn, fdsInit, fdsStore, fdsJournal + strconv.Itoa(restarts)} {
		if err := sdnotify.Notify("FDSTOREREMOVE=1\nFDNAME=" + name); err != nil {
			return fmt.Errorf("take the mount out of systemd's store: %w", err)
		}
	}
	return nil
}
