package fs

import (
	"sync"
	"time"

	"mrfs/tree"
)

// forgetAfter is how long the kernel keeps a file's name after the
// daemon gave it a node (at a create or a lookup). Then the daemon tells
// the kernel to drop the name (FUSE_NOTIFY_INVAL_ENTRY). An unused file
// goes from the kernel's caches with it: its FORGET comes at once, and
// go-fuse lets go of its node (about 400 B of the daemon's memory per
// file, besides the kernel's own inode and dentry). A file open or
// mapped keeps its inode until its last close; a name used again costs
// one LOOKUP. Without this every file the kernel ever saw would keep its
// node for the mount's life: about 400 MB at a million buffers.
const forgetAfter = time.Second

// forgetter drops the kernel's names of files forgetAfter after their
// nodes were made, oldest first, from a goroutine of its own: telling the
// kernel takes the directory's lock, which a request under way may hold.
type forgetter struct {
	start time.Time
	wake  chan struct{} // a file queued to an empty queue, or stop

	mu sync.Mutex // guards: queue, stopped
	// queue is in the order the files were added, so by due time; a file
	// looked up again while queued is queued again (its first turn finds
	// the name still used, or already dropped: harmless).
	queue   []forgetEntry
	stopped bool

	drop func(dir *tree.Dir, name string) // tells the kernel
}

type forgetEntry struct {
	f   *tree.File
	due time.Duration // since start
}

func newForgetter(drop func(dir *tree.Dir, name string)) *forgetter {
	q := &forgetter{start: time.Now(), wake: make(chan struct{}, 1), drop: drop}
	go q.run()
	return q
}

// add queues f's name to be dropped forgetAfter from now.
func (q *forgetter) add(f *tree.File) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.stopped {
		return
	}
	q.queue = append(q.queue, forgetEntry{f, time.Since(q.start) + forgetAfter})
	if len(q.queue) == 1 {
		select {
		case q.wake <- struct{}{}:
		default:
		}
	}
}

// stop ends the goroutine; the names still queued stay with the kernel
// (the mount is going).
func (q *forgetter) stop() {
	q.mu.Lock()
	q.stopped = true
	q.queue = nil
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *forgetter) run() {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		q.mu.Lock()
		if q.stopped {
			q.mu.Unlock()
			return
		}
		queued := len(q.queue) > 0
		var wait time.Duration
		var e forgetEntry
		if queued {
			e = q.queue[0]
			if wait = e.due - time.Since(q.start); wait <= 0 {
				q.queue[0] = forgetEntry{}
				q.queue = q.queue[1:]
				if len(q.queue) == 0 {
					q.queue = nil // let the array go
				}
			}
		}
		q.mu.Unlock()
		switch {
		case !queued:
			<-q.wake
		case wait > 0:
			timer.Reset(wait)
			select {
			case <-q.wake:
			case <-timer.C:
			}
		default:
			// An unlinked file's name is gone from the kernel already.
			if dir, name := e.f.Name(); dir != nil {
				q.drop(dir, name)
			}
		}
	}
}
