package buffer_test

import (
	"strings"
	"syscall"
	"testing"

	"mrfs/buffer"
	"mrfs/verbs"
	"mrfs/verbs/multi"
	"mrfs/verbs/soft"
)

// On two devices (verbs/multi) a buffer's regions carry both devices'
// keys, and a max_mr refusal names the device that refused: here the
// second, whose max_mr is the smaller.
func TestSeveralDevicesMaxMR(t *testing.T) {
	a, err := soft.New(soft.Options{MaxMR: 4}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	b, err := soft.New(soft.Options{MaxMR: 2, DeviceName: "soft1"}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	e := setupOn(t, buffer.Options{}, multi.Join([]verbs.Device{a, b}))
	x := e.create(t, page)
	e.create(t, page)
	_, regs := x.Regions()
	if len(regs) != 1 || len(regs[0].Devices) != 2 || regs[0].Devices[1].Device != "soft1" || regs[0].Devices[0].RKey != regs[0].RKey {
		t.Fatalf("regions %+v: want one region with soft0's and soft1's keys, soft0's first", regs)
	}
	_, err = e.m.Create(e.d, page, 0)
	errnoIs(t, err, syscall.EINVAL)
	if !strings.Contains(e.log.String(), "device soft1 refused a registration: its max_mr is 2") {
		t.Fatalf("log does not name soft1's max_mr:\n%s", e.log.String())
	}
}

// On several devices max_pd is the smallest, and its refusal names the
// device that has it, not the first.
func TestSeveralDevicesMaxPD(t *testing.T) {
	a, err := soft.New(soft.Options{MaxPD: 4}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	b, err := soft.New(soft.Options{MaxPD: 2, DeviceName: "soft1"}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	e := setupOn(t, buffer.Options{}, multi.Join([]verbs.Device{a, b}))
	// setupOn made one directory's PD; one more fits.
	if _, err := e.m.NewDomain(verbs.LocalWrite); err != nil {
		t.Fatal(err)
	}
	_, err = e.m.NewDomain(verbs.LocalWrite)
	errnoIs(t, err, syscall.ENOSPC)
	if !strings.Contains(e.log.String(), "device soft1 holds at most 2 (max_pd)") {
		t.Fatalf("log does not name soft1's max_pd:\n%s", e.log.String())
	}
}
