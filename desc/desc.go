// Package desc is user.mrfs.desc: everything a peer needs of a registered
// buffer in one JSON object, with its one encoder (Of, JSON) and its one
// parser (Parse). fs serves it, publish sends it to etcd with where the
// buffer is (Host, Mount, Path, Listen, PDPath), and `mrfs remote` and
// `mrfs status` read it.
//
// Addresses and keys are hex strings ("0x7f0000001000"), lengths decimal
// strings: a 64-bit number in a JSON number loses bits in many parsers.
package desc

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"mrfs/buffer"
)

// Desc is one buffer's description.
type Desc struct {
	Device string   `json:"device"`
	Addr   Hex      `json:"addr"`
	Length Dec      `json:"length"`
	LKey   Key      `json:"lkey"`
	RKey   Key      `json:"rkey"`
	Access []string `json:"access"`
	// PageSize is the size of the pages behind the region (2 MiB for
	// huge pages; 0 when the kernel does not say).
	PageSize uint64 `json:"page_size"`
	// Generation grows at every registration of the buffer, so a peer
	// never takes a new region for an old one.
	Generation uint64 `json:"generation"`
	// PD and State are user.mrfs.pd and user.mrfs.state: with them desc is
	// all `mrfs status` reads of a registered file.
	PD    uint32 `json:"pd"`
	State string `json:"state"`
	// Regions are the memory regions of the registration, in order: one,
	// or several when the buffer is larger than the device's max_mr_size.
	// The keys above are the first's; a peer uses the region that holds
	// the address it reaches for.
	Regions []Region `json:"regions"`
	// Devices is every device's keys and regions when the buffer is
	// registered on several (verbs.devices); the first is Device's, as
	// above. Absent on one device.
	Devices []DeviceRegions `json:"devices,omitempty"`
	// Pool is where a pool file's slot is; its region above is the
	// chunk's, which holds every slot of the chunk under one key.
	Pool *Pool `json:"pool,omitempty"`
	// Source is the file a buffer registered in place has its memory
	// from.
	Source *Source `json:"source,omitempty"`

	// Where a published buffer is (package publish); empty in
	// user.mrfs.desc.
	Host   string `json:"host,omitempty"`
	Mount  string `json:"mount,omitempty"`   // the mount's name in the keys
	Path   string `json:"path,omitempty"`    // the buffer's path in its mount
	Listen string `json:"listen,omitempty"`  // "TRANSPORT HOST:PORT"
	PDPath string `json:"pd_path,omitempty"` // the PD's directory in the mount
}

// Region is one memory region.
type Region struct {
	Addr   Hex `json:"addr"`
	Length Dec `json:"length"`
	LKey   Key `json:"lkey"`
	RKey   Key `json:"rkey"`
}

// DeviceRegions is one device's registration of the buffer.
type DeviceRegions struct {
	Device  string   `json:"device"`
	LKey    Key      `json:"lkey"`
	RKey    Key      `json:"rkey"`
	Regions []Region `json:"regions"`
	// Listen is where a peer reaches this device ("rdma_cm
	// 10.0.3.5:7471"), in what etcd holds.
	Listen string `json:"listen,omitempty"`
}

// Source is where a file registered in place has its memory: the path its
// caller gave and the kind ("tmpfs", "hugetlbfs", "memfd").
type Source struct {
	Path string `json:"path"`
	Kind string `json:"kind"`
}

// Pool is a pool file's place: its pool's directory (when known), the
// slot's number and the slot size.
type Pool struct {
	Dir      string `json:"dir,omitempty"`
	Slot     int    `json:"slot"`
	SlotSize Dec    `json:"slot_size"`
}

// Of is the desc of a buffer registered on device as info and regs say,
// backed by pages of pageSize; poolDir is a pool file's directory, when
// known.
func Of(device string, info buffer.Info, regs []buffer.Region, pageSize uint64, poolDir string) Desc {
	d := Desc{
		Device:     device,
		Addr:       Hex(info.Addr),
		Length:     Dec(info.Length),
		LKey:       Key(info.LKey),
		RKey:       Key(info.RKey),
		Access:     info.Access.Names(),
		PageSize:   pageSize,
		Generation: info.Generation,
		PD:         info.PD,
		State:      State(info),
		Regions:    make([]Region, len(regs)),
	}
	for i, r := range regs {
		d.Regions[i] = Region{Addr: Hex(r.Addr), Length: Dec(r.Length), LKey: Key(r.LKey), RKey: Key(r.RKey)}
	}
	d.Devices = perDevice(regs)
	if s := info.Pool; s != nil {
		d.Pool = &Pool{Dir: poolDir, Slot: s.Index, SlotSize: Dec(s.Size)}
	}
	if s := info.Source; s != nil {
		d.Source = &Source{Path: s.Path, Kind: s.Kind}
	}
	return d
}

// perDevice turns regions that list every device's keys into a
// registration per device; nil when they are on one device.
func perDevice(regs []buffer.Region) []DeviceRegions {
	if len(regs) == 0 || len(regs[0].Devices) == 0 {
		return nil
	}
	out := make([]DeviceRegions, len(regs[0].Devices))
	for j, k := range regs[0].Devices {
		out[j] = DeviceRegions{Device: k.Device, LKey: Key(k.LKey), RKey: Key(k.RKey), Regions: make([]Region, 0, len(regs))}
	}
	for _, r := range regs {
		for j, k := range r.Devices {
			if j < len(out) && k.Device == out[j].Device {
				out[j].Regions = append(out[j].Regions, Region{Addr: Hex(r.Addr), Length: Dec(r.Length), LKey: Key(k.LKey), RKey: Key(k.RKey)})
			}
		}
	}
	return out
}

// Buffer is the desc of b, a buffer of mgr, with the Info it was made
// from; ok is false when b is not registered (it has no desc).
func Buffer(mgr *buffer.Manager, b *buffer.Buffer, poolDir string) (d Desc, info buffer.Info, ok bool) {
	info, regs := b.Regions()
	if info.State != buffer.Registered {
		return Desc{}, info, false
	}
	return Of(mgr.Device().Name(), info, regs, b.PageSize(), poolDir), info, true
}

// JSON is d's text.
func (d Desc) JSON() []byte {
	j, err := json.Marshal(d)
	if err != nil {
		panic(err) // every field marshals
	}
	return j
}

// State is user.mrfs.state: "registered", "empty",
// "unregistered: <reason>", "registering <done>/<total>", "registered in
// place", "stale: <reason>" (registered in place, source resized), or, when a
// client grew the file past what could be registered and the
// registration that was there stays, "registered <length> of <size>
// bytes: <reason>".
func State(info buffer.Info) string {
	switch {
	case info.Progress.Total > 0:
		return fmt.Sprintf("registering %d/%d", info.Progress.Done, info.Progress.Total)
	case info.State == buffer.Registered && info.Source != nil && info.Length == info.Size:
		return "registered in place"
	case info.State == buffer.Registered && info.Length == info.Size && info.Regions > 1:
		return fmt.Sprintf("registered in %d regions", info.Regions)
	case info.State == buffer.Registered && info.Length == info.Size:
		return "registered"
	case info.State == buffer.Registered:
		return fmt.Sprintf("registered %d of %d bytes: %s", info.Length, info.Size, info.Reason)
	case info.State == buffer.Empty:
		return "empty"
	case info.State == buffer.Stale:
		return "stale: " + info.Reason
	default:
		return "unregistered: " + info.Reason
	}
}

// Parse reads a desc: user.mrfs.desc, a published value, or one written
// by hand (numbers in any base strconv takes; a missing length is 0).
func Parse(data []byte) (Desc, error) {
	var d Desc
	if err := json.Unmarshal(data, &d); err != nil {
		return Desc{}, fmt.Errorf("not a desc: %w", err)
	}
	return d, nil
}

// Span is what a peer may reach through d: its regions cut to the
// buffer's own bytes, [Addr, Addr+Length) (to the end of the address
// space when Length is 0: a desc written by hand). A pool file's region
// is its chunk's, which holds the neighbouring slots too: a range past
// the file must not reach them.
func (d Desc) Span() ([]Region, error) {
	if len(d.Regions) == 0 {
		return nil, errors.New("it lists no regions")
	}
	addr, length := uint64(d.Addr), uint64(d.Length)
	if length == 0 {
		length = ^uint64(0) - addr
	}
	var out []Region
	for _, r := range d.Regions {
		a, n := uint64(r.Addr), uint64(r.Length)
		if from, to := max(a, addr), min(a+n, addr+length); from < to {
			out = append(out, Region{Addr: Hex(from), Length: Dec(to - from), LKey: r.LKey, RKey: r.RKey})
		}
	}
	return out, nil
}

// OnDevice is d with the named device's keys and regions in place of
// the first device's, for a peer whose connection came through that
// device. A desc of one device is itself for that device; a device it
// has no keys for is an error that lists those it has.
func (d Desc) OnDevice(device string) (Desc, error) {
	if len(d.Devices) == 0 {
		if device == d.Device {
			return d, nil
		}
		return d, fmt.Errorf("the connection came through device %s, and the desc has keys for %s only", device, d.Device)
	}
	var names []string
	for _, dr := range d.Devices {
		if dr.Device == device {
			d.Device, d.LKey, d.RKey, d.Regions = dr.Device, dr.LKey, dr.RKey, dr.Regions
			return d, nil
		}
		names = append(names, dr.Device)
	}
	return d, fmt.Errorf("the connection came through device %s, and the desc has keys for %s only", device, strings.Join(names, ", "))
}

// Hex is a number written as a hex string.
type Hex uint64

func (h Hex) String() string { return "0x" + strconv.FormatUint(uint64(h), 16) }

func (h Hex) MarshalJSON() ([]byte, error) { return []byte(`"` + h.String() + `"`), nil }

func (h *Hex) UnmarshalJSON(b []byte) error {
	n, err := parseNumber(b)
	*h = Hex(n)
	return err
}

// Key is a memory region's key, written as a hex string.
type Key uint32

func (k Key) String() string { return Hex(k).String() }

func (k Key) MarshalJSON() ([]byte, error) { return Hex(k).MarshalJSON() }

func (k *Key) UnmarshalJSON(b []byte) error {
	n, err := parseNumber(b)
	if err == nil && n > 0xffffffff {
		err = fmt.Errorf("%s: a key has 32 bits", b)
	}
	*k = Key(n)
	return err
}

// Dec is a number written as a decimal string.
type Dec uint64

func (d Dec) String() string { return strconv.FormatUint(uint64(d), 10) }

func (d Dec) MarshalJSON() ([]byte, error) { return []byte(`"` + d.String() + `"`), nil }

func (d *Dec) UnmarshalJSON(b []byte) error {
	n, err := parseNumber(b)
	*d = Dec(n)
	return err
}

// parseNumber reads a JSON string holding a number in any base
// strconv.ParseUint takes ("0x10", "16"), or a plain JSON number.
func parseNumber(b []byte) (uint64, error) {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		s = string(b) // a number, not a string
	}
	n, err := strconv.ParseUint(s, 0, 64)
	if err != nil {
		return 0, fmt.Errorf("%s: want a number such as \"0x1000\" or \"4096\"", b)
	}
	return n, nil
}
