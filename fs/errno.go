package fs

import (
	"errors"
	"log/slog"
	"syscall"

	"mrfs/verbs"
)

// toErrno is the one place where errors become errnos. Errors from buffer
// and verbs carry the errno a real call would give (ENOSPC for a quota,
// ENOMEM for RLIMIT_MEMLOCK, EINVAL for a bad access set, ...); anything
// without one is a bug or an unexpected system failure, logged and EIO.
func toErrno(log *slog.Logger, op string, err error) syscall.Errno {
	if err == nil {
		return 0
	}
	e := verbs.Errno(err)
	switch {
	case e == 0:
		log.Error("unexpected error", "op", op, "err", err)
		return syscall.EIO
	case e == syscall.ENOSYS:
		// ENOSYS from an xattr call makes the kernel disable setxattr
		// for the whole mount; never let one through.
		return syscall.EOPNOTSUPP
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.ENOMEM), errors.Is(err, syscall.EPERM):
		// Limits: buffer already logged which one and how to raise it.
		log.Debug("refused", "op", op, "err", err)
	default:
		log.Debug("failed", "op", op, "err", err)
	}
	return e
}
