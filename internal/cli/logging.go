package cli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"log/syslog"
	"os"
	"strings"
	"sync"

	"mrfs/internal/config"
)

// syslogDial connects to the system logger (/dev/log); tests replace it.
var syslogDial = func() (*syslog.Writer, error) {
	return syslog.New(syslog.LOG_DAEMON|syslog.LOG_INFO, "mrfs")
}

// logSink is where a daemon's log goes, per log.output.
type logSink struct {
	log *slog.Logger
	// file is the log file when log.output names one: a daemon in the
	// background sends its stdout and stderr there too, so that what the
	// Go runtime prints (a panic) lands next to the log.
	file   *os.File
	closer io.Closer // the file or the syslog connection; nil for stderr
}

func (s *logSink) Close() error {
	if s.closer == nil {
		return nil
	}
	return s.closer.Close()
}

// openLog opens log.output. In the background there is no stderr, so
// "stderr" means syslog there; when syslog cannot be reached either, the
// log is discarded and a warning says so on stderr (which the starting
// process still shares).
func openLog(cfg config.Log, stderr io.Writer, background bool) (*logSink, error) {
	switch out := cfg.Output; {
	case out == config.OutputStderr && !background:
		return &logSink{log: newLogger(cfg, stderr)}, nil
	case out == config.OutputStderr || out == config.OutputSyslog:
		w, err := syslogDial()
		if err != nil && out == config.OutputSyslog {
			return nil, fmt.Errorf("log.output = syslog: cannot reach the system logger: %w", err)
		}
		if err != nil {
			fmt.Fprintf(stderr, "mrfs: warning: the daemon's log is discarded: log.output is stderr, which a daemon in the background lacks, and syslog cannot be reached (%v); set log.output to a file\n", err)
			return &logSink{log: slog.New(slog.DiscardHandler)}, nil
		}
		return &logSink{log: slog.New(newSyslogHandler(w, cfg)), closer: w}, nil
	default:
		f, err := os.OpenFile(out, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
		if err != nil {
			return nil, fmt.Errorf("log.output: %w", err)
		}
		return &logSink{log: newLogger(cfg, f), file: f, closer: f}, nil
	}
}

func newLogger(cfg config.Log, w io.Writer) *slog.Logger {
	return slog.New(newHandler(cfg, w, nil))
}

func newHandler(cfg config.Log, w io.Writer, replace func([]string, slog.Attr) slog.Attr) slog.Handler {
	opts := &slog.HandlerOptions{Level: cfg.Level, ReplaceAttr: replace}
	if cfg.Format == config.FormatJSON {
		return slog.NewJSONHandler(w, opts)
	}
	return slog.NewTextHandler(w, opts)
}

// syslogHandler formats a record as log.format says and sends it to
// syslog at the severity of its level, so that the journal and syslog
// filters see errors as errors.
type syslogHandler struct {
	w     *syslog.Writer
	inner slog.Handler // writes into *buf
	// mu guards buf; both are shared by the handlers WithAttrs and
	// WithGroup derive, whose inner handlers write into the same buf.
	mu  *sync.Mutex
	buf *bytes.Buffer
}

var _ slog.Handler = (*syslogHandler)(nil)

func newSyslogHandler(w *syslog.Writer, cfg config.Log) *syslogHandler {
	buf := new(bytes.Buffer)
	// syslog stamps the time itself.
	noTime := func(groups []string, a slog.Attr) slog.Attr {
		if len(groups) == 0 && a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	return &syslogHandler{w: w, inner: newHandler(cfg, buf, noTime), mu: new(sync.Mutex), buf: buf}
}

func (h *syslogHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

func (h *syslogHandler) Handle(ctx context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.buf.Reset()
	if err := h.inner.Handle(ctx, r); err != nil {
		return err
	}
	msg := strings.TrimSuffix(h.buf.String(), "\n")
	switch {
	case r.Level >= slog.LevelError:
		return h.w.Err(msg)
	case r.Level >= slog.LevelWarn:
		return h.w.Warning(msg)
	case r.Level >= slog.LevelInfo:
		return h.w.Info(msg)
	}
	return h.w.Debug(msg)
}

func (h *syslogHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := *h
	c.inner = h.inner.WithAttrs(attrs)
	return &c
}

func (h *syslogHandler) WithGroup(name string) slog.Handler {
	c := *h
	c.inner = h.inner.WithGroup(name)
	return &c
}
