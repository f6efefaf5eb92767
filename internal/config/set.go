package config

import (
	"errors"
	"reflect"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"
)

// Keys lists the dotted keys of the schema ("verbs.backend", ...) in the
// order of config.toml.
func Keys() []string {
	var keys []string
	var walk func(t reflect.Type, prefix string)
	walk = func(t reflect.Type, prefix string) {
		for i := range t.NumField() {
			fld := t.Field(i)
			name := prefix + fld.Tag.Get("toml")
			if isTable(fld.Type) {
				walk(fld.Type, name+".")
			} else {
				keys = append(keys, name)
			}
		}
	}
	walk(reflect.TypeOf(file{}), "")
	return keys
}

// Set sets one key ("buffers.max_pinned") from its text form, as a mount
// option gives it. The text is read as the file reads a TOML string, so
// "64KiB", "077" and "debug" mean what they mean there; a boolean takes
// true or false, an integer key digits, and a list its elements
// separated by '|' (a mount option cannot hold a comma). Set checks the
// value's form; call Validate afterwards for the whole.
func (c *Config) Set(key, value string) error {
	t, ok := keyType(key)
	if !ok {
		known := map[string]bool{}
		schemaKeys(reflect.TypeOf(file{}), "", known)
		return invalid(key, "%s", unknownKeyMsg(toml.Key(strings.Split(key, ".")), known))
	}
	var v any = value
	switch {
	case isTable(t):
		return invalid(key, "is a table; name one of its keys, such as %s", Keys()[0])
	case t.Kind() == reflect.Bool:
		if value != "true" && value != "false" {
			return invalid(key, "%q: want true or false", value)
		}
		v = value == "true"
	case t.Kind() == reflect.Int:
		n, err := strconv.ParseInt(value, 10, 64)
		if err != nil {
			return invalid(key, "%q is not a whole number", value)
		}
		v = n
	case t.Kind() == reflect.Slice: // remote.allow_from; access lists read '|' themselves
		v = strings.Split(value, "|")
	}
	table, name, _ := strings.Cut(key, ".")
	doc, err := toml.Marshal(map[string]map[string]any{table: {name: v}})
	if err != nil {
		return invalid(key, "%v", err) // plain values: cannot happen
	}
	n, err := decodeOnto(*c, doc)
	if err != nil {
		// The line is of the document made here, not of anything the
		// user wrote.
		var e *Error
		if errors.As(err, &e) {
			e.Line = 0
		}
		return err
	}
	*c = n
	return nil
}

// IsBool reports whether key takes true or false (so that a mount option
// may name it alone: allow_other).
func IsBool(key string) bool {
	t, ok := keyType(key)
	return ok && t.Kind() == reflect.Bool
}

// keyType finds the type of a dotted key in the file's schema.
func keyType(key string) (reflect.Type, bool) {
	t := reflect.TypeOf(file{})
	for _, part := range strings.Split(key, ".") {
		if !isTable(t) {
			return nil, false
		}
		found := false
		for i := range t.NumField() {
			if t.Field(i).Tag.Get("toml") == part {
				t, found = t.Field(i).Type, true
				break
			}
		}
		if !found {
			return nil, false
		}
	}
	return t, true
}

var unmarshaler = reflect.TypeOf((*toml.Unmarshaler)(nil)).Elem()

// isTable reports whether t is a table of config.toml, rather than a
// value that decodes itself from one (buffers.max_pinned is a struct).
func isTable(t reflect.Type) bool {
	return t.Kind() == reflect.Struct && !reflect.PointerTo(t).Implements(unmarshaler)
}
