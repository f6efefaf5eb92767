package mount

import (
	"fmt"
	"log/slog"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"mrfs/journal"
	"mrfs/tree"
)

// journaling is the daemon's journal (DESIGN, Restart), kept while a
// keeper holds the mount: a memfd the keeper holds too, written as the
// namespace changes, compacted from a goroutine of its own.
type journaling struct {
	j    *journal.Journal
	f    *os.File
	stop chan struct{}
	done chan struct{}
	// dieAt is the test hook dieAtDoneEnv's file ("": none).
	dieAt string
}

func newJournaling() (*journaling, error) {
	fd, err := unix.MemfdCreate("mrfs-journal", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("the journal: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "mrfs-journal")
	return &journaling{j: journal.New(f), f: f}, nil
}

// compactEvery is how often the journal's growth is looked at.
const compactEvery = time.Second

// start writes t's first state and compacts from then on, once what was
// written since the last state outgrows that state (and 1 MiB): the
// journal's memory stays within about twice the namespace's.
func (jl *journaling) start(t *tree.Tree, log *slog.Logger) error {
	if err := jl.j.Compact(t.Checkpoint); err != nil {
		return err
	}
	jl.stop, jl.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(jl.done)
		last := jl.j.Size() // the end of the last state
		state := last       // its length, or more
		tick := time.NewTicker(compactEvery)
		defer tick.Stop()
		reported := false
		for {
			select {
			case <-jl.stop:
				return
			case <-tick.C:
			}
			if err := jl.j.Err(); err != nil && !reported {
				log.Error("journal: a change was not written; a restart after a crash would lose it", "err", err)
				reported = true
			}
			if jl.j.Size()-last < max(1<<20, state) {
				continue
			}
			before := jl.j.Size()
			if err := jl.j.Compact(t.Checkpoint); err != nil {
				log.Error("journal: compaction failed", "err", err)
				continue
			}
			last = jl.j.Size()
			state = last - before
		}
	}()
	return nil
}

// dieAfter is the test hook dieAtDoneEnv: when its file exists, the
// daemon removes it and dies at once, after a request changed the
// namespace (journaled with the change) and before its reply.
func (jl *journaling) dieAfter(uint64) (hold bool) {
	if os.Remove(jl.dieAt) == nil {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
	}
	return false
}

// close stops the compaction and closes the daemon's descriptor (the
// keeper's stays).
func (jl *journaling) close() {
	if jl == nil {
		return
	}
	if jl.stop != nil {
		close(jl.stop)
		<-jl.done
	}
	jl.j.Close()
	jl.f.Close()
}
