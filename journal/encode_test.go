package journal

import (
	"bytes"
	"encoding/json"
	"math/rand"
	"reflect"
	"testing"
	"testing/quick"
	"time"

	"mrfs/buffer"
	"mrfs/tree"
)

// TestAppendChangeIsJSON: a change record is written as json.Marshal
// writes it, for every field of record (a field added later is filled
// too, and fails here until appendChange writes it), each zero or not,
// with names json.Marshal escapes.
func TestAppendChangeIsJSON(t *testing.T) {
	names := []string{"", "f0", "a b", `q"uote`, `back\slash`, "<b>&", "tab\tnl\n\x01\x1f", "del\x7f",
		"é ü", "\u2028\u2029", "bad\xffutf8", "日本"}
	rng := rand.New(rand.NewSource(1))
	stateOnly := map[string]bool{"State": true, "Since": true, "Backing": true, "Done": true}
	typ := reflect.TypeFor[record]()
	var buf []byte
	for i := range 5000 {
		var r record
		v := reflect.ValueOf(&r).Elem()
		for f := range typ.NumField() {
			if stateOnly[typ.Field(f).Name] || rng.Intn(3) == 0 {
				continue
			}
			x, ok := quick.Value(typ.Field(f).Type, rng)
			if !ok {
				t.Fatalf("no random %s", typ.Field(f).Type)
			}
			v.Field(f).Set(x)
		}
		// Names, tokens and Lost of every kind, some empty.
		if rng.Intn(2) == 0 {
			r.Name = names[rng.Intn(len(names))]
		}
		if r.Node != nil {
			r.Node.Name = names[rng.Intn(len(names))]
			r.Node.Lost = names[rng.Intn(len(names))]
			if r.Node.Dir != nil {
				r.Node.Dir.Token = names[rng.Intn(len(names))]
			}
		}
		for _, k := range []*buffer.Kept{r.Kept, nodeFile(r.Node)} {
			if k != nil && k.Source != nil {
				k.Source.Path = names[rng.Intn(len(names))]
			}
		}
		want, err := json.Marshal(&r)
		if err != nil {
			t.Fatal(err)
		}
		buf = appendChange(buf[:0], &r)
		if !bytes.Equal(buf, want) {
			t.Fatalf("record %d:\n got %s\nwant %s", i, buf, want)
		}
	}
}

func nodeFile(n *tree.NodeState) *buffer.Kept {
	if n == nil {
		return nil
	}
	return n.File
}

// BenchmarkAppendChange: what encoding a create's "made" record costs,
// against json.Marshal.
func BenchmarkAppendChange(b *testing.B) {
	now := time.Now().UnixNano()
	rec := record{Op: "made", Node: &tree.NodeState{Ino: 25001, Parent: 1, Name: "f49", Mode: 0o600,
		Atime: now, Mtime: now, Ctime: now, File: &buffer.Kept{File: 25000, Access: 1}}}
	b.Run("append", func(b *testing.B) {
		var buf []byte
		for b.Loop() {
			buf = appendChange(buf[:0], &rec)
		}
	})
	b.Run("json", func(b *testing.B) {
		for b.Loop() {
			json.Marshal(&rec)
		}
	})
}
