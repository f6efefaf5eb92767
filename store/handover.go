package store

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Lasting is a store whose files can outlive the process that made them
// (DESIGN, Restart): the tmpfs instance lives as long as a descriptor of
// its root does, with every file in it.
type Lasting interface {
	Store
	// Handover is a new descriptor (close-on-exec) of the store's root,
	// which keeps the instance and its files after Close; the caller
	// owns it and hands it to the process that adopts the store
	// (AdoptTmpfs).
	Handover() (int, error)
	// Open is buffer id's file, made by an earlier process of the store.
	Open(id uint64) (File, error)
}

var _ Lasting = (*tmpfs)(nil)

func (s *tmpfs) Handover() (int, error) {
	fd, err := unix.FcntlInt(uintptr(s.root), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("hand the tmpfs store over: %w", err)
	}
	return fd, nil
}

func (s *tmpfs) Open(id uint64) (File, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(s.root, fileName(id), &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, fmt.Errorf("open %s of the tmpfs store: %w", fileName(id), err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("open %s of the tmpfs store: not a regular file: %w", fileName(id), syscall.EINVAL)
	}
	return &tmpfsFile{s: s, id: id}, nil
}

// AdoptTmpfs takes the tmpfs store whose root is root, a descriptor an
// earlier process's Handover gave, made with opt. What that process had
// reserved (Reserve, for pools, which no restart takes back: their
// memory died with it, or is a client's mapping's, outside the store and
// pinned by no one) is given back: the instance's size is opt's again,
// or what its files hold if they hold more. The store owns root.
func AdoptTmpfs(root int, opt TmpfsOptions) (Lasting, error) {
	var st unix.Statfs_t
	if err := unix.Fstatfs(root, &st); err != nil {
		return nil, fmt.Errorf("adopt the tmpfs store: %w", err)
	}
	if st.Type != unix.TMPFS_MAGIC {
		return nil, fmt.Errorf("adopt the tmpfs store: descriptor %d is not a tmpfs (magic 0x%x): %w", root, st.Type, syscall.EINVAL)
	}
	s := &tmpfs{root: root, opt: opt}
	if size := st.Blocks * uint64(st.Bsize); opt.Size > 0 {
		if size > opt.Size {
			return nil, fmt.Errorf("adopt the tmpfs store: it is %d bytes, more than its size %d: %w", size, opt.Size, syscall.EINVAL)
		}
		if size < opt.Size && s.resize(opt.Size) != nil {
			s.res.n = opt.Size - size // refusals come early; nothing leaks
		}
	}
	return s, nil
}

// FileID is the buffer id f was made for, by which a later process of a
// Lasting store opens it again; ok is false for a file no later process
// can reach (a memfd).
func FileID(f File) (id uint64, ok bool) {
	if t, ok := f.(*tmpfsFile); ok {
		return t.id, true
	}
	return 0, false
}

// Sweep removes the files of the tmpfs store whose root is root that
// keep does not want: those of buffers a process that died had made and
// not yet named, or removed and not yet freed (a client's mapping keeps
// such pages until it goes). It returns how many it removed and their
// bytes.
func Sweep(root int, keep func(id uint64) bool) (n int, bytes int64, err error) {
	dfd, err := unix.Openat(root, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("sweep the tmpfs store: %w", err)
	}
	dir := os.NewFile(uintptr(dfd), "store")
	defer dir.Close()
	names, err := dir.Readdirnames(-1)
	if err != nil {
		return 0, 0, fmt.Errorf("sweep the tmpfs store: %w", err)
	}
	for _, name := range names {
		id, perr := strconv.ParseUint(strings.TrimPrefix(name, "b"), 10, 64)
		if perr != nil || fileName(id) != name || keep(id) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(root, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return n, bytes, fmt.Errorf("sweep the tmpfs store: %s: %w", name, err)
		}
		if err := unix.Unlinkat(root, name, 0); err != nil {
			return n, bytes, fmt.Errorf("sweep the tmpfs store: remove %s: %w", name, err)
		}
		n, bytes = n+1, bytes+st.Blocks*512
	}
	return n, bytes, nil
}
