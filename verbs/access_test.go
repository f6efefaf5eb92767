package verbs

import (
	"errors"
	"syscall"
	"testing"
)

func TestParseAccessForgiving(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Access
	}{
		{"", 0},
		{"none", 0},
		{"local_write", LocalWrite},
		{"local_write,remote_read", LocalWrite | RemoteRead},
		{"IBV_ACCESS_LOCAL_WRITE|remote_read", LocalWrite | RemoteRead},
		{"Local_Write remote_read", LocalWrite | RemoteRead},
		{" local_write , remote_write\n", LocalWrite | RemoteWrite},
		{"remote_read,local_write", LocalWrite | RemoteRead},
		{"0x5", LocalWrite | RemoteRead},
		{"15", LocalWrite | RemoteWrite | RemoteRead | RemoteAtomic},
		{"local_write\x00", LocalWrite},
		{"mw_bind,zero_based,on_demand,relaxed_ordering", MWBind | ZeroBased | OnDemand | RelaxedOrdering},
	} {
		got, err := ParseAccess(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseAccess(%q) = %#x, %v; want %#x", tc.in, uint32(got), err, uint32(tc.want))
		}
	}
}

func TestParseAccessRejectsUnknownNames(t *testing.T) {
	for _, in := range []string{"bogus", "local_write,bogus", "remote-read", "0xZZ"} {
		if _, err := ParseAccess(in); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("ParseAccess(%q) error = %v, want EINVAL", in, err)
		}
	}
}

func TestAccessStringIsCanonical(t *testing.T) {
	for _, tc := range []struct {
		a    Access
		want string
	}{
		{0, ""},
		{LocalWrite, "local_write"},
		{RemoteRead | LocalWrite, "local_write,remote_read"},
		{RelaxedOrdering | RemoteAtomic | LocalWrite, "local_write,remote_atomic,relaxed_ordering"},
		{LocalWrite | 0x100, "local_write,0x100"},
	} {
		if got := tc.a.String(); got != tc.want {
			t.Errorf("%#x.String() = %q, want %q", uint32(tc.a), got, tc.want)
		}
		if back, err := ParseAccess(tc.a.String()); tc.a&0x100 == 0 && (err != nil || back != tc.a) {
			t.Errorf("round trip of %q = %#x, %v", tc.a.String(), uint32(back), err)
		}
	}
}

func TestAccessValidate(t *testing.T) {
	for _, tc := range []struct {
		a  Access
		ok bool
	}{
		{0, true},
		{RemoteRead, true},
		{LocalWrite | RemoteWrite, true},
		{LocalWrite | RemoteAtomic | RemoteRead, true},
		{RemoteWrite, false},
		{RemoteAtomic, false},
		{RemoteWrite | RemoteRead, false},
		{LocalWrite | 1<<10, false}, // bits 10-19 are not access flags
		{LocalWrite | 1<<30, false},
		{LocalWrite | 1<<21, true}, // optional range: unknown optional bits pass
	} {
		err := tc.a.Validate()
		if tc.ok && err != nil {
			t.Errorf("Validate(%#x) = %v, want nil", uint32(tc.a), err)
		}
		if !tc.ok && !errors.Is(err, syscall.EINVAL) {
			t.Errorf("Validate(%#x) = %v, want EINVAL", uint32(tc.a), err)
		}
	}
}

func TestWritable(t *testing.T) {
	if RemoteRead.Writable() {
		t.Error("remote_read alone pins writable")
	}
	for _, a := range []Access{LocalWrite, LocalWrite | RemoteWrite, LocalWrite | RemoteAtomic, MWBind} {
		if !a.Writable() {
			t.Errorf("%s not writable", a)
		}
	}
}

func TestErrno(t *testing.T) {
	err := errors.Join(errors.New("x"), syscall.EBUSY)
	if Errno(err) != syscall.EBUSY {
		t.Errorf("Errno = %v", Errno(err))
	}
	if Errno(errors.New("plain")) != 0 {
		t.Error("Errno of a plain error is not 0")
	}
}
