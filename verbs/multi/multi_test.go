package multi_test

import (
	"errors"
	"slices"
	"sync"
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

// A device that leaves takes its parts and leaves the others' keys as
// they were; one that joins gets a part of every PD and region, in its
// place; the primary's keys follow the first device present.
func TestDetachAttach(t *testing.T) {
	p := soft.New(soft.Options{Devices: 2})
	d, err := multi.OpenJoined(p, []string{"soft0", "soft1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	mp := pd.(verbs.MultiPD)
	addr, _ := verbstest.Map(t, 2*4096)
	mr, err := pd.RegMR(addr, 4096, verbs.LocalWrite|verbs.RemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	keys := func(r verbs.MR) []verbs.DeviceKeys { return r.(verbs.MultiMR).Keys() }
	read := func(part verbs.PD, rkey uint32) verbs.WCStatus {
		var b [8]byte
		return part.(verbs.ResponderPD).Responder().Read(b[:], mr.IOVA(), rkey)
	}
	k := keys(mr)
	old1 := mp.On("soft1")

	if err := d.Detach("soft1"); err != nil {
		t.Fatal(err)
	}
	if got := keys(mr); len(got) != 1 || got[0] != k[0] {
		t.Errorf("after soft1 left: Keys() = %+v, want soft0's %+v alone", got, k[0])
	}
	if mp.On("soft1") != nil || !slices.Equal(d.Names(), []string{"soft0"}) {
		t.Errorf("after soft1 left: On(soft1) = %v, Names() = %v", mp.On("soft1"), d.Names())
	}
	if st := read(old1, k[1].RKey); st != verbs.WCRemAccessErr {
		t.Errorf("soft1's old region after it left: READ %v, want IBV_WC_REM_ACCESS_ERR (freed with the device)", st)
	}
	if st := read(mp.On("soft0"), k[0].RKey); st != verbs.WCSuccess {
		t.Errorf("soft0's region after soft1 left: READ %v", st)
	}
	mr2, err := pd.RegMR(addr+4096, 4096, verbs.LocalWrite)
	if err != nil || len(keys(mr2)) != 1 {
		t.Fatalf("a region made while soft1 is gone: %v, keys %+v", err, keys(mr2))
	}

	dev1, err := p.Open("soft1")
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Attach(dev1); err != nil {
		t.Fatal(err)
	}
	for _, r := range []verbs.MR{mr, mr2} {
		got := keys(r)
		if len(got) != 2 || got[0].Device != "soft0" || got[1].Device != "soft1" {
			t.Errorf("after soft1 came back: Keys() = %+v, want soft0's then soft1's", got)
		}
	}
	if got := keys(mr); got[0] != k[0] {
		t.Errorf("soft0's keys changed when soft1 came back: %+v, were %+v", got[0], k[0])
	}
	if st := read(mp.On("soft1"), keys(mr)[1].RKey); st != verbs.WCSuccess {
		t.Errorf("soft1's new key on soft1: READ %v", st)
	}
	verbstest.WantErrno(t, d.Attach(mustOpen(t, p, "soft1")), syscall.EEXIST)

	// The primary leaves: the region's keys and the name are soft1's.
	handle := pd.Handle()
	if err := d.Detach("soft0"); err != nil {
		t.Fatal(err)
	}
	if d.Name() != "soft1" || mr.RKey() != keys(mr)[0].RKey || keys(mr)[0].Device != "soft1" || pd.Handle() != handle {
		t.Errorf("after soft0 left: Name %s, RKey 0x%x, Keys %+v, Handle %d (was %d)", d.Name(), mr.RKey(), keys(mr), pd.Handle(), handle)
	}
	verbstest.WantErrno(t, d.Detach("soft1"), syscall.EBUSY)
	verbstest.WantErrno(t, d.Detach("soft0"), syscall.ENODEV)
	// soft0 comes back first in order.
	if err := d.Attach(mustOpen(t, p, "soft0")); err != nil {
		t.Fatal(err)
	}
	if d.Name() != "soft0" || keys(mr)[0].Device != "soft0" || mr.RKey() != keys(mr)[0].RKey {
		t.Errorf("after soft0 came back: Name %s, Keys %+v, RKey 0x%x", d.Name(), keys(mr), mr.RKey())
	}
	for _, r := range []verbs.MR{mr, mr2} {
		if err := r.Dereg(); err != nil {
			t.Fatal(err)
		}
	}
	if err := pd.Dealloc(); err != nil {
		t.Fatal(err)
	}
}

// A device that cannot hold every region does not join, and keeps
// nothing: the others are as they were.
func TestAttachRefusedLeavesNothing(t *testing.T) {
	small := soft.New(soft.Options{DeviceName: "soft1", MaxMR: 1})
	d, err := multi.OpenJoined(soft.New(soft.Options{}), []string{"soft0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := verbstest.Map(t, 2*4096)
	for i := range 2 {
		if _, err := pd.RegMR(addr+uintptr(i)*4096, 4096, 0); err != nil {
			t.Fatal(err)
		}
	}
	err = d.Attach(mustOpen(t, small, "soft1"))
	var de *verbs.DeviceError
	if !errors.As(err, &de) || de.Device != "soft1" {
		t.Fatalf("Attach of a device with max_mr 1 for 2 regions: %v, want a refusal naming soft1", err)
	}
	if !slices.Equal(d.Names(), []string{"soft0"}) {
		t.Errorf("after the refused attach: Names() = %v", d.Names())
	}
	// soft1 kept nothing: its one region is free again.
	again := mustOpen(t, small, "soft1")
	defer again.Close()
	spd, err := again.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := spd.RegMR(addr, 4096, 0); err != nil {
		t.Errorf("soft1 after the refused attach: %v (a region was left on it)", err)
	}
}

func mustOpen(t *testing.T, p verbs.Provider, name string) verbs.Device {
	t.Helper()
	dev, err := p.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	return dev
}

// Devices leave and join while regions are registered, read and
// deregistered from several goroutines (run with -race): every region
// made is on one or both devices, and at the end every live region is
// on both, with soft0's keys unchanged throughout for the held one.
func TestDetachAttachConcurrent(t *testing.T) {
	p := soft.New(soft.Options{Devices: 2})
	d, err := multi.OpenJoined(p, []string{"soft0", "soft1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	pd, err := d.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := verbstest.Map(t, 8*4096)
	held, err := pd.RegMR(addr, 4096, verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	k0 := held.(verbs.MultiMR).Keys()[0]
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := pd.RegMR(addr+uintptr(g+1)*4096, 4096, verbs.LocalWrite)
				if err != nil {
					t.Error(err)
					return
				}
				if ks := r.(verbs.MultiMR).Keys(); len(ks) == 0 || len(ks) > 2 || ks[0].Device != "soft0" {
					t.Errorf("a region's keys while soft1 comes and goes: %+v", ks)
				}
				if err := r.Dereg(); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	for range 50 {
		if err := d.Detach("soft1"); err != nil {
			t.Fatal(err)
		}
		if ks := held.(verbs.MultiMR).Keys(); len(ks) != 1 || ks[0] != k0 {
			t.Fatalf("the held region with soft1 gone: %+v, want soft0's %+v alone", ks, k0)
		}
		if err := d.Attach(mustOpen(t, p, "soft1")); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	if ks := held.(verbs.MultiMR).Keys(); len(ks) != 2 || ks[0] != k0 || ks[1].Device != "soft1" {
		t.Errorf("the held region at the end: %+v", ks)
	}
}
