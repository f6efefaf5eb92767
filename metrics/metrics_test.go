package metrics

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"mrfs/buffer"
	"mrfs/store"
	"mrfs/verbs"
	"mrfs/verbs/soft"
)

// A real scrape over HTTP shows the manager's state and the counted
// events.
func TestScrape(t *testing.T) {
	dev, err := soft.New(soft.Options{}).Open("")
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	m := New()
	mgr := buffer.NewManager(dev, buffer.Options{Store: store.NewMemfd(), Allowed: verbs.LocalWrite, MaxPinned: 1 << 20, Events: m}, nil)
	defer mgr.Close()
	m.Watch(mgr)
	d, err := mgr.NewDomain(verbs.LocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	b, err := mgr.Create(d, 8192, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Resize(context.Background(), 2<<20); err == nil {
		t.Fatal("a resize past max_pinned succeeded")
	}
	m.Admitted()
	m.Completed(verbs.WCRemAccessErr)
	m.Refused("allow_from")

	srv, addr, err := m.Serve("127.0.0.1:0", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr.String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	text := string(body)
	for _, want := range []string{
		"mrfs_buffers 1\n",
		"mrfs_pds 1\n",
		"mrfs_registered_bytes 8192\n",
		"mrfs_pinned_bytes 8192\n",
		`mrfs_user_pinned_bytes{uid="1000"} 8192` + "\n",
		`mrfs_user_buffers{uid="1000"} 1` + "\n",
		"mrfs_registrations_total 1\n",
		"mrfs_registration_seconds_count 1\n",
		`mrfs_limit_hits_total{limit="max_pinned"} 1` + "\n",
		`mrfs_limit{limit="max_pinned"} 1.048576e+06` + "\n",
		"mrfs_remote_connections 1\n",
		`mrfs_remote_completions_total{status="IBV_WC_REM_ACCESS_ERR"} 1` + "\n",
		`mrfs_remote_refused_total{reason="allow_from"} 1` + "\n",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the scrape lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("scrape:\n%s", text)
	}
}
