package tree_test

import (
	"fmt"
	"syscall"
	"testing"

	"mrfs/tree"
)

// A PD's token goes to those who may write its directory, by the class
// the kernel picks (owner, group, others; the owner's bits alone for
// the owner), and to root; anyone else gets EACCES.
func TestDirToken(t *testing.T) {
	tr := newTree(t, 0, 0)
	d, err := tr.Root().Mkdir(0, "d", tree.Owner{UID: 1000, GID: 2000}, 0o755, nil)
	if err != nil {
		t.Fatal(err)
	}
	owner := tree.Caller{Owner: tree.Owner{UID: 1000, GID: 1000}}
	inGroup := tree.Caller{Owner: tree.Owner{UID: 1001, GID: 2000}}
	supplementary := tree.Caller{Owner: tree.Owner{UID: 1002, GID: 1002}, Groups: []uint32{3000, 2000}}
	other := tree.Caller{Owner: tree.Owner{UID: 1003, GID: 1003}, Groups: []uint32{3000}}
	root := tree.Caller{Owner: tree.Owner{UID: 0, GID: 0}}
	for _, tc := range []struct {
		mode uint32
		may  []tree.Caller
	}{
		{0o755, []tree.Caller{owner, root}},
		{0o555, []tree.Caller{root}},
		{0o775, []tree.Caller{owner, inGroup, supplementary, root}},
		{0o575, []tree.Caller{inGroup, supplementary, root}}, // the owner is judged by its own bits
		{0o757, []tree.Caller{owner, other, root}},           // the group too
		{0o777, []tree.Caller{owner, inGroup, supplementary, other, root}},
		{0o000, []tree.Caller{root}},
	} {
		mode := tc.mode
		if err := d.SetMeta(tree.Change{Mode: &mode}); err != nil {
			t.Fatal(err)
		}
		for _, c := range []tree.Caller{owner, inGroup, supplementary, other, root} {
			may := false
			for _, m := range tc.may {
				may = may || fmt.Sprint(m) == fmt.Sprint(c)
			}
			tok, err := d.Token(c)
			switch {
			case may && (err != nil || tok != d.Domain().Token()):
				t.Errorf("mode %#o, caller %+v: %q, %v; want the token", mode, c, tok, err)
			case !may && (err == nil || tok != ""):
				t.Errorf("mode %#o, caller %+v: %q, %v; want EACCES", mode, c, tok, err)
			case !may:
				wantErrno(t, err, syscall.EACCES, fmt.Sprintf("mode %#o, caller %+v", mode, c))
			}
		}
	}
}
