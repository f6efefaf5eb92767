package remote

import (
	"net/netip"
	"sync"
	"time"
)

// The rule against guessing, in one place: a source (a peer's address)
// whose attempts keep failing (a wrong PD token; on the soft transport,
// an operation refused with IBV_WC_REM_ACCESS_ERR) is refused every
// connection for a while, and the log says so at warn, once a minute per
// source. A token is 128 random bits, so this is for the rkeys behind
// it and for the log: nobody guesses quietly.
const (
	failLimit  = 10          // failures within failWindow that get a source refused (remote.max_failures)
	failWindow = time.Minute // how far back failures count
	failBlock  = time.Minute // how long the source is refused then
	// maxSources bounds the sources remembered; past it those with
	// nothing recent go first, then any.
	maxSources = 4096
)

type failures struct {
	limit         int
	window, block time.Duration

	mu      sync.Mutex // guards: sources
	sources map[netip.Addr]*source
}

// source is what is remembered of one address.
type source struct {
	recent []time.Time // its failures within the window, oldest first
	until  time.Time   // refused until then
	warned time.Time   // when the log last said so
}

func newFailures(p Policy) *failures {
	f := &failures{limit: p.FailLimit, window: p.FailWindow, block: p.FailBlock, sources: map[netip.Addr]*source{}}
	if f.limit == 0 {
		f.limit = failLimit
	}
	if f.window <= 0 {
		f.window = failWindow
	}
	if f.block <= 0 {
		f.block = failBlock
	}
	return f
}

// failed records a failure of addr at now. It returns whether addr is
// refused from now on, and whether to warn of it (once a minute).
func (f *failures) failed(addr netip.Addr, now time.Time) (refused, warn bool) {
	if f.limit < 0 {
		return false, false // the rule is off
	}
	addr = addr.Unmap()
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.sources[addr]
	if s == nil {
		f.forgetLocked(now)
		s = &source{}
		f.sources[addr] = s
	}
	keep := s.recent[:0]
	for _, t := range s.recent {
		if now.Sub(t) < f.window {
			keep = append(keep, t)
		}
	}
	s.recent = append(keep, now)
	if len(s.recent) >= f.limit {
		s.until = now.Add(f.block)
		s.recent = s.recent[:0]
	}
	return f.refusedLocked(s, now)
}

// refused says whether addr is refused at now, and whether to warn.
func (f *failures) refused(addr netip.Addr, now time.Time) (refused, warn bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.sources[addr.Unmap()]
	if s == nil {
		return false, false
	}
	return f.refusedLocked(s, now)
}

func (f *failures) refusedLocked(s *source, now time.Time) (refused, warn bool) {
	if !now.Before(s.until) {
		return false, false
	}
	if now.Sub(s.warned) >= time.Minute {
		s.warned = now
		return true, true
	}
	return true, false
}

// forgetLocked makes room for a new source: those with nothing recent
// and not refused go, and if that is not enough, any.
func (f *failures) forgetLocked(now time.Time) {
	if len(f.sources) < maxSources {
		return
	}
	for a, s := range f.sources {
		if !now.Before(s.until) && (len(s.recent) == 0 || now.Sub(s.recent[len(s.recent)-1]) >= f.window) {
			delete(f.sources, a)
		}
	}
	for a := range f.sources {
		if len(f.sources) < maxSources {
			break
		}
		delete(f.sources, a)
	}
}
