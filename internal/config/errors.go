package config

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// ErrInvalid matches every error this package returns (errors.Is), so that
// callers can tell a bad configuration from a runtime failure.
var ErrInvalid = errors.New("invalid configuration")

// Error is one problem with a configuration. Validation may return several
// joined with errors.Join; errors.As finds the first.
type Error struct {
	Path string // the file, "" when the data did not come from Load
	Line int    // 1-based line, 0 when not known
	Key  string // dotted key such as "buffers.max_pinned", "" for the whole file
	Msg  string // what is wrong and what is allowed
	Err  error  // the underlying cause, if any (e.g. a *fs.PathError)
}

func (e *Error) Error() string {
	var b strings.Builder
	if e.Path != "" {
		b.WriteString(e.Path)
		if e.Line > 0 {
			b.WriteString(":" + strconv.Itoa(e.Line))
		}
		b.WriteString(": ")
	} else if e.Line > 0 {
		b.WriteString("line " + strconv.Itoa(e.Line) + ": ")
	}
	if e.Key != "" {
		b.WriteString(e.Key + ": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }

// Is makes every *Error match ErrInvalid.
func (e *Error) Is(target error) bool { return target == ErrInvalid }

func invalid(key, format string, args ...any) *Error {
	return &Error{Key: key, Msg: fmt.Sprintf(format, args...)}
}

// withPath sets the file name on every *Error in err (which may be joined).
func withPath(err error, path string) error {
	if path == "" || err == nil {
		return err
	}
	switch e := err.(type) {
	case *Error:
		e.Path = path
	case interface{ Unwrap() []error }:
		for _, sub := range e.Unwrap() {
			withPath(sub, path)
		}
	}
	return err
}
