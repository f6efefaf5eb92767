package cli

import (
	"errors"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"mrfs/internal/config"
)

// Each short name and dotted key lands on its config key; the options
// mount(8) and mount.fuse3 add change nothing; later options win.
func TestApplyMountOptions(t *testing.T) {
	cfg := config.Default()
	fsname, err := applyMountOptions(&cfg, "rw,nosuid,nodev,dev,suid,defaults,_netdev,nofail,noauto,x-systemd.automount,x-systemd.requires=a.target,comment=x,"+
		"noatime,relatime,strictatime,atime,norelatime,nostrictatime,nodiratime,diratime,lazytime,nolazytime,"+
		"backend=rdma,backend=soft,device=soft0,allow_other,zero_copy=false,umask=022,buffers.max_pinned=1GiB,log.level=debug,"+
		"buffers.default_access=local_write|remote_read,fsname=/etc/mrfs/a.toml")
	if err != nil {
		t.Fatal(err)
	}
	want := config.Default()
	want.Verbs.Backend, want.Verbs.Device = "soft", "soft0"
	want.Mount.AllowOther, want.Mount.ZeroCopy, want.Mount.Umask = true, false, 0o22
	want.Buffers.MaxPinned = config.Budget{Bytes: 1 << 30}
	if err := want.Set("log.level", "debug"); err != nil {
		t.Fatal(err)
	}
	if err := want.Set("buffers.default_access", "local_write,remote_read"); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(cfg, want) {
		t.Errorf("after the options:\n got  %+v\n want %+v", cfg, want)
	}
	if fsname != "/etc/mrfs/a.toml" {
		t.Errorf("fsname = %q", fsname)
	}
	cfg = config.Default()
	if _, err := applyMountOptions(&cfg, "allow_other=false,zero_copy"); err != nil || cfg.Mount.AllowOther || !cfg.Mount.ZeroCopy {
		t.Errorf("allow_other=false,zero_copy: %v, %+v", err, cfg.Mount)
	}
}

// A bad option is an error that names it, with exit status 2, and the
// configuration is left to the caller to discard.
func TestMountOptionErrors(t *testing.T) {
	for _, tc := range []struct{ opts, bad, msg string }{
		{"backend=soft,frobnicate", "frobnicate", "unknown"},
		{"noatim", "noatim", "unknown"},
		{"noatime=1", "noatime=1", "unknown"},
		{"ro", "ro", "read-only"},
		{"rw,noexec", "noexec", "noexec"},
		{"backend", "backend", "needs a value"},
		{"allow_other=yes", "allow_other=yes", "true or false"},
		{"backend=gpu", "", ""}, // the value is checked by Validate
		{"buffers.max_bufers=1", "buffers.max_bufers=1", "unknown key"},
		{"umask=88", "umask=88", "octal"},
		{"rw=1", "rw=1", "unknown"},
	} {
		cfg := config.Default()
		_, err := applyMountOptions(&cfg, tc.opts)
		if tc.bad == "" {
			if err != nil || cfg.Validate() == nil {
				t.Errorf("%q: %v, then Validate passes; want Validate to refuse it", tc.opts, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), `"`+tc.bad+`"`) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%q: %v; want an error naming %q and saying %q", tc.opts, err, tc.bad, tc.msg)
		}
		if exitCode(err) != exitUsage {
			t.Errorf("%q: exit status %d, want 2", tc.opts, exitCode(err))
		}
	}
}

func TestIsHelperCall(t *testing.T) {
	for args, want := range map[string]bool{
		"none /mnt/mr -o rw,dev,suid":      true,
		"/etc/mrfs.toml /mnt/mr -o rw":     true,
		"/mnt/mr -o rw":                    true, // mount.fuse3 drops an empty source
		"none /mnt/mr -orw":                true,
		"moutn /mnt/mr":                    false, // a typo, not mount.fuse3
		"/mnt/mr":                          false,
		"/etc/mrfs.toml /mnt/mr --backend": false,
	} {
		if got := isHelperCall(strings.Fields(args)); got != want {
			t.Errorf("isHelperCall(%q) = %v, want %v", args, got, want)
		}
	}
}

// The helper convention reaches mount with the source as the config and
// the options applied: errors show it (nothing is mounted in this test).
func TestHelperCallErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"none", dir, "-o", "rw,backend=soft,frob"}, exitUsage, `"frob"`},
		{[]string{"mrfs", dir, "-o", "rw,backend=gpu"}, exitUsage, "gpu"},
		{[]string{filepath.Join(dir, "absent.toml"), dir, "-o", "rw"}, exitUsage, "absent.toml"},
		{[]string{"none", "/dev/fd/5", "-o", "rw"}, exitUsage, "drop_privileges"},
		{[]string{"a", "b", "c", "-o", "rw"}, exitUsage, "want [SOURCE] MOUNTPOINT"},
		{[]string{"none", dir, "-o", "rw", "-f"}, exitUsage, `unexpected "-f"`},
	} {
		code, _, stderr := runCLI(tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.msg) {
			t.Errorf("mrfs %q: exit %d, stderr %q; want %d mentioning %s", tc.args, code, stderr, tc.code, tc.msg)
		}
	}
	var oe *mountOptionError
	if !errors.As(error(&mountOptionError{"x", "y"}), &oe) {
		t.Fatal("mountOptionError is not found by errors.As")
	}
}
