package journal

import (
	"encoding/json"
	"strconv"
	"strings"

	"mrfs/buffer"
	"mrfs/tree"
)

// appendChange appends r, a change record (no state), as json.Marshal
// writes it, without reflection or allocation: change records are written
// on the request's path, under the locks that order them, several times
// a create (BENCHMARKS: json.Marshal cost the mount's create cycle 15%).
// A state record (the whole tree, from compaction's goroutine) goes
// through json.Marshal. TestAppendChangeIsJSON holds the two equal.
func appendChange(b []byte, r *record) []byte {
	b = append(b, `{"op":`...)
	b = appendString(b, r.Op)
	if r.Node != nil {
		b = append(b, `,"node":`...)
		b = appendNode(b, r.Node)
	}
	b = appendUint(b, `,"ino":`, r.Ino, true)
	b = appendUint(b, `,"parent":`, r.Parent, true)
	if r.Name != "" {
		b = append(b, `,"name":`...)
		b = appendString(b, r.Name)
	}
	if m := r.Meta; m != nil {
		b = appendUint(b, `,"meta":{"mode":`, uint64(m.Mode), false)
		b = appendUint(b, `,"uid":`, uint64(m.UID), false)
		b = appendUint(b, `,"gid":`, uint64(m.GID), false)
		b = appendTimes(b, m.Atime, m.Mtime, m.Ctime)
		b = append(b, '}')
	}
	b = appendUint(b, `,"access":`, uint64(r.Access), true)
	if r.Kept != nil {
		b = append(b, `,"kept":`...)
		b = appendKept(b, r.Kept)
	}
	if r.ID != 0 {
		b = strconv.AppendInt(append(b, `,"id":`...), int64(r.ID), 10)
	}
	b = appendUint(b, `,"unique":`, r.Unique, true)
	return append(b, '}')
}

func appendNode(b []byte, n *tree.NodeState) []byte {
	b = appendUint(b, `{"ino":`, n.Ino, false)
	b = appendUint(b, `,"parent":`, n.Parent, true)
	if n.Name != "" {
		b = append(b, `,"name":`...)
		b = appendString(b, n.Name)
	}
	b = appendUint(b, `,"mode":`, uint64(n.Mode), false)
	b = appendUint(b, `,"uid":`, uint64(n.UID), false)
	b = appendUint(b, `,"gid":`, uint64(n.GID), false)
	b = appendTimes(b, n.Atime, n.Mtime, n.Ctime)
	if d := n.Dir; d != nil {
		b = appendUint(b, `,"dir":{"default_access":`, uint64(d.DefaultAccess), false)
		b = append(b, `,"token":`...)
		b = appendString(b, d.Token)
		b = append(b, '}')
	}
	if n.File != nil {
		b = append(b, `,"file":`...)
		b = appendKept(b, n.File)
	}
	if n.Lost != "" {
		b = append(b, `,"lost":`...)
		b = appendString(b, n.Lost)
	}
	return append(b, '}')
}

func appendKept(b []byte, k *buffer.Kept) []byte {
	b = appendUint(b, `{"File":`, k.File, false)
	b = appendUint(b, `,"Owner":`, uint64(k.Owner), false)
	b = appendUint(b, `,"Access":`, uint64(k.Access), false)
	b = appendUint(b, `,"Generation":`, k.Generation, false)
	if s := k.Source; s != nil {
		b = append(b, `,"source":{"path":`...)
		b = appendString(b, s.Path)
		b = appendUint(b, `,"dev":`, s.Dev, false)
		b = appendUint(b, `,"ino":`, s.Ino, false)
		if s.Writable {
			b = append(b, `,"writable":true`...)
		}
		if s.Stale {
			b = append(b, `,"stale":true`...)
		}
		b = append(b, '}')
	}
	return append(b, '}')
}

func appendTimes(b []byte, atime, mtime, ctime int64) []byte {
	b = strconv.AppendInt(append(b, `,"atime":`...), atime, 10)
	b = strconv.AppendInt(append(b, `,"mtime":`...), mtime, 10)
	return strconv.AppendInt(append(b, `,"ctime":`...), ctime, 10)
}

// appendUint appends key and v, or nothing for an omitempty zero.
func appendUint(b []byte, key string, v uint64, omitEmpty bool) []byte {
	if omitEmpty && v == 0 {
		return b
	}
	return strconv.AppendUint(append(b, key...), v, 10)
}

// appendString appends s quoted as json.Marshal does. Printable ASCII
// other than what it escapes is copied; any other name takes its way,
// with a copy (s itself handed to json.Marshal would move every record to
// the heap: escape analysis does not tell a record's fields apart).
func appendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20, c >= 0x7f, c == '"', c == '\\', c == '<', c == '>', c == '&':
			q, _ := json.Marshal(strings.Clone(s)) // a string always encodes
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}
