package multi_test

import (
	"errors"
	"syscall"
	"testing"

	"mrfs/verbs"
	"mrfs/verbs/multi"
	"mrfs/verbs/soft"
	"mrfs/verbs/verbstest"
)

// joined is a provider whose one device is soft0 and soft1 joined: the
// verbs suite holds for it as for one device.
type joined struct{ p verbs.Provider }

func (j joined) Name() string { return "soft" }

func (j joined) Devices() ([]verbs.DeviceInfo, error) {
	d, err := j.Open("")
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return []verbs.DeviceInfo{{Name: d.Name(), Attr: d.Attr()}}, nil
}

func (j joined) Open(name string) (verbs.Device, error) {
	if name != "" && name != "soft0" {
		return nil, syscall.ENODEV
	}
	return multi.Open(j.p, []string{"soft0", "soft1"})
}

func TestConformance(t *testing.T) {
	verbstest.Run(t, func(t *testing.T) verbs.Provider {
		return joined{soft.New(soft.Options{Devices: 2, MaxMR: 64})}
	})
}

// two opens soft0 and soft1 of separate providers (so that each has its
// own limits) and joins them.
func two(t *testing.T, first, second soft.Options) verbs.Device {
	t.Helper()
	second.DeviceName = "soft1"
	a, err := soft.New(first).Open("")
	if err != nil {
		t.Fatal(err)
	}
	b, err := soft.New(second).Open("")
	if err != nil {
		t.Fatal(err)
	}
	d := multi.Join([]verbs.Device{a, b})
	t.Cleanup(func() { d.Close() })
	return d
}

// A region is registered on every device with keys of each; lkey and
// rkey are the first device's.
func TestKeysPerDevice(t *testing.T) {
	d := two(t, soft.Options{}, soft.Options{})
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := verbstest.Map(t, 8192)
	mr, err := pd.RegMR(addr, 8192, verbs.LocalWrite|verbs.RemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	ks := mr.(verbs.MultiMR).Keys()
	if len(ks) != 2 || ks[0].Device != "soft0" || ks[1].Device != "soft1" {
		t.Fatalf("Keys() = %+v, want soft0's and soft1's", ks)
	}
	if ks[0].LKey != mr.LKey() || ks[0].RKey != mr.RKey() || ks[1].RKey == ks[0].RKey {
		t.Errorf("Keys() = %+v with lkey 0x%x rkey 0x%x: want the first device's first and another key for the second", ks, mr.LKey(), mr.RKey())
	}
	if d.Name() != "soft0" {
		t.Errorf("Name() = %q, want the first device's", d.Name())
	}
	// A connection through soft1 works in the PD's soft1 part, where
	// soft1's key reaches the region and soft0's does not.
	mp := pd.(verbs.MultiPD)
	if mp.On("soft2") != nil {
		t.Errorf("On(soft2) = %v, want nil: the PD has no part there", mp.On("soft2"))
	}
	r := mp.On("soft1").(verbs.ResponderPD).Responder()
	var b [8]byte
	if st := r.Read(b[:], mr.IOVA(), ks[1].RKey); st != verbs.WCSuccess {
		t.Errorf("READ through soft1 with soft1's rkey: %v", st)
	}
	if st := r.Read(b[:], mr.IOVA(), ks[0].RKey); st != verbs.WCRemAccessErr {
		t.Errorf("READ through soft1 with soft0's rkey: %v, want IBV_WC_REM_ACCESS_ERR", st)
	}
	if err := mr.Dereg(); err != nil {
		t.Fatal(err)
	}
	verbstest.WantErrno(t, mr.Dereg(), syscall.EINVAL)
	if err := pd.Dealloc(); err != nil {
		t.Fatal(err)
	}
}

// When the second device refuses (its max_mr), nothing stays on the
// first, and the error names the device that refused.
func TestRefusalUndoneOnAll(t *testing.T) {
	d := two(t, soft.Options{MaxMR: 3}, soft.Options{MaxMR: 2})
	if a := d.Attr(); a.MaxMR != 2 {
		t.Errorf("Attr().MaxMR = %d, want the smaller device's 2", a.MaxMR)
	}
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := verbstest.Map(t, 4*4096)
	for i := range 2 {
		if _, err := pd.RegMR(addr+uintptr(i)*4096, 4096, 0); err != nil {
			t.Fatal(err)
		}
	}
	_, err = pd.RegMR(addr+2*4096, 4096, 0)
	verbstest.WantErrno(t, err, syscall.EINVAL)
	var de *verbs.DeviceError
	if !errors.As(err, &de) || de.Device != "soft1" {
		t.Errorf("refusal %v does not name soft1", err)
	}
	// soft0 holds 2 of its 3: the refused registration left nothing
	// there, so a third region fits on it alone.
	first := d.(interface{ Parts() []verbs.Device }).Parts()[0]
	fpd, err := first.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	r, err := fpd.RegMR(addr+3*4096, 4096, 0)
	if err != nil {
		t.Fatalf("soft0 after the refused registration: %v (a region was left on it)", err)
	}
	r.Dereg()
	fpd.Dealloc()
}
