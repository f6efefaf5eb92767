package remote

import (
	"errors"
	"fmt"
	"syscall"

	"mrfs/verbs"
)

// StatusError is an operation that completed with a status other than
// IBV_WC_SUCCESS, on any transport.
type StatusError struct {
	Op     string // "READ", "WRITE", "COMPARE_AND_SWAP", "FETCH_AND_ADD"
	Status verbs.WCStatus
}

func (e *StatusError) Error() string { return fmt.Sprintf("%s completed with %s", e.Op, e.Status) }

// Status is the work completion status of an operation's error:
// IBV_WC_SUCCESS for nil, the status of a *StatusError, and
// IBV_WC_WR_FLUSH_ERR for a connection that broke (the QP is gone).
func Status(err error) verbs.WCStatus {
	var se *StatusError
	switch {
	case err == nil:
		return verbs.WCSuccess
	case errors.As(err, &se):
		return se.Status
	}
	return verbs.WCWRFlushErr
}

// RefusedError is mrfs's refusal of a connection, with the errno every
// transport carries to the peer: EACCES (not in allow_from), EBUSY
// (max_connections), ENOENT or ENOTDIR (no such directory), EAGAIN (still
// mounting), ESHUTDOWN (unmounting), EPROTONOSUPPORT (a version this mrfs
// does not speak). errors.Is matches the errno.
type RefusedError struct {
	Errno syscall.Errno
	Msg   string
}

func (e *RefusedError) Error() string { return fmt.Sprintf("mrfs refused: %s (%s)", e.Msg, e.Errno) }
func (e *RefusedError) Unwrap() error { return e.Errno }

// Errno is the errno err carries, or def when it carries none: what a
// refusal tells the peer.
func Errno(err error, def syscall.Errno) syscall.Errno {
	if e := verbs.Errno(err); e != 0 {
		return e
	}
	return def
}
