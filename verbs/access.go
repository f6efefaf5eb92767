package verbs

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"
)

// Access is a set of IBV_ACCESS_* flags, with the kernel's bit values.
type Access uint32

// The access flags mrfs knows by name, in flag order.
const (
	LocalWrite      Access = 1 << 0
	RemoteWrite     Access = 1 << 1
	RemoteRead      Access = 1 << 2
	RemoteAtomic    Access = 1 << 3
	MWBind          Access = 1 << 4
	ZeroBased       Access = 1 << 5
	OnDemand        Access = 1 << 6
	RelaxedOrdering Access = 1 << 20
)

// supportedAccess is the kernel's IB_ACCESS_SUPPORTED: bits 0-9 and the
// optional range 20-29. Anything else is EINVAL in ib_check_mr_access.
const supportedAccess Access = 0x3FF | 0x3FF00000

var accessNames = []struct {
	flag Access
	name string
}{
	{LocalWrite, "local_write"},
	{RemoteWrite, "remote_write"},
	{RemoteRead, "remote_read"},
	{RemoteAtomic, "remote_atomic"},
	{MWBind, "mw_bind"},
	{ZeroBased, "zero_based"},
	{OnDemand, "on_demand"},
	{RelaxedOrdering, "relaxed_ordering"},
}

// ParseAccess reads a forgiving access list: names in any case, with or
// without the IBV_ACCESS_ prefix, separated by ',', '|' or spaces, or one
// numeric mask such as "0x7". An empty list or "none" is 0. Errors wrap
// EINVAL. The result is not validated; see Validate.
func ParseAccess(s string) (Access, error) {
	s = strings.TrimSpace(strings.TrimRight(s, "\x00\n"))
	if s == "" || strings.EqualFold(s, "none") {
		return 0, nil
	}
	if n, err := strconv.ParseUint(s, 0, 32); err == nil {
		return Access(n), nil
	}
	var a Access
	for _, f := range strings.FieldsFunc(s, func(r rune) bool {
		return r == ',' || r == '|' || r == ' ' || r == '\t' || r == '\n'
	}) {
		name := strings.ToLower(f)
		name = strings.TrimPrefix(name, "ibv_access_")
		flag, ok := flagByName(name)
		if !ok {
			return 0, fmt.Errorf("unknown access flag %q: %w", f, syscall.EINVAL)
		}
		a |= flag
	}
	return a, nil
}

func flagByName(name string) (Access, bool) {
	for _, n := range accessNames {
		if n.name == name {
			return n.flag, true
		}
	}
	return 0, false
}

// Names returns the canonical names of the set flags in flag order. A bit
// without a name is given as its hex value.
func (a Access) Names() []string {
	names := []string{}
	for _, n := range accessNames {
		if a&n.flag != 0 {
			names = append(names, n.name)
			a &^= n.flag
		}
	}
	for bit := Access(1); a != 0; bit <<= 1 {
		if a&bit != 0 {
			names = append(names, fmt.Sprintf("0x%x", uint32(bit)))
			a &^= bit
		}
	}
	return names
}

// String is the canonical form: names in flag order joined by commas; ""
// for no flags.
func (a Access) String() string { return strings.Join(a.Names(), ",") }

// Validate applies the kernel's device-independent checks
// (ib_check_mr_access): unknown bits, and REMOTE_WRITE or REMOTE_ATOMIC
// without LOCAL_WRITE, are EINVAL.
func (a Access) Validate() error {
	if a&^supportedAccess != 0 {
		return fmt.Errorf("access 0x%x has unsupported bits 0x%x: %w", uint32(a), uint32(a&^supportedAccess), syscall.EINVAL)
	}
	if a&(RemoteWrite|RemoteAtomic) != 0 && a&LocalWrite == 0 {
		return fmt.Errorf("access %s: remote_write and remote_atomic need local_write: %w", a, syscall.EINVAL)
	}
	return nil
}

// Writable reports whether a registration with these flags pins its pages
// for writing (the kernel's ib_access_writable).
func (a Access) Writable() bool {
	return a&(LocalWrite|RemoteWrite|RemoteAtomic|MWBind) != 0
}
