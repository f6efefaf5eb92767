package mount

import (
	"io"
	"log/slog"
	"os"
	"testing"

	"mrfs/buffer"
	"mrfs/internal/config"
	"mrfs/store"
	"mrfs/tree"
)

// TestCrashedStoreSwept: a daemon taking over after a crash removes the
// store's files no node of the journal's namespace names (made and not
// yet journaled, or removed and not yet freed), and keeps the others.
func TestCrashedStoreSwept(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the tmpfs store needs CAP_SYS_ADMIN (fsopen): run as root")
	}
	cfg := config.Default().Buffers
	s, err := store.NewTmpfs(store.TmpfsOptions{Size: 1 << 20, Huge: "never"})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []uint64{1, 2} {
		if _, err := s.Create(id); err != nil {
			t.Fatal(err)
		}
	}
	root, err := s.(store.Lasting).Handover()
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	inh := &inherited{store: root, crashed: true, state: restartState{Tree: tree.State{
		Nodes: []tree.NodeState{{Ino: 2, File: &buffer.Kept{File: 1}}}}}}
	a, _, err := openStore(cfg, inh, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, err := a.(store.Lasting).Open(1); err != nil {
		t.Errorf("the file a node names: %v", err)
	}
	if _, err := a.(store.Lasting).Open(2); err == nil {
		t.Errorf("the file no node names is still in the store")
	}
}
