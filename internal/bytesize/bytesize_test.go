package bytesize

import "testing"

func TestFormat(t *testing.T) {
	for _, c := range []struct {
		in   uint64
		want string
	}{
		{0, "0 B"},
		{100, "100 B"},
		{1023, "1023 B"},
		{1024, "1 KiB"},
		{4096, "4 KiB"},
		{1536, "1.5 KiB"},
		{100000, "97.7 KiB"},
		{3 << 19, "1.5 MiB"},
		{64 << 20, "64 MiB"},
		{1000 << 20, "1000 MiB"},
		{1 << 30, "1 GiB"},
		{12289, "12289 B"},       // 12.0 KiB would hide the extra byte
		{1<<20 - 1, "1048575 B"}, // so would 1.0 MiB
		{1 << 63, "8 EiB"},
		{1<<64 - 1, "18446744073709551615 B"},
	} {
		if got := Format(c.in); got != c.want {
			t.Errorf("Format(%d) = %q, want %q", c.in, got, c.want)
		}
	}
}
