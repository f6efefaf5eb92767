package cli

import (
	"bytes"
	"errors"
	"log/slog"
	"log/syslog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"mrfs/internal/config"
)

// fakeSyslog points syslogDial at a unixgram socket of the test.
func fakeSyslog(t *testing.T) func() string {
	t.Helper()
	addr := filepath.Join(t.TempDir(), "log")
	c := listenNotify(t, addr)
	old := syslogDial
	syslogDial = func() (*syslog.Writer, error) {
		return syslog.Dial("unixgram", addr, syslog.LOG_DAEMON|syslog.LOG_INFO, "mrfs")
	}
	t.Cleanup(func() { syslogDial = old })
	return func() string { return recv(t, c) }
}

func logConfig(level slog.Level, output string) config.Log {
	return config.Log{Level: level, Format: config.FormatText, Output: output}
}

// Records reach syslog at the severity of their level (facility daemon),
// with their attributes and without a second timestamp.
func TestSyslogSeverity(t *testing.T) {
	next := fakeSyslog(t)
	sink, err := openLog(logConfig(slog.LevelDebug, config.OutputSyslog), nil, false)
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	log := sink.log.With("mount", "/mnt/mr")
	for _, tc := range []struct {
		log  func(string, ...any)
		pri  string // <facility*8 + severity>: daemon is 3
		text string
	}{
		{log.Error, "<27>", "level=ERROR msg=e1"},
		{log.Warn, "<28>", "level=WARN msg=w1"},
		{log.Info, "<30>", "level=INFO msg=i1"},
		{log.Debug, "<31>", "level=DEBUG msg=d1"},
	} {
		msg := strings.SplitN(tc.text, "msg=", 2)[1]
		tc.log(msg, "k", 1)
		got := next()
		if !strings.HasPrefix(got, tc.pri) || !strings.Contains(got, tc.text+" mount=/mnt/mr k=1") || strings.Contains(got, "time=") {
			t.Errorf("%s: syslog got %q; want priority %s and %q (no time=)", msg, got, tc.pri, tc.text+" mount=/mnt/mr k=1")
		}
	}
}

func TestLogOutputs(t *testing.T) {
	// A file is appended to.
	path := filepath.Join(t.TempDir(), "mrfs.log")
	if err := os.WriteFile(path, []byte("before\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sink, err := openLog(logConfig(slog.LevelInfo, path), nil, true)
	if err != nil {
		t.Fatal(err)
	}
	sink.log.Info("hello")
	sink.log.Debug("hidden")
	sink.Close()
	if b, _ := os.ReadFile(path); !strings.HasPrefix(string(b), "before\n") || !strings.Contains(string(b), "msg=hello") ||
		strings.Contains(string(b), "hidden") || sink.file == nil {
		t.Errorf("log file: %q", b)
	}
	if _, err := openLog(logConfig(slog.LevelInfo, filepath.Join(t.TempDir(), "no", "dir.log")), nil, true); err == nil {
		t.Errorf("a log file in a missing directory: no error")
	}

	// stderr in the foreground is stderr.
	var stderr bytes.Buffer
	sink, _ = openLog(logConfig(slog.LevelInfo, config.OutputStderr), &stderr, false)
	sink.log.Info("fg")
	if !strings.Contains(stderr.String(), "msg=fg") {
		t.Errorf("foreground stderr: %q", stderr.String())
	}

	// In the background, stderr means syslog.
	next := fakeSyslog(t)
	sink, _ = openLog(logConfig(slog.LevelInfo, config.OutputStderr), &stderr, true)
	sink.log.Info("bg")
	if got := next(); !strings.Contains(got, "msg=bg") {
		t.Errorf("background with log.output stderr: syslog got %q", got)
	}
	sink.Close()

	// No syslog: asked for, an error; in the background for stderr, the
	// log is discarded and a warning says so.
	syslogDial = func() (*syslog.Writer, error) { return nil, errors.New("no /dev/log") }
	if _, err := openLog(logConfig(slog.LevelInfo, config.OutputSyslog), &stderr, false); err == nil || !strings.Contains(err.Error(), "no /dev/log") {
		t.Errorf("log.output syslog without syslog: %v", err)
	}
	stderr.Reset()
	sink, err = openLog(logConfig(slog.LevelInfo, config.OutputStderr), &stderr, true)
	if err != nil || !strings.Contains(stderr.String(), "discarded") {
		t.Errorf("background without syslog: %v, stderr %q", err, stderr.String())
	}
	sink.Close()
}
