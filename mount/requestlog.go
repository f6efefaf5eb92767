package mount

import (
	"io"
	stdlog "log"
	"log/slog"
	"strconv"
	"strings"

	"mrfs/internal/config"
)

// redactedLog passes go-fuse's request log (log.fuse_requests) on with
// the data taken out of every line (redactFuseLine): go-fuse shows the
// first bytes of each request's and reply's data, which for xattrs are
// values such as a PD's token, and for reads and writes a file's bytes.
type redactedLog struct{ next io.Writer }

func (w redactedLog) Write(p []byte) (int, error) {
	if _, err := io.WriteString(w.next, redactFuseLine(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// redactFuseLine removes the data from a line of go-fuse's request log
// and keeps the rest, sizes included. go-fuse (fuse/request.go) prints a
// request's data as a Go-quoted string of up to 8 bytes, "..." when
// there are more, and the size (`rx 7: SETXATTR n1 {...} "user.x"
// "local_wr"... 24b p42`), and a reply's after its size (`tx 7: OK, 33b
// data "805656b9"...`). Names (of files, of xattrs) are quoted too and
// stay. Quoted strings are parsed from the left, so a quote inside one
// never starts another; a line that does not parse is cut at the quote
// where parsing failed.
func redactFuseLine(line string) string {
	var b strings.Builder
	for {
		i := strings.IndexByte(line, '"')
		if i < 0 {
			b.WriteString(line)
			return b.String()
		}
		q, err := strconv.QuotedPrefix(line[i:])
		if err != nil {
			b.WriteString(line[:i])
			b.WriteString("[unparsed]\n")
			return b.String()
		}
		before, rest := line[:i], strings.TrimPrefix(line[i+len(q):], "...")
		if !strings.HasSuffix(before, "b data ") && !sizeFollows(rest) {
			b.WriteString(line[:i+len(q)]) // a name
			line = line[i+len(q):]
			continue
		}
		if strings.HasPrefix(rest, " ") || strings.TrimSpace(rest) == "" {
			before = strings.TrimSuffix(before, " ")
		}
		b.WriteString(before)
		line = rest
	}
}

// sizeFollows says whether s starts with the size go-fuse prints after a
// request's data: " 24b", then a space or the end of the line.
func sizeFollows(s string) bool {
	s, ok := strings.CutPrefix(s, " ")
	n := 0
	for n < len(s) && s[n] >= '0' && s[n] <= '9' {
		n++
	}
	if !ok || n == 0 || !strings.HasPrefix(s[n:], "b") {
		return false
	}
	s = s[n+1:]
	return s == "" || s[0] == ' ' || s[0] == '\n'
}

// requestLog is where go-fuse logs each request and reply when
// log.fuse_requests is set: the daemon's log, at debug level, one record
// per line go-fuse prints, without the data (redactedLog); nil when it
// is not set.
func requestLog(cfg config.Log, log *slog.Logger) *stdlog.Logger {
	if !cfg.FuseRequests {
		return nil
	}
	records := slog.NewLogLogger(log.With("fuse", true).Handler(), slog.LevelDebug)
	return stdlog.New(redactedLog{records.Writer()}, "", 0)
}
