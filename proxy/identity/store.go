package identity

import (
	"fmt"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Store holds the SVIDs and the trust bundles a provider received and
// serves them as a Source and an x509bundle.Source; both providers keep
// their state in one. It is safe for concurrent use. Build it with
// NewStore.
type Store struct {
	now func() time.Time

	mu      sync.Mutex
	svids   map[spiffeid.ID]*x509svid.SVID
	bundles *x509bundle.Set
	changed chan struct{}
}

var _ Source = (*Store)(nil)

// NewStore returns an empty Store; now is the clock SVID expiry is judged
// by (time.Now when nil).
func NewStore(now func() time.Time) *Store {
	if now == nil {
		now = time.Now
	}
	return &Store{now: now, svids: map[spiffeid.ID]*x509svid.SVID{}, changed: make(chan struct{})}
}

// SVID implements Source: the SVID of id if held and not expired.
func (s *Store) SVID(id spiffeid.ID) (*x509svid.SVID, bool) {
	s.mu.Lock()
	sv, ok := s.svids[id]
	s.mu.Unlock()
	if !ok || !s.now().Before(sv.Certificates[0].NotAfter) {
		return nil, false
	}
	return sv, true
}

// Bundle implements Source: the bundle of the trust domain of the SVIDs
// held, or, while none is held, the first bundle received.
func (s *Store) Bundle() *x509bundle.Bundle {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bundles == nil {
		return nil
	}
	for id := range s.svids {
		if b, ok := s.bundles.Get(id.TrustDomain()); ok {
			return b
		}
	}
	if all := s.bundles.Bundles(); len(all) > 0 {
		return all[0]
	}
	return nil
}

// GetX509BundleForTrustDomain implements x509bundle.Source.
func (s *Store) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bundles == nil {
		return nil, fmt.Errorf("failed to find the bundle of trust domain %q: none received yet", td)
	}
	return s.bundles.GetX509BundleForTrustDomain(td)
}

// IDs returns the identities whose SVIDs are held (expired ones included).
func (s *Store) IDs() []spiffeid.ID {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]spiffeid.ID, 0, len(s.svids))
	for id := range s.svids {
		out = append(out, id)
	}
	return out
}

// Changed returns a channel closed at the next change of the SVIDs or the
// bundles.
func (s *Store) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

// ReplaceSVIDs replaces every SVID held with m (the Store keeps m); it
// returns how many were held before.
func (s *Store) ReplaceSVIDs(m map[spiffeid.ID]*x509svid.SVID) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.svids)
	s.svids = m
	s.notifyLocked()
	return n
}

// DropSVIDs drops every SVID held and returns how many there were.
func (s *Store) DropSVIDs() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.svids)
	if n > 0 {
		s.svids = map[spiffeid.ID]*x509svid.SVID{}
		s.notifyLocked()
	}
	return n
}

// PutSVID sets the SVID of sv.ID.
func (s *Store) PutSVID(sv *x509svid.SVID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.svids[sv.ID] = sv
	s.notifyLocked()
}

// DeleteSVID drops the SVID of id, if held.
func (s *Store) DeleteSVID(id spiffeid.ID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.svids[id]; ok {
		delete(s.svids, id)
		s.notifyLocked()
	}
}

// SetBundles replaces the bundles; with onlyFirst it does so only while
// none is held.
func (s *Store) SetBundles(set *x509bundle.Set, onlyFirst bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if onlyFirst && s.bundles != nil {
		return
	}
	s.bundles = set
	s.notifyLocked()
}

// notifyLocked signals a change; s.mu is held.
func (s *Store) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}
