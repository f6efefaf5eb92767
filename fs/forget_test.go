package fs

import (
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/tree"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// newTestTree is a tree on the soft backend, closed at the test's end.
func newTestTree(t *testing.T) *tree.Tree {
	t.Helper()
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	mgr := buffer.NewManager(dev, buffer.Options{Allowed: verbs.LocalWrite}, nil)
	t.Cleanup(func() { mgr.Close() })
	tr, err := tree.New(mgr, tree.Options{DefaultSize: 4096, DefaultAccess: verbs.LocalWrite}, verbs.LocalWrite, tree.Owner{}, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// TestForgetterPause: pause waits for a drop under way (the kernel's
// answer to it may wait for a request the daemon is still to answer: an
// upgrade pauses before it holds the requests), and no name is dropped
// until resume.
func TestForgetterPause(t *testing.T) {
	tr := newTestTree(t)
	var files []*tree.File
	for _, name := range []string{"a", "b"} {
		f, err := tr.Root().Create(0, name, tree.Owner{}, 0o600, nil)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	dropped, release := make(chan string, 2), make(chan struct{})
	q := newForgetter(func(_ *tree.Dir, name string) {
		dropped <- name
		<-release // the kernel waits for a directory's lock
	})
	defer q.stop()
	wait := forgetAfter + 5*time.Second
	q.add(files[0])
	select {
	case <-dropped:
	case <-time.After(wait):
		t.Fatal("a was not dropped")
	}
	paused := make(chan struct{})
	go func() {
		q.pause()
		close(paused)
	}()
	select {
	case <-paused:
		t.Fatal("pause returned while a drop was under way")
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	select {
	case <-paused:
	case <-time.After(wait):
		t.Fatal("pause did not return once the drop under way ended")
	}
	q.add(files[1])
	select {
	case name := <-dropped:
		t.Fatalf("%s dropped while paused", name)
	case <-time.After(forgetAfter + 500*time.Millisecond):
	}
	q.resume()
	select {
	case name := <-dropped:
		if name != "b" {
			t.Errorf("dropped %s after resume, want b", name)
		}
	case <-time.After(wait):
		t.Fatal("b was not dropped after resume")
	}
}
