package fs

import (
	"errors"
	"fmt"
	"log/slog"
	"syscall"
	"testing"
)

func TestToErrno(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		err  error
		want syscall.Errno
	}{
		{nil, 0},
		{fmt.Errorf("register 4 MiB in pd 1: %w", syscall.ENOMEM), syscall.ENOMEM},
		{fmt.Errorf("create: %w", fmt.Errorf("max_buffers: %w", syscall.ENOSPC)), syscall.ENOSPC},
		{fmt.Errorf("access: %w", syscall.EINVAL), syscall.EINVAL},
		{errors.New("no errno"), syscall.EIO},
		// ENOSYS would disable setxattr for the whole mount.
		{fmt.Errorf("x: %w", syscall.ENOSYS), syscall.EOPNOTSUPP},
	} {
		if got := toErrno(log, "test", tc.err); got != tc.want {
			t.Errorf("toErrno(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

func TestGetxattrSizes(t *testing.T) {
	v := []byte("local_write")
	if n, errno := getxattr(nil, v); n != uint32(len(v)) || errno != 0 {
		t.Errorf("size probe = %d, %v", n, errno)
	}
	if n, errno := getxattr(make([]byte, 3), v); n != uint32(len(v)) || errno != syscall.ERANGE {
		t.Errorf("short buffer = %d, %v; want %d, ERANGE", n, errno, len(v))
	}
	dest := make([]byte, 64)
	if n, errno := getxattr(dest, v); errno != 0 || string(dest[:n]) != "local_write" {
		t.Errorf("read = %q, %v", dest[:n], errno)
	}
	if n, _ := listxattr(dest, []string{"a", "bc"}); string(dest[:n]) != "a\x00bc\x00" {
		t.Errorf("listxattr = %q", dest[:n])
	}
}

func TestSetxattrErrnos(t *testing.T) {
	if e := setxattrCheck("user.mrfs.rkey"); e != syscall.EPERM {
		t.Errorf("read-only mrfs name: %v, want EPERM", e)
	}
	if e := setxattrCheck("user.other"); e != syscall.EOPNOTSUPP {
		t.Errorf("foreign name: %v, want EOPNOTSUPP", e)
	}
}
