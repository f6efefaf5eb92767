package gate

import (
	"fmt"
	"net/netip"
	"sync"
	"time"
)

// The rule against guessing, in one place: a source network (a peer's
// address cut to an IPv4 /24 or an IPv6 /64, configurable) whose attempts
// keep failing (a wrong PD token, a directory that is not there, a hello
// that breaks the format or does not come in time, a connection closed to
// make room for newer ones, and on the soft transport an operation
// refused with IBV_WC_REM_ACCESS_ERR) is refused every connection for a
// while, and the log says so at warn, once a minute per network. A token
// is 128 random bits, so this is for the rkeys and names behind it and
// for the log: nobody guesses quietly. Counting networks rather than
// addresses matters because one host may own many: every user of a
// machine owns 127.0.0.0/8, 16 million addresses. So a connection from
// this machine whose owner the transport learns (Peer.HasUID) counts by
// that uid instead: one local user's bad tokens do not lock out every
// other local peer.
//
// The table never forgets a network that is refused or has failed within
// the window to make room for another; when it holds nothing else, a
// network it has no entry for is refused (it cannot be counted), and the
// log says so at warn, once a minute.
const (
	failLimit    = 10          // failures within failWindow that get a network refused (remote.max_failures)
	failWindow   = time.Minute // how far back failures count
	failBlock    = time.Minute // how long the network is refused then
	failPrefixV4 = 24          // remote.failure_prefix_v4
	failPrefixV6 = 64          // remote.failure_prefix_v6
	// maxSources bounds the networks remembered: every /24 of
	// 127.0.0.0/8, so that no local user can fill it; about 13 MiB when
	// full (TestFailuresTableHoldsLoopback).
	maxSources = 1 << 16
)

type failures struct {
	limit         int
	window, block time.Duration
	v4, v6        int // prefix lengths
	max           int // maxSources; smaller in tests
	epoch         time.Time

	mu      sync.Mutex // guards: sources, oldest, newest, fullWarned, warnedFull and every source
	sources map[sourceKey]*source
	// oldest and newest end the list of sources by their last failure:
	// oldest is the one the table may forget first.
	oldest, newest *source
	fullWarned     tick // when the log last said the table is full, if warnedFull
	warnedFull     bool
}

// tick is a time as nanoseconds since failures.epoch (monotonic): 8
// bytes where a time.Time takes 24, for a table of 65536 entries.
type tick int64

// sourceKey is what failures count by: a network, or a local uid.
type sourceKey struct {
	net   netip.Prefix // zero for a uid
	uid   uint32
	byUID bool
}

// String names the source for the log and the peer.
func (k sourceKey) String() string {
	if k.byUID {
		return fmt.Sprintf("uid %d on this machine", k.uid)
	}
	return k.net.String()
}

// source is what is remembered of one network.
type source struct {
	net           sourceKey
	older, newer  *source
	recent        []tick // its failures within the window, oldest first
	until, warned tick   // refused until then, if blocked; when the log last said so, if warnedOnce
	blocked       bool
	warnedOnce    bool
}

// verdict is the limiter's answer about one peer.
type verdict struct {
	refused bool
	// warn: say so at warn now (rate-limited); full: refused because the
	// table has no room for its network.
	warn, full bool
	net        sourceKey
}

func newFailures(p Policy) *failures {
	f := &failures{limit: p.FailLimit, window: p.FailWindow, block: p.FailBlock, v4: p.FailPrefixV4, v6: p.FailPrefixV6,
		max: maxSources, epoch: time.Now(), sources: map[sourceKey]*source{}}
	if f.limit == 0 {
		f.limit = failLimit
	}
	if f.window <= 0 {
		f.window = failWindow
	}
	if f.block <= 0 {
		f.block = failBlock
	}
	if f.v4 <= 0 || f.v4 > 32 {
		f.v4 = failPrefixV4
	}
	if f.v6 <= 0 || f.v6 > 128 {
		f.v6 = failPrefixV6
	}
	return f
}

// network is what peer counts in: its uid for a local peer whose owner
// is known, else its source network (an IPv4-mapped IPv6 address counts
// as the IPv4 address it is).
func (f *failures) network(peer Peer) sourceKey {
	if peer.HasUID {
		return sourceKey{uid: peer.UID, byUID: true}
	}
	addr := peer.Addr.Unmap()
	bits := f.v6
	if addr.Is4() {
		bits = f.v4
	}
	p, _ := addr.Prefix(bits) // bits fit; the zero Addr gives the zero Prefix
	return sourceKey{net: p}
}

func (f *failures) tick(now time.Time) tick { return tick(now.Sub(f.epoch)) }

// failed records a failure of peer at now and says whether its source
// is refused from now on.
func (f *failures) failed(peer Peer, now time.Time) verdict {
	if f.limit < 0 {
		return verdict{} // the rule is off
	}
	n, t := f.network(peer), f.tick(now)
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.sources[n]
	if s == nil {
		if !f.roomLocked(t) {
			return f.fullLocked(n, t)
		}
		s = &source{net: n}
		f.sources[n] = s
	} else {
		f.unlinkLocked(s)
	}
	f.linkNewestLocked(s)
	keep := s.recent[:0]
	for _, r := range s.recent {
		if t-r < tick(f.window) {
			keep = append(keep, r)
		}
	}
	s.recent = append(keep, t)
	if len(s.recent) >= f.limit {
		s.until, s.blocked = t+tick(f.block), true
		s.recent = s.recent[:0]
	}
	return f.verdictLocked(s, t)
}

// refused says whether peer's source is refused at now.
func (f *failures) refused(peer Peer, now time.Time) verdict {
	if f.limit < 0 {
		return verdict{}
	}
	n, t := f.network(peer), f.tick(now)
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.sources[n]
	if s == nil {
		if len(f.sources) >= f.max && !f.forgettable(f.oldest, t) {
			return f.fullLocked(n, t)
		}
		return verdict{net: n}
	}
	return f.verdictLocked(s, t)
}

func (f *failures) verdictLocked(s *source, t tick) verdict {
	v := verdict{net: s.net}
	if !s.blocked || t >= s.until {
		return v
	}
	v.refused = true
	if !s.warnedOnce || t-s.warned >= tick(time.Minute) {
		s.warned, s.warnedOnce, v.warn = t, true, true
	}
	return v
}

// fullLocked is the verdict on network n that the table has no room for:
// refused, and said at warn once a minute for all such networks.
func (f *failures) fullLocked(n sourceKey, t tick) verdict {
	v := verdict{refused: true, full: true, net: n}
	if !f.warnedFull || t-f.fullWarned >= tick(time.Minute) {
		f.fullWarned, f.warnedFull, v.warn = t, true, true
	}
	return v
}

// forgettable: s may be forgotten at t, being neither refused nor failed
// within the window.
func (f *failures) forgettable(s *source, t tick) bool {
	if s.blocked && t < s.until {
		return false
	}
	return len(s.recent) == 0 || t-s.recent[len(s.recent)-1] >= tick(f.window)
}

// roomLocked makes room for one more source if the table is full, by
// forgetting the one whose last failure is oldest, if it may be
// forgotten. A later source in the list might be forgettable while the
// oldest is not (when the block outlasts the window): then the table
// refuses, erring on the closed side.
func (f *failures) roomLocked(t tick) bool {
	if len(f.sources) < f.max {
		return true
	}
	s := f.oldest
	if s == nil || !f.forgettable(s, t) {
		return false
	}
	f.unlinkLocked(s)
	delete(f.sources, s.net)
	return true
}

func (f *failures) unlinkLocked(s *source) {
	if s.older != nil {
		s.older.newer = s.newer
	} else {
		f.oldest = s.newer
	}
	if s.newer != nil {
		s.newer.older = s.older
	} else {
		f.newest = s.older
	}
	s.older, s.newer = nil, nil
}

func (f *failures) linkNewestLocked(s *source) {
	s.older = f.newest
	if f.newest != nil {
		f.newest.newer = s
	} else {
		f.oldest = s
	}
	f.newest = s
}
