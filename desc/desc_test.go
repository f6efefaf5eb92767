package desc_test

import (
	"reflect"
	"strings"
	"testing"

	"mrfs/buffer"
	"mrfs/desc"
	"mrfs/verbs"
)

// A pool file's desc: two regions of its chunk, its slot.
func poolFile() desc.Desc {
	info := buffer.Info{
		Size: 4096, Length: 4096, State: buffer.Registered, Access: verbs.LocalWrite | verbs.RemoteRead,
		Addr: 0x7f0000002000, LKey: 0x1234, RKey: 0xfedcba98, PD: 3, Generation: 7, Regions: 2,
		Pool: &buffer.SlotInfo{Index: 1, Size: 4096},
	}
	regs := []buffer.Region{
		{Addr: 0x7f0000001000, Length: 0x2000, LKey: 0x1234, RKey: 0xfedcba98},
		{Addr: 0x7f0000003000, Length: 0x1000, LKey: 0x5678, RKey: 0x9abc},
	}
	return desc.Of("soft0", info, regs, 4096, "/pool")
}

// The wire format is the contract with peers in any language: addresses
// and keys as hex strings, lengths as decimal strings.
func TestJSON(t *testing.T) {
	want := `{"device":"soft0","addr":"0x7f0000002000","length":"4096","lkey":"0x1234","rkey":"0xfedcba98",` +
		`"access":["local_write","remote_read"],"page_size":4096,"generation":7,"pd":3,"state":"registered in 2 regions",` +
		`"regions":[{"addr":"0x7f0000001000","length":"8192","lkey":"0x1234","rkey":"0xfedcba98"},` +
		`{"addr":"0x7f0000003000","length":"4096","lkey":"0x5678","rkey":"0x9abc"}],` +
		`"pool":{"dir":"/pool","slot":1,"slot_size":"4096"}}`
	if got := string(poolFile().JSON()); got != want {
		t.Errorf("JSON:\n%s\nwant\n%s", got, want)
	}
	d := poolFile()
	d.Host, d.Listen = "a", "tcp 10.0.0.1:7471"
	if got := string(d.JSON()); !strings.HasSuffix(got, `,"host":"a","listen":"tcp 10.0.0.1:7471"}`) {
		t.Errorf("a published desc ends %s", got[len(got)-60:])
	}
}

func TestParse(t *testing.T) {
	d := poolFile()
	d.Host, d.Mount, d.Path, d.Listen, d.PDPath = "a", "mnt/mr", "/pool/f", "tcp 10.0.0.1:7471", "/pool"
	got, err := desc.Parse(d.JSON())
	if err != nil || !reflect.DeepEqual(got, d) {
		t.Errorf("Parse(JSON(d)) = %+v, %v; want %+v", got, err, d)
	}
	// Written by hand: numbers in any base, as JSON numbers too.
	got, err = desc.Parse([]byte(`{"addr":"4096","length":16,"regions":[{"addr":"0x1000","length":"0x2000","rkey":"17"}]}`))
	if err != nil || got.Addr != 0x1000 || got.Length != 16 || got.Regions[0].Length != 0x2000 || got.Regions[0].RKey != 17 {
		t.Errorf("a desc by hand: %+v, %v", got, err)
	}
	for in, why := range map[string]string{
		`not json`:                             "not a desc",
		`{"addr":"0xzz"}`:                      "want a number",
		`{"regions":[{"rkey":"0x100000000"}]}`: "32 bits",
		`{"length":"-1"}`:                      "want a number",
	} {
		if _, err := desc.Parse([]byte(in)); err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("Parse(%s): %v; want an error saying %q", in, err, why)
		}
	}
}

// Span cuts the regions to the buffer's own bytes: a pool file's region
// is its chunk's, which holds its neighbours' slots too.
func TestSpan(t *testing.T) {
	d := desc.Desc{Addr: 0x2000, Length: 0x1000, Regions: []desc.Region{
		{Addr: 0x1000, Length: 0x1800, RKey: 1}, // its slot's first half and a neighbour
		{Addr: 0x2800, Length: 0x1000, RKey: 2}, // its second half and the next neighbour
		{Addr: 0x4000, Length: 0x1000, RKey: 3}, // a neighbour alone
	}}
	got, err := d.Span()
	want := []desc.Region{{Addr: 0x2000, Length: 0x800, RKey: 1}, {Addr: 0x2800, Length: 0x800, RKey: 2}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("Span = %+v, %v; want %+v", got, err, want)
	}
	d.Length = 0 // by hand: to the end
	if got, _ := d.Span(); len(got) != 3 || got[1].Length != 0x1000 || got[2].Addr != 0x4000 {
		t.Errorf("Span without a length = %+v; want everything from addr on", got)
	}
	if _, err := (desc.Desc{}).Span(); err == nil || !strings.Contains(err.Error(), "no regions") {
		t.Errorf("Span of no regions: %v", err)
	}
}

func TestState(t *testing.T) {
	for _, c := range []struct {
		info buffer.Info
		want string
	}{
		{buffer.Info{State: buffer.Empty}, "empty"},
		{buffer.Info{State: buffer.Registered, Size: 8, Length: 8, Regions: 1}, "registered"},
		{buffer.Info{State: buffer.Registered, Size: 8, Length: 8, Regions: 3}, "registered in 3 regions"},
		{buffer.Info{State: buffer.Registered, Size: 9, Length: 8, Reason: "max_pinned"}, "registered 8 of 9 bytes: max_pinned"},
		{buffer.Info{State: buffer.Unregistered, Reason: "max_mr"}, "unregistered: max_mr"},
		{buffer.Info{State: buffer.Registered, Progress: buffer.Progress{Done: 1, Total: 4}}, "registering 1/4"},
	} {
		if got := desc.State(c.info); got != c.want {
			t.Errorf("State(%+v) = %q, want %q", c.info, got, c.want)
		}
	}
}

// OnDevice gives the keys and regions of the device a connection came
// through; the first device's stay the desc's own.
func TestOnDevice(t *testing.T) {
	d := desc.Desc{Device: "rxe0", LKey: 1, RKey: 2, Regions: []desc.Region{{Addr: 0x1000, Length: 0x1000, RKey: 2}},
		Devices: []desc.DeviceRegions{
			{Device: "rxe0", LKey: 1, RKey: 2, Regions: []desc.Region{{Addr: 0x1000, Length: 0x1000, RKey: 2}}},
			{Device: "rxe1", LKey: 3, RKey: 4, Regions: []desc.Region{{Addr: 0x1000, Length: 0x1000, RKey: 4}}},
		}}
	got, err := d.OnDevice("rxe1")
	if err != nil || got.Device != "rxe1" || got.LKey != 3 || got.RKey != 4 || len(got.Regions) != 1 || got.Regions[0].RKey != 4 {
		t.Errorf("OnDevice(rxe1) = %+v, %v; want rxe1's keys and regions", got, err)
	}
	if d.RKey != 2 || d.Regions[0].RKey != 2 {
		t.Errorf("OnDevice changed the desc it was called on: %+v", d)
	}
	if _, err := d.OnDevice("rxe2"); err == nil || !strings.Contains(err.Error(), "rxe0, rxe1") {
		t.Errorf("OnDevice(rxe2): %v; want an error listing rxe0, rxe1", err)
	}
	one := desc.Desc{Device: "rxe0", RKey: 2}
	if got, err := one.OnDevice("rxe0"); err != nil || got.RKey != 2 {
		t.Errorf("OnDevice of a one-device desc: %+v, %v", got, err)
	}
	if _, err := one.OnDevice("rxe1"); err == nil {
		t.Error("OnDevice(rxe1) of a desc of rxe0 alone: no error")
	}
}
