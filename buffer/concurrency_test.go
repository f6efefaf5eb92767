package buffer_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"mrfs/buffer"
	"mrfs/verbs"
)

// TestConcurrency runs every operation from many goroutines on shared
// buffers, domains that come and go, and outside writers, under -race;
// at the end the totals must match the buffers and the device must hold
// exactly one region per registered buffer.
func TestConcurrency(t *testing.T) {
	e := setup(t, buffer.Options{MaxBuffers: 40, MaxPinned: 2 << 20}, 0)
	d2, err := e.m.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	domains := []*buffer.Domain{e.d, d2}
	shared := []*buffer.Buffer{e.create(t, page), e.create(t, 0), e.create(t, 3*page)}

	// ok accepts the errors the limits and races may legitimately cause.
	ok := func(err error) {
		if err == nil {
			return
		}
		for _, want := range []syscall.Errno{syscall.ENOSPC, syscall.ENOENT, syscall.ENOTEMPTY, syscall.EAGAIN} {
			if errors.Is(err, want) {
				return
			}
		}
		t.Error(err)
	}
	const workers, rounds = 8, 150
	var mu sync.Mutex
	live := append([]*buffer.Buffer{}, shared...) // guarded by mu until wg.Wait
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 1))
			var own []*buffer.Buffer
			for range rounds {
				b := shared[r.IntN(len(shared))]
				if len(own) > 0 && r.IntN(2) == 0 {
					b = own[r.IntN(len(own))]
				}
				switch r.IntN(12) {
				case 0:
					nb, err := e.m.Create(domains[r.IntN(2)], uint64(r.IntN(5*page)), 0)
					ok(err)
					if err == nil {
						own = append(own, nb)
					}
				case 1:
					ok(b.Resize(context.Background(), uint64(r.IntN(8*page))))
				case 2:
					// A client writing past EOF through its own fd.
					if fd, err := b.Open(true); err == nil {
						_, _ = unix.Pwrite(fd.N, []byte("client"), int64(r.IntN(6*page)))
						fd.Close()
					}
					ok(b.Sync())
				case 3:
					ok(b.SetAccess([]verbs.Access{verbs.LocalWrite, verbs.LocalWrite | verbs.RemoteRead, 0}[r.IntN(3)]))
				case 4:
					ok(b.Move(domains[r.IntN(2)]))
				case 5:
					in := b.Info()
					if in.State == buffer.Registered && in.LKey == 0 {
						t.Error("registered without keys")
					}
					_ = e.m.Stats()
					_ = b.Domain().Buffers()
				case 6:
					_, err := b.WriteAt([]byte("daemon"), int64(r.IntN(4*page)))
					ok(err)
				case 7:
					p := make([]byte, 64)
					_, err := b.ReadAt(p, int64(r.IntN(4*page)))
					ok(err)
				case 8:
					ok(b.Allocate(context.Background(), uint64(r.IntN(page)), page, 0))
				case 9:
					if len(own) > 0 {
						i := r.IntN(len(own))
						ok(own[i].Free())
						own = append(own[:i], own[i+1:]...)
					}
				case 10:
					// A domain that races with Moves and Creates into it.
					d, err := e.m.NewDomain(verbs.LocalWrite)
					ok(err)
					if err == nil {
						if r.IntN(2) == 0 {
							ok(b.Move(d))
							ok(b.Move(e.d))
						}
						for i := 0; d.Close() != nil; i++ {
							if i == 100 {
								t.Error("domain never emptied")
								break
							}
							ok(b.Move(e.d))
						}
					}
				case 11:
					if fd, err := b.Open(true); err == nil {
						_ = unix.Ftruncate(fd.N, int64(r.IntN(3*page)))
						fd.Close()
					}
					ok(b.Sync())
				}
			}
			mu.Lock()
			live = append(live, own...)
			mu.Unlock()
		})
	}
	wg.Wait()
	checkTotals(t, e, live, len(domains))

	if _, err := e.m.Close(); err != nil {
		t.Fatal(err)
	}
	if mrs, pds := e.dev.counts(); mrs != 0 || pds != 0 {
		t.Fatalf("%d regions, %d PDs left", mrs, pds)
	}
}

// checkTotals wants the manager's totals and region count, and the
// regions and PDs the device holds, to be what the live buffers bufs and
// the pds domains add up to; and every buffer consistent (check).
func checkTotals(t *testing.T, e *env, bufs []*buffer.Buffer, pds int) {
	t.Helper()
	var reg, pinned uint64
	regions := 0
	for _, b := range bufs {
		in := b.Info()
		if in.State == buffer.Registered {
			reg += in.Size
			pinned += buffer.PageRound(in.Size)
			regions++
		}
		check(t, e, b, in.Size, in.State)
	}
	st := e.m.Stats()
	if st.RegisteredBytes != reg || st.PinnedBytes != pinned || st.Buffers != len(bufs) || st.PDs != pds || e.m.Regions() != regions {
		t.Fatalf("Stats %+v regions %d; the buffers hold %d bytes, %d pinned, %d regions in %d buffers and %d PDs",
			st, e.m.Regions(), reg, pinned, regions, len(bufs), pds)
	}
	if mrs, devPDs := e.dev.counts(); mrs != regions || devPDs != pds {
		t.Fatalf("the device holds %d regions and %d PDs; the buffers %d and %d", mrs, devPDs, regions, pds)
	}
}

// TestConcurrentTotals checks, after concurrent work, that the manager's
// byte totals and region count equal what the buffers hold.
func TestConcurrentTotals(t *testing.T) {
	e := setup(t, buffer.Options{}, 0)
	var mu sync.Mutex
	var all []*buffer.Buffer
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 2))
			b, err := e.m.Create(e.d, uint64(r.IntN(3*page)), 0)
			if err != nil {
				t.Error(err)
				return
			}
			for range 100 {
				if err := b.Resize(context.Background(), uint64(r.IntN(6*page))); err != nil {
					t.Error(err)
				}
				if r.IntN(3) == 0 {
					if err := b.SetAccess(verbs.LocalWrite | verbs.RemoteRead); err != nil {
						t.Error(err)
					}
				}
			}
			mu.Lock()
			all = append(all, b)
			mu.Unlock()
		})
	}
	wg.Wait()
	checkTotals(t, e, all, 1)
}

// TestCloseRacesCreate closes the manager while buffers are being created
// and resized: nothing may stay registered.
func TestCloseRacesCreate(t *testing.T) {
	for range 20 {
		e := setup(t, buffer.Options{}, 0)
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				for i := range 30 {
					b, err := e.m.Create(e.d, uint64(i+1)*page, 0)
					if err != nil {
						if !errors.Is(err, syscall.ENODEV) {
							t.Error(err)
						}
						return
					}
					if err := b.Resize(context.Background(), page); err != nil && !errors.Is(err, syscall.ENODEV) {
						t.Error(err)
					}
				}
			})
		}
		if _, err := e.m.Close(); err != nil {
			t.Error(err)
		}
		wg.Wait()
		if mrs, pds := e.dev.counts(); mrs != 0 || pds != 0 {
			t.Fatalf("%d regions, %d PDs after Close raced Create", mrs, pds)
		}
	}
}
