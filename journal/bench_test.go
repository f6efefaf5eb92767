package journal_test

import (
	"os"
	"strconv"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/journal"
	"mrfs/store"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// BenchmarkJournalCost: the create rate of the namespace without FUSE
// (a registered 4 KiB buffer in the tmpfs store per create: the tree's
// and the manager's whole work) with and without the journal, in turns
// within one run: each round makes 10,000 files both ways, in an order
// that alternates. The pages are touched once before, untimed. Reported:
// each side's creates per second and journal/none, the rate kept.
func BenchmarkJournalCost(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("the private tmpfs store needs CAP_SYS_ADMIN: run as root")
	}
	const n = 10000
	run := func(journaled bool) time.Duration {
		st, err := store.NewTmpfs(store.TmpfsOptions{Size: 2 * n * 4096, Huge: "never"})
		if err != nil {
			b.Fatal(err)
		}
		defer st.Close()
		dev, err := soft.New(soft.Options{}).Open("")
		if err != nil {
			b.Fatal(err)
		}
		defer dev.Close()
		bopt := buffer.Options{Store: st, Allowed: verbs.LocalWrite}
		topt := tree.Options{DefaultSize: 4096, DefaultAccess: verbs.LocalWrite}
		var j *journal.Journal
		if journaled {
			f, err := os.CreateTemp("/dev/shm", "journal")
			if err != nil {
				b.Fatal(err)
			}
			os.Remove(f.Name())
			defer f.Close()
			j = journal.New(f)
			defer j.Close()
			bopt.OnKept, topt.Journal = j.Kept, j
		}
		mgr := buffer.NewManager(dev, bopt, nil)
		defer mgr.Close()
		tr, err := tree.New(mgr, topt, verbs.LocalWrite, tree.Owner{}, 0o755)
		if err != nil {
			b.Fatal(err)
		}
		if j != nil {
			if err := j.Compact(tr.Checkpoint); err != nil {
				b.Fatal(err)
			}
		}
		t0 := time.Now()
		for i := range n {
			if _, err := tr.Root().Create(0, "f"+strconv.Itoa(i), tree.Owner{}, 0o600, nil); err != nil {
				b.Fatal(err)
			}
		}
		took := time.Since(t0)
		if j != nil && j.Err() != nil {
			b.Fatal(j.Err())
		}
		return took
	}
	var none, journaled time.Duration
	run(false) // untimed: the pages touched once
	for i := 0; b.Loop(); i++ {
		if i%2 == 0 {
			none += run(false)
			journaled += run(true)
		} else {
			journaled += run(true)
			none += run(false)
		}
	}
	rounds := float64(b.N)
	b.ReportMetric(n*rounds/none.Seconds(), "creates/s-none")
	b.ReportMetric(n*rounds/journaled.Seconds(), "creates/s-journal")
	b.ReportMetric(none.Seconds()/journaled.Seconds(), "journal/none")
}
