// Package journal keeps the namespace's changes as they happen, one
// record per change (O(1)), in a file that outlives the daemon (a memfd
// in systemd's fd store or a keeper's hands), so that a daemon restarted
// after a crash rebuilds the tree.State nobody could save (Replay); see
// DESIGN, Restart.
//
// The file is a sequence of JSON lines. It starts with a state record (a
// whole tree.State, written by Compact); every later line is a change
// (tree.Journal's calls, and buffer.Options.OnKept's). Each record holds
// the new value of what changed, never a difference, so a record applied
// to a state that already has it changes nothing. Compact relies on it:
// it saves the tree while changes go on, appends the state with the
// offset from which it may lack changes, and punches out what is before
// that offset. Replay starts from the last whole state record, applies
// again what was written from its offset on, and ignores a last line a
// crash cut short.
//
// Locking: Journal.mu guards the file's writes and the offset; it is a
// leaf (a record is made before it is taken, and nothing is called with
// it held), so the tree and the buffer manager call in with their locks
// held, which orders each node's records as its changes.
package journal

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/tree"
	"mrfs/verbs"
)

// record is one line of the journal: Op says which fields count.
type record struct {
	Op string `json:"op"`
	// "state": the whole namespace, missing none of the changes
	// written before offset Since, and the backing ids the kernel held
	// when it was written.
	State   *tree.State      `json:"state,omitempty"`
	Since   int64            `json:"since,omitempty"`
	Backing map[uint64]int32 `json:"backing,omitempty"`
	Done    []uint64         `json:"done,omitempty"`
	// "made": Node. "named": Ino, Parent, Name. "removed", "numbered":
	// Ino. "meta": Ino, Meta. "access": Ino, Access (a directory's
	// default). "kept": Kept (a buffer, by its file). "backing": Ino,
	// ID (0: none). Made, named and removed: Unique, the request they
	// complete (tree.Req), or none. ("done": Unique, an earlier
	// program's record of a request, read still.)
	Node   *tree.NodeState `json:"node,omitempty"`
	Ino    uint64          `json:"ino,omitempty"`
	Parent uint64          `json:"parent,omitempty"`
	Name   string          `json:"name,omitempty"`
	Meta   *meta           `json:"meta,omitempty"`
	Access verbs.Access    `json:"access,omitempty"`
	Kept   *buffer.Kept    `json:"kept,omitempty"`
	ID     int32           `json:"id,omitempty"`
	Unique uint64          `json:"unique,omitempty"`
}

// meta is tree.Meta with times in nanoseconds since the epoch.
type meta struct {
	Mode  uint32 `json:"mode"`
	UID   uint32 `json:"uid"`
	GID   uint32 `json:"gid"`
	Atime int64  `json:"atime"`
	Mtime int64  `json:"mtime"`
	Ctime int64  `json:"ctime"`
}

// Journal writes records to its file. Its methods are tree.Journal's and
// buffer.Options.OnKept (Kept).
type Journal struct {
	f *os.File

	mu sync.Mutex // guards: end, err, backing, done, line, win, winOff, and the writes to f
	// end is the offset the next record goes to.
	end int64
	// err is the first write that failed: the records after it are
	// lost, and Err says so (the daemon logs it; a restart from this
	// journal would miss changes).
	err error
	// backing is the passthrough backing id the kernel holds of each
	// node that has one (Backing), for the state records.
	backing map[uint64]int32
	// done are the last requests records completed (a ring, next is
	// the oldest), for the state records.
	done []uint64
	next int
	// line is the change record being written, kept for the next.
	line []byte
	// win maps the file's bytes from winOff on (writeLocked), up to
	// where the file ends or beyond.
	win    []byte
	winOff int64
}

// keepDone is how many done requests a state record carries: more than
// the requests a daemon has under way at once (the kernel's queue).
const keepDone = 4096

var _ tree.Journal = (*Journal)(nil)

// New is a journal in f, an empty file. Its first Compact writes the
// state every later record changes: until then Replay finds none.
func New(f *os.File) *Journal { return &Journal{f: f, backing: map[uint64]int32{}} }

// Err is the first failure to write a record, or nil.
func (j *Journal) Err() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.err
}

// Size is the bytes written since the start, holes included: the offset
// of the next record.
func (j *Journal) Size() int64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.end
}

// Made, Named and Removed carry the request they complete (req, 0 for
// none) as the record's unique: the journal's done requests.
func (j *Journal) Made(ns tree.NodeState, req tree.Req) {
	j.put(record{Op: "made", Node: &ns, Unique: uint64(req)})
}

func (j *Journal) Named(ino, parent uint64, name string, req tree.Req) {
	j.put(record{Op: "named", Ino: ino, Parent: parent, Name: name, Unique: uint64(req)})
}

func (j *Journal) Removed(ino uint64, req tree.Req) {
	j.put(record{Op: "removed", Ino: ino, Unique: uint64(req)})
}

func (j *Journal) Meta(ino uint64, m tree.Meta) {
	j.put(record{Op: "meta", Ino: ino, Meta: &meta{Mode: m.Mode, UID: m.UID, GID: m.GID,
		Atime: m.Atime.UnixNano(), Mtime: m.Mtime.UnixNano(), Ctime: m.Ctime.UnixNano()}})
}

func (j *Journal) DefaultAccess(ino uint64, a verbs.Access) {
	j.put(record{Op: "access", Ino: ino, Access: a})
}

func (j *Journal) Numbered(ino uint64) { j.put(record{Op: "numbered", Ino: ino}) }

// Kept is buffer.Options.OnKept: a buffer's registration, access or
// owner changed.
func (j *Journal) Kept(k buffer.Kept) { j.put(record{Op: "kept", Kept: &k}) }

// Backing: the kernel now holds backing id id for node ino's passthrough
// opens (0: none). The kernel allows one backing file per inode while
// any passthrough open of it lives, so a daemon restarted after a crash
// gives new opens of such a node this id.
func (j *Journal) Backing(ino uint64, id int32) { j.put(record{Op: "backing", Ino: ino, ID: id}) }

// put writes r, a change; a failure is kept for Err.
func (j *Journal) put(r record) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.err != nil {
		return
	}
	switch {
	case r.Op == "backing" && r.ID != 0:
		j.backing[r.Ino] = r.ID
	case r.Op == "backing":
		delete(j.backing, r.Ino)
	case r.Unique != 0 && len(j.done) < keepDone:
		j.done = append(j.done, r.Unique)
	case r.Unique != 0:
		j.done[j.next] = r.Unique
		j.next = (j.next + 1) % keepDone
	}
	j.line = append(appendChange(j.line[:0], &r), '\n')
	j.writeLocked(r.Op, j.line)
}

// window is how much of the file is mapped at a time. A record is
// copied into the mapping, not written with pwrite: a system call per
// record was 1.3 µs of its 1.6 in the mount (BENCHMARKS).
const window = 1 << 20

// writeLocked appends line, one record ending in its newline.
func (j *Journal) writeLocked(op string, line []byte) error {
	if j.err != nil {
		return j.err
	}
	if j.end+int64(len(line)) > j.winOff+int64(len(j.win)) {
		if err := j.remapLocked(len(line)); err != nil {
			// (A copy of op: op itself would move every record to the heap.)
			j.err = fmt.Errorf("journal a %s record: %w", strings.Clone(op), err)
			return j.err
		}
	}
	p := j.end - j.winOff
	// The newline last: a record is whole once it is there. A crash in
	// the copy leaves a last line without one (the pages are the file's:
	// what was copied is there for the next daemon), which Replay ignores.
	n := copy(j.win[p:], line[:len(line)-1])
	j.win[p+int64(n)] = '\n'
	j.end += int64(len(line))
	return nil
}

// remapLocked maps the window of the file that holds the next n bytes,
// the file grown to cover it (a write past its end would be SIGBUS). Its
// pages are made as records reach them: what the file holds is what was
// written, less what Compact freed.
func (j *Journal) remapLocked(n int) error {
	if err := j.unmapLocked(); err != nil {
		return err
	}
	page := int64(os.Getpagesize())
	off := j.end &^ (page - 1)
	size := max(window, (j.end-off+int64(n)+page-1)&^(page-1))
	fi, err := j.f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() < off+size {
		if err := j.f.Truncate(off + size); err != nil {
			return err
		}
	}
	win, err := unix.Mmap(int(j.f.Fd()), off, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("map %d bytes at %d: %w", size, off, err)
	}
	j.win, j.winOff = win, off
	return nil
}

func (j *Journal) unmapLocked() error {
	if j.win == nil {
		return nil
	}
	err := unix.Munmap(j.win)
	j.win = nil
	return err
}

// Close unmaps the file; it does not close it, and writes no more.
func (j *Journal) Close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.err == nil {
		j.err = errors.New("journal closed")
	}
	return j.unmapLocked()
}

// writeState appends a state record. It is encoded outside the lock
// (the whole tree): the backing ids and done requests recorded after the
// copies taken here come after Since, and Replay applies them again.
func (j *Journal) writeState(st *tree.State, since int64) error {
	j.mu.Lock()
	r := record{Op: "state", State: st, Since: since}
	r.Backing = maps.Clone(j.backing)
	r.Done = slices.Clone(j.done)
	j.mu.Unlock()
	line, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("journal a state record: %w", err)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.writeLocked(r.Op, append(line, '\n'))
}

// Compact writes a state record that makes every earlier record useless
// and frees their memory: save is called (tree.Tree.Checkpoint) while changes
// go on, and the state record says that from the offset before that call
// the changes are to be applied again. A crash at any point leaves a
// journal Replay reads whole.
func (j *Journal) Compact(save func() (tree.State, error)) error {
	since := j.Size()
	st, err := save()
	if err != nil {
		return fmt.Errorf("compact the journal: %w", err)
	}
	if err := j.writeState(&st, since); err != nil {
		return fmt.Errorf("compact the journal: %w", err)
	}
	// Whole pages below since hold only records the new state makes
	// useless: give their memory back.
	if hole := since &^ int64(os.Getpagesize()-1); hole > 0 {
		if err := unix.Fallocate(int(j.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, hole); err != nil {
			return fmt.Errorf("compact the journal: free %d bytes: %w", hole, err)
		}
	}
	return nil
}
