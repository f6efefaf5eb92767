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

	mu sync.Mutex // guards: queue, stopped, paused
	// queue is in the order the files were added, so by due time; a file
	// looked up again while queued is queued again (its first turn finds
	// the name still used, or already dropped: harmless).
	queue   []forgetEntry
	stopped bool
	paused  bool

	// dropping is held while the kernel is told (drop), so that pause
	// can wait for it. Lock order: dropping, then mu.
	dropping sync.Mutex
	drop     func(dir *tree.Dir, name string) // tells the kernel
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

// now queues f's name to be dropped at once, before the others: a name
// made otherwise than by a reply that gives the kernel its entry (mrfs
// register, a setxattr), which the kernel may hold as absent. It waits
// for the request's reply, which holds the directory's lock, as the
// others wait for requests under way: so an upgrade's pause waits for
// it, and no drop is left waiting behind a reply that the exec cuts off.
func (q *forgetter) now(f *tree.File) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.stopped {
		return
	}
	q.queue = append([]forgetEntry{{f, time.Since(q.start)}}, q.queue...)
	select {
	case q.wake <- struct{}{}:
	default:
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

// pause stops the drops until resume, and waits for one under way. The
// kernel takes the directory's lock to drop a name, which a LOOKUP or a
// READDIR under way holds until the daemon answers it: a daemon about to
// stop answering (an upgrade's gate) pauses first, or a drop would wait
// for an answer that never comes, and the exec, which waits for every
// thread, with it.
func (q *forgetter) pause() {
	q.mu.Lock()
	q.paused = true
	q.mu.Unlock()
	q.dropping.Lock()
	defer q.dropping.Unlock()
}

// resume lets the drops go on after pause.
func (q *forgetter) resume() {
	q.mu.Lock()
	q.paused = false
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
		if q.paused {
			q.mu.Unlock()
			<-q.wake
			continue
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
			q.dropping.Lock()
			q.mu.Lock()
			paused := q.paused
			if paused { // since it was taken from the queue: its turn is next
				q.queue = append([]forgetEntry{e}, q.queue...)
			}
			q.mu.Unlock()
			// An unlinked file's name is gone from the kernel already.
			if dir, name := e.f.Name(); dir != nil && !paused {
				q.drop(dir, name)
			}
			q.dropping.Unlock()
		}
	}
}
