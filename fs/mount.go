package fs

import (
	"errors"
	"fmt"
	"log"
	"os"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"mrfs/fuseconn"
	"mrfs/tree"
)

// MountOptions are the kernel-facing choices of a mount.
type MountOptions struct {
	AllowOther bool
	// FsName is the mount's source in mountinfo; "" is "mrfs". mount(8)
	// compares it with fstab's source to tell what is mounted already.
	FsName string
	// RequestLog, when set, gets go-fuse's line for every request the
	// kernel sends and every reply (log.fuse_requests).
	RequestLog *log.Logger
}

// Server is a mounted mrfs.
type Server struct {
	srv    *fuse.Server
	dir    string
	kernel *kernel
	// conn is a descriptor of the connection of the daemon's own (the
	// server has its own): what a successor adopts (DESIGN, Restart);
	// init is the kernel's INIT.
	conn int
	init []byte
	// forget drops the kernel's names of unused files (forget.go).
	forget *forgetter
}

// ErrNoPassthrough means the kernel or the daemon's privileges do not
// allow FUSE passthrough, without which mmap would not be zero copy.
var ErrNoPassthrough = errors.New("FUSE passthrough unavailable")

// Mount serves opt.Tree at dir. With opt.ZeroCopy it refuses to run (and
// unmounts) when passthrough does not work, since go-fuse would otherwise
// fall back to the page cache silently.
func Mount(dir string, opt Options, mo MountOptions) (*Server, error) {
	// go-fuse mounts over a regular file too (and a mount on a missing
	// path fails with a confusing fusermount error): check first.
	if st, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("mountpoint: %w", err)
	} else if !st.IsDir() {
		return nil, fmt.Errorf("mountpoint %s is not a directory: %w", dir, syscall.ENOTDIR)
	}
	fsys, root, options := newFilesystem(opt, mo)
	s, err := serve(dir, fsName(mo), root, options, opt)
	if err != nil {
		fsys.forget.stop()
		return nil, err
	}
	return s.started(fsys, opt)
}

// newFilesystem is the front end's state, its root node and go-fuse's
// options.
func newFilesystem(opt Options, mo MountOptions) (*filesystem, *dirNode, *fusefs.Options) {
	fsys := &filesystem{Options: opt, mgr: opt.Tree.Manager(), log: opt.Log}
	root := newDirNode(fsys, opt.Tree.Root())
	fsys.forget = newForgetter(func(d *tree.Dir, name string) {
		// ENOENT: the kernel had let go of the name already.
		if errno := d.Aux().(*dirNode).NotifyEntry(name); errno != 0 && errno != syscall.ENOENT {
			fsys.log.Debug("drop a name from the kernel", "name", name, "err", errno)
		}
	})
	negative := entryTimeout
	options := &fusefs.Options{
		// Modes are shown exactly: 0000 is 0000 (key secrecy).
		NullPermissions: true,
		// Node ids are the tree's inode numbers (never reused; the
		// root's is 1): a daemon that adopts the connection can answer
		// for the node ids the kernel holds (DESIGN, Restart).
		ExternalNodeID: true,
		// A name that is not there stays absent until this mount makes it.
		NegativeTimeout: &negative,
		// Attribute timeouts of files stay 0 (each reply sets its own).
		MountOptions: fuse.MountOptions{
			FsName:      fsName(mo),
			Name:        "mrfs",
			DirectMount: true,
			AllowOther:  mo.AllowOther,
			// Key secrecy: the kernel checks modes before any xattr read.
			Options: []string{"default_permissions"},
			// Without it every write() costs a security.capability
			// GETXATTR; mrfs never stores set-id bits, so there is
			// nothing to clear.
			// O_TRUNC arrives with the OPEN rather than as a truncate
			// to 0, which a pool file refuses (its O_TRUNC zeroes it).
			ExtraCapabilities: fuse.CAP_HANDLE_KILLPRIV_V2 | fuse.CAP_ATOMIC_O_TRUNC,
			Debug:             mo.RequestLog != nil,
			Logger:            mo.RequestLog,
			MaxWrite:          maxWrite,
		},
	}
	return fsys, root, options
}

func fsName(mo MountOptions) string {
	if mo.FsName == "" {
		return "mrfs"
	}
	return mo.FsName
}

// started finishes a mount that serves: the forgetter ends with it, and
// zero copy must work.
func (s *Server) started(fsys *filesystem, opt Options) (*Server, error) {
	s.forget = fsys.forget
	go func() {
		s.srv.Wait()
		fsys.forget.stop()
	}()
	if opt.ZeroCopy {
		if err := probePassthrough(s.srv); err != nil {
			s.Unmount()
			return nil, err
		}
	}
	return s, nil
}

// serve mounts root at dir with a connection the daemon holds itself
// (fuseconn), between the kernel and go-fuse's bridge the kernel's view
// (kernel.go), and serves it.
func serve(dir, fsName string, root fusefs.InodeEmbedder, options *fusefs.Options, opt Options) (*Server, error) {
	mo := &options.MountOptions
	kopts := append([]string{fmt.Sprintf("max_read=%d", maxWrite)}, mo.Options...)
	if mo.AllowOther {
		kopts = append(kopts, "allow_other")
	}
	k := newKernel(fusefs.NewNodeFS(root, options))
	k.onBacking, k.onDone = opt.OnBacking, opt.OnDone
	fd, err := fuseconn.Mount(dir, fsName, mo.Name, kopts)
	if errors.Is(err, syscall.EPERM) {
		// Not privileged: go-fuse mounts through fusermount, and the
		// connection is its alone (no upgrade keeps it).
		srv, err := fuse.NewServer(k, dir, mo)
		if err != nil {
			return nil, fmt.Errorf("mount %s: %w", dir, err)
		}
		k.unregister = srv.UnregisterBackingFd
		go srv.Serve()
		if err := srv.WaitMount(); err != nil {
			return nil, fmt.Errorf("mount %s: %w", dir, err)
		}
		return &Server{srv: srv, dir: dir, kernel: k, conn: -1}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", dir, err)
	}
	s := &Server{dir: dir, kernel: k, conn: -1}
	fail := func(err error) (*Server, error) {
		s.closeConn()
		unix.Unmount(dir, unix.MNT_DETACH)
		return nil, fmt.Errorf("mount %s: %w", dir, err)
	}
	if s.conn, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err != nil {
		unix.Close(fd)
		return fail(fmt.Errorf("keep the connection: %w", err))
	}
	if s.srv, s.init, err = fuseconn.Serve(fd, nil, k, mo); err != nil {
		return fail(err)
	}
	k.unregister = s.srv.UnregisterBackingFd
	if opt.OnServe != nil {
		opt.OnServe(s.conn, s.init)
	}
	go s.srv.Serve()
	if err := s.srv.WaitMount(); err != nil {
		return fail(err)
	}
	return s, nil
}

// maxWrite is the largest write the kernel sends (and read it asks for):
// go-fuse's default, told to both.
const maxWrite = 128 << 10

// probePassthrough registers and unregisters a backing file, the step
// that fails without CAP_SYS_ADMIN or on kernels before 6.9.
func probePassthrough(srv *fuse.Server) error {
	if srv.KernelSettings().Flags64()&fuse.CAP_PASSTHROUGH == 0 {
		return fmt.Errorf("%w: the kernel does not offer it (Linux >= 6.9 needed)", ErrNoPassthrough)
	}
	fd, err := unix.MemfdCreate("mrfs-probe", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("probe passthrough: memfd_create: %w", err)
	}
	defer unix.Close(fd)
	id, errno := srv.RegisterBackingFd(&fuse.BackingMap{Fd: int32(fd)})
	if errno != 0 {
		return fmt.Errorf("%w: registering a backing file failed: %w (the daemon needs CAP_SYS_ADMIN)", ErrNoPassthrough, errno)
	}
	srv.UnregisterBackingFd(id)
	return nil
}

// Wait returns when the filesystem is unmounted (also from outside, by
// `mrfs umount` or umount(8)).
func (s *Server) Wait() { s.srv.Wait() }

// Unmount unmounts. When a client still has a file open or mapped the
// kernel refuses (EBUSY); the mount is then detached, so it disappears at
// once and the client keeps its pages until it lets go.
func (s *Server) Unmount() error {
	if s.conn < 0 { // mounted by fusermount
		if err := s.srv.Unmount(); err == nil {
			return nil
		}
	} else {
		defer s.closeConn()
		if err := unix.Unmount(s.dir, 0); err == nil {
			return nil
		}
	}
	if err := unix.Unmount(s.dir, unix.MNT_DETACH); err != nil && err != syscall.EINVAL {
		return fmt.Errorf("unmount %s: %w", s.dir, err)
	}
	return nil
}

// closeConn lets go of the daemon's own descriptor of the connection.
func (s *Server) closeConn() {
	if s.conn >= 0 {
		unix.Close(s.conn)
		s.conn = -1
	}
}
