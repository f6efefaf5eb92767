// Package fuseconn keeps a FUSE connection across the death of the
// process that serves it (DESIGN, Restart): the connection lives as long
// as one descriptor of /dev/fuse does, and the kernel sends its INIT only
// once. So the descriptor is made here, by mount(2) with a descriptor the
// caller owns (a keeper, systemd's fd store, or the process itself before
// it executes its successor); the first server keeps the bytes of the
// kernel's INIT; a later one adopts the connection by replaying them to
// go-fuse, whose reply goes nowhere, and asks the kernel to send again
// what the dead server read and never answered.
package fuseconn

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Mount mounts a FUSE filesystem of type fuse.<subtype> at dir and
// returns its /dev/fuse descriptor (blocking, close-on-exec), which the
// caller owns: the connection ends when its last copy is closed.
// options are the kernel's own FUSE mount options (allow_other,
// default_permissions, ...), without fd, rootmode, user_id and group_id.
func Mount(dir, source, subtype string, options []string) (int, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open /dev/fuse: %w", err)
	}
	data := append([]string{fmt.Sprintf("fd=%d", fd), "rootmode=40000",
		fmt.Sprintf("user_id=%d", os.Geteuid()), fmt.Sprintf("group_id=%d", os.Getegid())}, options...)
	if err := unix.Mount(source, dir, "fuse."+subtype, unix.MS_NOSUID|unix.MS_NODEV, strings.Join(data, ",")); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("mount fuse.%s at %s: %w", subtype, dir, err)
	}
	return fd, nil
}

// Serve makes a go-fuse server of fs on fd, which it takes (as
// fuse.NewServer takes a /dev/fd/N mount point's). With init nil the
// connection is new: the kernel's INIT is read from fd, and its bytes
// are returned for a later server. With init, an earlier server of this
// connection answered the kernel's INIT with the same opts: go-fuse
// reads init from one end of a socket pair and answers into it, and fd
// then takes that end's place, so the kernel sees no second answer.
// The caller then calls the server's Serve.
func Serve(fd int, init []byte, fs fuse.RawFileSystem, opts *fuse.MountOptions) (*fuse.Server, []byte, error) {
	// go-fuse takes its connection from the /dev/fd/N name only when it
	// is not told to mount itself; told to, it would mount over
	// /dev/fuse, which that name leads to.
	o := *opts
	o.DirectMount, o.DirectMountStrict = false, false
	opts = &o
	if init == nil {
		srv, err := fuse.NewServer(fs, fmt.Sprintf("/dev/fd/%d", fd), opts)
		if err != nil {
			return nil, nil, fmt.Errorf("serve /dev/fuse: %w", err)
		}
		return srv, initBytes(srv.KernelSettings()), nil
	}
	// fd goes either way: on success its copy in the server's place is
	// the one that counts.
	defer unix.Close(fd)
	if len(init) < int(unsafe.Sizeof(fuse.InHeader{})) {
		return nil, nil, fmt.Errorf("adopt a FUSE connection: the saved INIT is %d bytes: %w", len(init), unix.EINVAL)
	}
	// Blocking, as /dev/fuse is: go-fuse reads both the same way.
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("adopt a FUSE connection: socketpair: %w", err)
	}
	defer unix.Close(pair[1])
	if _, err := unix.Write(pair[1], init); err != nil {
		unix.Close(pair[0])
		return nil, nil, fmt.Errorf("adopt a FUSE connection: replay the INIT: %w", err)
	}
	srv, err := fuse.NewServer(fs, fmt.Sprintf("/dev/fd/%d", pair[0]), opts)
	if err != nil {
		return nil, nil, fmt.Errorf("adopt a FUSE connection: %w", err)
	}
	// The server's descriptor number now names the connection; no
	// request has been read from it yet (Serve has not started).
	if err := unix.Dup3(fd, pair[0], unix.O_CLOEXEC); err != nil {
		return nil, nil, fmt.Errorf("adopt a FUSE connection: dup3: %w", err)
	}
	return srv, init, nil
}

// initBytes is the INIT request as the kernel sent it (header and body).
func initBytes(in *fuse.InitIn) []byte {
	b := unsafe.Slice((*byte)(unsafe.Pointer(in)), unsafe.Sizeof(*in))
	return append([]byte(nil), b[:min(int(in.Length), len(b))]...)
}

// ErrNoResend means the kernel cannot send unanswered requests again
// (FUSE_NOTIFY_RESEND needs Linux 6.9).
var ErrNoResend = errors.New("FUSE_NOTIFY_RESEND unsupported (Linux >= 6.9 needed)")

// notifyResend is fuse_notify_code's FUSE_NOTIFY_RESEND.
const notifyResend = 7

// Resend asks the kernel to queue again every request of the connection
// that a server read and never answered (a dead one's); they come back
// with bit 63 of their unique set, first in the queue. Call it only when
// no other process serves fd.
func Resend(fd int) error {
	h := fuse.OutHeader{Length: uint32(unsafe.Sizeof(fuse.OutHeader{})), Status: notifyResend}
	_, err := unix.Write(fd, unsafe.Slice((*byte)(unsafe.Pointer(&h)), unsafe.Sizeof(h)))
	if errors.Is(err, unix.EINVAL) {
		return ErrNoResend
	}
	if err != nil {
		return fmt.Errorf("FUSE_NOTIFY_RESEND: %w", err)
	}
	return nil
}

// notifyInvalInode is fuse_notify_code's FUSE_NOTIFY_INVAL_INODE.
const notifyInvalInode = 2

// Held says whether the kernel holds node id nodeid of the connection fd
// (it looked it up and has not forgotten it): the kernel answers an
// invalidation of its attributes with ENOENT when it does not. A server
// that adopts a connection whose last server died uses it to learn which
// nodes it must answer for. The node's cached attributes are dropped.
func Held(fd int, nodeid uint64) (bool, error) {
	var msg struct {
		h fuse.OutHeader
		n fuse.NotifyInvalInodeOut
	}
	msg.h = fuse.OutHeader{Length: uint32(unsafe.Sizeof(msg)), Status: notifyInvalInode}
	msg.n = fuse.NotifyInvalInodeOut{Ino: nodeid, Off: -1}
	_, err := unix.Write(fd, unsafe.Slice((*byte)(unsafe.Pointer(&msg)), unsafe.Sizeof(msg)))
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.ENOENT):
		return false, nil
	}
	return false, fmt.Errorf("FUSE_NOTIFY_INVAL_INODE of node %d: %w", nodeid, err)
}

// The environment that hands a connection to the program a server
// executes in its place (Exec, Inherited): the descriptor numbers of the
// connection and of a memfd holding its INIT.
const (
	envFd   = "MRFS_FUSE_FD"
	envInit = "MRFS_FUSE_INIT_FD"
)

// InitFile is a memfd holding init (close on exec), as a later server
// of the connection takes its INIT (Env).
func InitFile(init []byte) (int, error) {
	mfd, err := unix.MemfdCreate("mrfs-fuse-init", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	if _, err := unix.Pwrite(mfd, init, 0); err != nil {
		unix.Close(mfd)
		return -1, fmt.Errorf("write the INIT: %w", err)
	}
	return mfd, nil
}

// Env is the environment that hands a program the connection fd and the
// memfd of its INIT initFd (InitFile), at those numbers in it: Inherited
// takes them.
func Env(fd, initFd int) []string {
	return []string{fmt.Sprintf("%s=%d", envFd, fd), fmt.Sprintf("%s=%d", envInit, initFd)}
}

// Exec replaces the calling process by path (a new binary: an upgrade)
// with the connection fd kept open: the process keeps its pid, and the
// connection never has fewer than one descriptor. init is the INIT that
// Serve returned. Requests this process read and did not answer are lost
// with it; the new program asks for them again (Resend). Exec returns
// only on failure, with the descriptors as they were.
func Exec(fd int, init []byte, path string, argv, env []string) error {
	mfd, err := InitFile(init)
	if err != nil {
		return fmt.Errorf("hand the FUSE connection over: %w", err)
	}
	defer unix.Close(mfd)
	if _, err := unix.FcntlInt(uintptr(mfd), unix.F_SETFD, 0); err != nil {
		return fmt.Errorf("hand the FUSE connection over: keep its INIT open: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, 0); err != nil {
		return fmt.Errorf("hand the FUSE connection over: keep fd %d open: %w", fd, err)
	}
	env = append(env, Env(fd, mfd)...)
	err = unix.Exec(path, argv, env)
	unix.CloseOnExec(fd)
	return fmt.Errorf("hand the FUSE connection over: exec %s: %w", path, err)
}

// Inherited returns the connection an earlier program of this process
// handed over with Exec, and its INIT; ok is false when there is none.
// It takes both from the environment, which it clears of them.
func Inherited() (fd int, init []byte, ok bool, err error) {
	fs, is := os.Getenv(envFd), os.Getenv(envInit)
	if fs == "" {
		return -1, nil, false, nil
	}
	os.Unsetenv(envFd)
	os.Unsetenv(envInit)
	fd, err1 := strconv.Atoi(fs)
	mfd, err2 := strconv.Atoi(is)
	if err := errors.Join(err1, err2); err != nil {
		return -1, nil, false, fmt.Errorf("the FUSE connection handed over: %s=%q %s=%q: %w", envFd, fs, envInit, is, err)
	}
	defer unix.Close(mfd)
	unix.CloseOnExec(fd)
	var st unix.Stat_t
	if err := unix.Fstat(mfd, &st); err != nil {
		return -1, nil, false, fmt.Errorf("the FUSE connection handed over: its INIT: %w", err)
	}
	init = make([]byte, st.Size)
	if _, err := unix.Pread(mfd, init, 0); err != nil {
		return -1, nil, false, fmt.Errorf("the FUSE connection handed over: read its INIT: %w", err)
	}
	return fd, init, true, nil
}
