package mount

import (
	"bytes"
	"log"
	"testing"
)

// The data of requests and replies leaves go-fuse's lines, their sizes
// and the names stay; names that look like data do not fool it, and a
// line that does not parse is cut where it stops parsing.
func TestRedactFuseLine(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`rx 7: SETXATTR n2 {sz 32 f0} "user.mrfs.token" "fedcba98"... 32b p1`, `rx 7: SETXATTR n2 {sz 32 f0} "user.mrfs.token" 32b p1`},
		{`tx 8:     OK,  32b data "1faee8c9"...`, `tx 8:     OK,  32b data`},
		{`tx 9:     OK,  1b data "2"`, `tx 9:     OK,  1b data`},
		{`tx 9:     OK,  8b data "\x00\"\\45678"`, `tx 9:     OK,  8b data`},
		{`rx 10: WRITE n3 {Fh 1 [0 +19) L 0 WRONLY}"file byt"... 19b p1`, `rx 10: WRITE n3 {Fh 1 [0 +19) L 0 WRONLY} 19b p1`},
		{`rx 11: SETXATTR n1 {sz 8 f0} "x\" \"" " 5b\x00abcd" 8b ext{groups=[5]} p1`, `rx 11: SETXATTR n1 {sz 8 f0} "x\" \"" 8b ext{groups=[5]} p1`},
		{`rx 12: GETXATTR n3 {sz 0} "user.mrfs.desc"  p12413`, `rx 12: GETXATTR n3 {sz 0} "user.mrfs.desc"  p12413`},
		{`rx 13: LOOKUP n1  "a \" 5b"  p1`, `rx 13: LOOKUP n1  "a \" 5b"  p1`},
		{`rx 14: RENAME n1 {i2 fl0} "7b" "8b" p1`, `rx 14: RENAME n1 {i2 fl0} "7b" "8b" p1`},
		{`rx 15: CREATE n1 {0100600} "f"  ext{secctx=[security.selinux:"system_u"]} p1`, `rx 15: CREATE n1 {0100600} "f"  ext{secctx=[security.selinux:"system_u"]} p1`},
		{`tx 16:     OK, "target"`, `tx 16:     OK, "target"`},
		{`rx 17: SETXATTR n1 {sz 9 f0} "user.x" "fedcba9`, "rx 17: SETXATTR n1 {sz 9 f0} \"user.x\" [unparsed]\n"},
		{`mountDirect: calling syscall.Mount("mrfs", "/mnt", "fuse.mrfs", 0x6, "fd=3")`, `mountDirect: calling syscall.Mount("mrfs", "/mnt", "fuse.mrfs", 0x6, "fd=3")`},
	} {
		if got := redactFuseLine(tc.in); got != tc.want {
			t.Errorf("redactFuseLine(%s)\n got  %s\n want %s", tc.in, got, tc.want)
		}
	}

	// Through the logger go-fuse is given: one line per record.
	var out bytes.Buffer
	l := log.New(redactedLog{&out}, "", 0)
	l.Println(`tx 8:     OK,  32b data "1faee8c9"...`)
	if out.String() != "tx 8:     OK,  32b data\n" {
		t.Errorf("through the logger: %q", out.String())
	}
}
