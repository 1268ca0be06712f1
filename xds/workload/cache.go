package workload

import (
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// wildcard is the resource name that subscribes to everything.
const wildcard = "*"

// Cache is everything the Server asks of the index: the seam between cache
// and server (go-control-plane's ConfigWatcher). The server keeps one
// Subscription per stream and asks the cache what to send for it; it never
// sees the cache's lock or maps. *Index implements it.
type Cache interface {
	// TypeURL is the type of the resources the cache holds.
	TypeURL() string
	// Subscribe registers a subscription (empty: nothing subscribed yet)
	// that signals notify (without blocking: give it a buffer of one) when
	// a resource changes; cancel unregisters it. Several subscriptions
	// (one per type of an ADS stream) may share one notify channel.
	Subscribe(notify chan struct{}) (sub *Subscription, cancel func())
	// DeltaResponse selects a delta response for sub and consumes its
	// pending changes; see Index.DeltaResponse.
	DeltaResponse(sub *Subscription, added []string, addedWildcard bool, known Known) Delta
	// SotWResponse selects the full state sub subscribes to.
	SotWResponse(sub *Subscription) SotW
	// ObserveSize calls fn with the number of resources now and after every
	// change that alters it.
	ObserveSize(fn func(int))
}

var _ Cache = (*Index)(nil)

// Known are the resource versions a delta client says it holds: its first
// request's initial_resource_versions in wire form, as the server's codec
// hands them over: the request's fields, of which every
// initial_resource_versions field is one entry, in the client's order. No
// map and no string per entry is built (on a reconnect at 70k workloads
// that was most of the cost), and an index whose full states the client
// kept in order reads its slots in order too (Index.selectKnown). KnownMap
// makes one from a map. The zero Known holds nothing.
type Known struct {
	wire []byte // validated request fields (decodeDelta)
	n    int    // entries in wire
}

// KnownMap returns the Known of a map from resource name to version.
func KnownMap(m map[string]string) Known {
	var b []byte
	for name, version := range m {
		b = appendKnownEntry(b, name, version)
	}
	return Known{wire: b, n: len(m)}
}

// appendKnownEntry appends name and version as an initial_resource_versions
// field (a map entry {1: name, 2: version}).
func appendKnownEntry(b []byte, name, version string) []byte {
	b = protowire.AppendTag(b, fieldDeltaReqInitialVersions, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(protowire.SizeTag(1)+protowire.SizeBytes(len(name))+protowire.SizeTag(2)+protowire.SizeBytes(len(version))))
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, name)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	return protowire.AppendString(b, version)
}

// Len is the number of entries (a name the wire repeats counts each time).
func (k Known) Len() int { return k.n }

// each calls fn for every entry in wire order, with name and version
// pointing into the wire (fn must not keep them); for a repeated name the
// last entry is the one that counts (protobuf map semantics).
func (k Known) each(fn func(name, version []byte)) {
	for b := k.wire; len(b) > 0; {
		entry, isEntry, n := nextField(b)
		if n < 0 {
			return // never: decodeDelta validated the wire
		}
		if isEntry {
			if name, version, err := mapEntry(entry); err == nil {
				fn(name, version)
			}
		}
		b = b[n:]
	}
}

// asMap returns the entries as a map (the last entry of a repeated name).
func (k Known) asMap() map[string]string {
	m := make(map[string]string, k.n)
	k.each(func(name, version []byte) { m[string(name)] = string(version) })
	return m
}

// Delta is what a delta response carries: resources to send (shared and
// read-only) and names to remove.
type Delta struct {
	// Resources are the resources to send.
	Resources []*Resource
	// Removed are names the client must drop (or that do not exist).
	Removed []string
	// Revision is the index revision the selection was made at.
	Revision uint64
	// Since is the time of the oldest change included (zero: none).
	Since time.Time
}

// SotW is what a state-of-the-world response carries: every subscribed
// resource that exists.
type SotW struct {
	// Resources are the resources, shared and read-only (for wildcard
	// subscriptions, one list shared per revision).
	Resources []*Resource
	// Revision is the index revision the list was made at.
	Revision uint64
}

// Subscription is one stream's subscription, Delta or SotW: wildcard or a
// set of names, and the names that changed in the index since the stream
// last asked (coalesced). The index adds changes; the stream's goroutine
// owns the rest.
type Subscription struct {
	wildcard bool
	names    map[string]struct{}

	mu      sync.Mutex
	pending map[string]struct{}
	since   time.Time // time of the oldest pending change
	ch      chan struct{}
}

// Changed fires (coalesced) after the index changed.
func (s *Subscription) Changed() <-chan struct{} { return s.ch }

// Wildcard reports whether the subscription is to every resource.
func (s *Subscription) Wildcard() bool { return s.wildcard }

// Subscribed reports whether name is subscribed to.
func (s *Subscription) Subscribed(name string) bool {
	if s.wildcard {
		return true
	}
	_, ok := s.names[name]
	return ok
}

// ApplyDelta applies a delta request's subscribe and unsubscribe lists
// ("*" is the wildcard; an empty first subscription is the legacy wildcard)
// and returns what became newly subscribed: those need an answer.
func (s *Subscription) ApplyDelta(first bool, subscribe, unsubscribe []string) (added []string, addedWildcard bool) {
	if first && len(subscribe) == 0 {
		subscribe = []string{wildcard}
	}
	for _, n := range subscribe {
		if n == wildcard {
			if !s.wildcard {
				s.wildcard, addedWildcard = true, true
			}
			continue
		}
		if _, ok := s.names[n]; !ok {
			s.names[n] = struct{}{}
			added = append(added, n)
		}
	}
	for _, n := range unsubscribe {
		if n == wildcard {
			s.wildcard = false
			continue
		}
		delete(s.names, n)
	}
	return added, addedWildcard
}

// SetSotW replaces the subscription with a SotW request's names (none, or
// "*", is the wildcard) and reports whether it differs from before.
func (s *Subscription) SetSotW(resourceNames []string) bool {
	wild, names := false, make(map[string]struct{}, len(resourceNames))
	for _, n := range resourceNames {
		if n == wildcard {
			wild = true
		} else {
			names[n] = struct{}{}
		}
	}
	if len(names) == 0 {
		wild = true
	}
	changed := wild != s.wildcard || !sameSet(names, s.names)
	s.wildcard, s.names = wild, names
	return changed
}

// TakeChanged consumes the pending changes and reports whether any of them
// is subscribed to, and the time of the oldest change.
func (s *Subscription) TakeChanged() (bool, time.Time) {
	pending, since := s.take()
	for name := range pending {
		if s.Subscribed(name) {
			return true, since
		}
	}
	return false, time.Time{}
}

// take returns and clears the pending names and the time of the oldest.
func (s *Subscription) take() (map[string]struct{}, time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.pending) == 0 {
		return nil, time.Time{}
	}
	p, since := s.pending, s.since
	s.pending = make(map[string]struct{})
	return p, since
}

// notify records a change of name; called with the index locked.
func (s *Subscription) notify(name string, now time.Time) {
	s.mu.Lock()
	if len(s.pending) == 0 {
		s.since = now
	}
	s.pending[name] = struct{}{}
	s.mu.Unlock()
	select {
	case s.ch <- struct{}{}:
	default:
	}
}

// Watch is Subscribe with a channel of its own (Subscription.Changed).
func (x *Index) Watch() (*Subscription, func()) { return x.Subscribe(make(chan struct{}, 1)) }

// Subscribe implements Cache.
func (x *Index) Subscribe(notify chan struct{}) (*Subscription, func()) {
	s := &Subscription{
		names:   make(map[string]struct{}),
		pending: make(map[string]struct{}),
		ch:      notify,
	}
	x.mu.Lock()
	x.watchers[s] = struct{}{}
	x.mu.Unlock()
	return s, func() {
		x.mu.Lock()
		delete(x.watchers, s)
		x.mu.Unlock()
	}
}

// ObserveSize implements Cache.
func (x *Index) ObserveSize(fn func(int)) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.onSize = fn
	fn(len(x.byName))
}

func (x *Index) notifyLocked(name string, now time.Time) {
	for s := range x.watchers {
		s.notify(name, now)
	}
}

// DeltaResponse selects, in one pass under the read lock, the next delta
// response of sub: its pending changes it subscribes to, plus the newly
// subscribed names (added; every resource for a new wildcard), skipping
// resources whose version the client already has (known: the first
// request's initial_resource_versions). A newly subscribed name that does
// not exist, and a known name we no longer have, are returned as Removed.
// Pending changes are sent whatever the client had.
//
// A new wildcard with known versions costs one lookup per known entry (in
// wire order, no map of them is built) and, only when the client lacks
// some workloads, one more pass over the index: a reconnect's work is the
// client's list plus the difference.
func (x *Index) DeltaResponse(sub *Subscription, added []string, addedWildcard bool, known Known) Delta {
	var d Delta
	seen := make(map[string]struct{}, len(added))
	var knownMap map[string]string
	if !addedWildcard && known.Len() > 0 {
		knownMap = known.asMap()
	}
	send := func(name string) {
		if _, dup := seen[name]; dup {
			return
		}
		seen[name] = struct{}{}
		r := x.getLocked(name)
		switch {
		case r != nil && knownMap[name] != r.Version:
			d.Resources = append(d.Resources, r)
		case r == nil:
			d.Removed = append(d.Removed, name) // gone, or never existed
		}
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	pending, since := sub.take()
	d.Since = since
	switch {
	case addedWildcard && known.Len() > 0:
		x.selectKnown(&d, known, seen)
	case addedWildcard:
		d.Resources = x.allLocked()
	default:
		for _, name := range added {
			send(name)
		}
	}
	knownMap = nil // pending changes are sent whatever the client had
	for name := range pending {
		if !sub.Subscribed(name) {
			continue
		}
		if addedWildcard {
			// The wildcard pass sent the current state; only removals are left.
			if _, ok := x.byName[name]; !ok {
				send(name)
			}
			continue
		}
		send(name)
	}
	d.Revision = x.rev
	return d
}

// Marks of selectKnown, per index slot.
const (
	unknown uint8 = iota // the client did not name it
	held                 // the client holds this version
	stale                // the client holds another version
)

// selectKnown adds to d what a new wildcard subscription holding known
// lacks: every resource whose version differs or that known does not name,
// and every known name we do not have (as Removed, also added to seen).
// x.mu is held (read).
//
// Each entry is first tried at the slot after the previous entry's: a
// client that kept the versions in the order the full state came (slot
// order, allLocked) sends them back in that order, so an unchanged entry
// costs a sequential read of the slot table and of the resource's name
// instead of a map lookup. Any other entry takes one map lookup; after a
// few misses in a row (a client of another order) only every 64th entry
// is tried in place. The order only makes the comparison cheaper, never
// different.
func (x *Index) selectKnown(d *Delta, known Known, seen map[string]struct{}) {
	marks := make([]uint8, len(x.bySlot))
	named := 0 // distinct served names the client named
	next := 0  // the slot after the previous entry's
	misses, i := 0, 0
	known.each(func(name, version []byte) {
		h, valid := parseVersion(version)
		i++
		e := slotted{slot: -1}
		if valid && next < len(x.bySlot) && (misses < 4 || i%64 == 0) {
			if r := x.bySlot[next]; r != nil && r.hash == h && r.Name == string(name) {
				e = slotted{hash: h, slot: next}
				misses = 0
			} else {
				misses++
			}
		}
		if e.slot < 0 {
			var ok bool
			if e, ok = x.byName[string(name)]; !ok {
				if _, dup := seen[string(name)]; !dup {
					n := string(name)
					seen[n] = struct{}{}
					d.Removed = append(d.Removed, n)
				}
				return
			}
		}
		next = e.slot + 1
		m := stale
		if valid && h == e.hash {
			m = held
		}
		switch marks[e.slot] {
		case unknown:
			named++
			if m == stale {
				d.Resources = append(d.Resources, x.bySlot[e.slot])
			}
		case held:
			if m == stale {
				d.Resources = append(d.Resources, x.bySlot[e.slot]) // a repeated name: the last entry counts
			}
		case stale:
			if m == held {
				r := x.bySlot[e.slot]
				d.Resources = slices.DeleteFunc(d.Resources, func(s *Resource) bool { return s == r })
			}
		}
		marks[e.slot] = m
	})
	if named == len(x.byName) {
		return
	}
	for slot, r := range x.bySlot {
		if r != nil && marks[slot] == unknown {
			d.Resources = append(d.Resources, r)
		}
	}
}

// allLocked returns every served resource in slot order; x.mu is held.
func (x *Index) allLocked() []*Resource {
	out := make([]*Resource, 0, len(x.byName))
	for _, r := range x.bySlot {
		if r != nil {
			out = append(out, r)
		}
	}
	return out
}

// parseVersion reads a version as the index spells them (Resource.Version:
// lowercase hex, no leading zeros, at most 16 digits); anything else is
// not a version the index issued (false), so it equals none. A reconnect
// parses tens of thousands: one table lookup per digit, no branch on it.
func parseVersion(v []byte) (uint64, bool) {
	if len(v) == 0 || len(v) > 16 || (v[0] == '0' && len(v) > 1) {
		return 0, false
	}
	var h uint64
	var bad uint8
	for _, c := range v {
		d := hexDigits[c]
		bad |= d
		h = h<<4 | uint64(d&0xf)
	}
	if bad > 0xf {
		return 0, false
	}
	return h, true
}

// hexDigits maps a lowercase hex digit to its value and every other byte
// to 0xff.
var hexDigits = func() (t [256]uint8) {
	for i := range t {
		t[i] = 0xff
	}
	for i, c := range "0123456789abcdef" {
		t[c] = uint8(i)
	}
	return t
}()

// SotWResponse selects every resource sub subscribes to. Wildcard
// subscriptions share one list per index revision.
func (x *Index) SotWResponse(sub *Subscription) SotW {
	if sub.Wildcard() {
		return x.sotwAll()
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	out := SotW{Revision: x.rev}
	for name := range sub.names {
		if r := x.getLocked(name); r != nil {
			out.Resources = append(out.Resources, r)
		}
	}
	return out
}

// sotwAll returns every resource, listed once per revision and shared by
// all wildcard SotW streams.
func (x *Index) sotwAll() SotW {
	x.mu.RLock()
	rev := x.rev
	x.sotwMu.Lock()
	defer x.sotwMu.Unlock()
	if x.sotwList != nil && x.sotwRev == rev {
		x.mu.RUnlock()
		return SotW{Resources: x.sotwList, Revision: rev}
	}
	list := x.allLocked()
	x.mu.RUnlock()
	x.sotwRev, x.sotwList = rev, list
	return SotW{Resources: list, Revision: rev}
}

func sameSet(a, b map[string]struct{}) bool {
	if len(a) != len(b) {
		return false
	}
	for k := range a {
		if _, ok := b[k]; !ok {
			return false
		}
	}
	return true
}
