package identity

import (
	"crypto/x509"
	"sort"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Account names one (namespace, service account). SVIDs are minted once per
// account rather than per pod: pods of one account share a SPIFFE ID anyway,
// so one key and certificate per account is equivalent and cheaper.
type Account struct {
	Namespace      string
	ServiceAccount string
}

// DefaultServiceAccount is the account of a pod whose record names none
// (Kubernetes' own default for spec.serviceAccountName).
const DefaultServiceAccount = "default"

// AccountOf is the account of a pod in namespace ns running as service
// account sa (DefaultServiceAccount when sa is empty).
func AccountOf(ns, sa string) Account {
	if sa == "" {
		sa = DefaultServiceAccount
	}
	return Account{Namespace: ns, ServiceAccount: sa}
}

// Store holds the current SVIDs of the node's accounts and rotates them at
// half of their lifetime. It is safe for concurrent use.
type Store struct {
	ttl time.Duration
	now func() time.Time

	mu sync.Mutex
	ca *CA
	// anchors are the extra trust anchors of the bundle (SetCA).
	anchors []*x509.Certificate
	bundle  *x509bundle.Bundle
	// caGen counts signing CAs; gens is the generation that signed each
	// held SVID, so a new CA re-mints every SVID the old one signed.
	caGen   uint64
	gens    map[Account]uint64
	svids   map[Account]*x509svid.SVID
	version uint64
	changed chan struct{}
}

// NewStore returns a Store minting from ca with lifetime ttl; now is the clock.
func NewStore(ca *CA, ttl time.Duration, now func() time.Time) *Store {
	return &Store{
		ca: ca, bundle: ca.Bundle(), ttl: ttl, now: now,
		gens: map[Account]uint64{}, svids: map[Account]*x509svid.SVID{}, changed: make(chan struct{}),
	}
}

// SetCA replaces the signing CA and the extra trust anchors of the bundle
// (the bundle is ca plus anchors, each certificate once). A different CA
// makes every held SVID due at the next Sync, which re-mints it from ca; a
// changed bundle is signalled at once. It reports whether the signing CA or
// the bundle changed.
//
// A CA rotation without a gap: first every node trusts both CAs (anchors
// hold the new one), then each signs with the new CA (anchors hold the old
// one), and once every SVID of the old CA has expired the old anchor goes.
func (s *Store) SetCA(ca *CA, anchors []*x509.Certificate) bool {
	b := ca.Bundle()
	for _, c := range anchors {
		if !b.HasX509Authority(c) {
			b.AddX509Authority(c)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	newCA := !s.ca.Equal(ca)
	newBundle := !b.Equal(s.bundle)
	if !newCA && !newBundle {
		return false
	}
	if newCA {
		s.ca = ca
		s.caGen++
	}
	s.anchors, s.bundle = anchors, b
	if newBundle {
		s.signalLocked()
	}
	return true
}

func (s *Store) signalLocked() {
	s.version++
	close(s.changed)
	s.changed = make(chan struct{})
}

// SyncReport counts what one Sync did.
type SyncReport struct {
	// Minted counts SVIDs issued for accounts the store did not hold.
	Minted int
	// Rotated counts SVIDs replaced because half of their lifetime passed.
	Rotated int
	// Dropped counts SVIDs removed because their account is gone.
	Dropped int
	// Failed counts accounts whose SVID could not be minted or rotated
	// (a held SVID stays until it is dropped).
	Failed int
	// Held is the number of SVIDs held after the sync.
	Held int
}

// Sync makes the store hold exactly the SVIDs of want: it mints missing
// ones, rotates those past half of their lifetime and drops the others.
func (s *Store) Sync(want []Account) error {
	_, err := s.SyncReport(want)
	return err
}

// SyncReport is Sync that also reports what changed. The error is the first
// mint failure; the other accounts are still synced.
func (s *Store) SyncReport(want []Account) (SyncReport, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	keep := make(map[Account]bool, len(want))
	var r SyncReport
	var firstErr error
	for _, a := range want {
		if keep[a] {
			continue
		}
		keep[a] = true
		cur, held := s.svids[a]
		if held && !dueForRotation(cur, now) && s.gens[a] == s.caGen {
			continue
		}
		id, err := WorkloadID(s.ca.td, a.Namespace, a.ServiceAccount)
		if err == nil {
			var sv *x509svid.SVID
			if sv, err = s.ca.Mint(id, now, s.ttl); err == nil {
				s.svids[a], s.gens[a] = sv, s.caGen
				if held {
					r.Rotated++
				} else {
					r.Minted++
				}
				continue
			}
		}
		r.Failed++
		if firstErr == nil {
			firstErr = err
		}
	}
	for a := range s.svids {
		if !keep[a] {
			delete(s.svids, a)
			delete(s.gens, a)
			r.Dropped++
		}
	}
	if r.Minted+r.Rotated+r.Dropped > 0 {
		s.signalLocked()
	}
	r.Held = len(s.svids)
	return r, firstErr
}

// Bundle is the trust bundle: the signing CA and the extra anchors of
// SetCA. The same value is returned until the bundle changes; callers must
// not modify it.
func (s *Store) Bundle() *x509bundle.Bundle {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bundle
}

// dueForRotation reports whether half of sv's lifetime has passed at now.
func dueForRotation(sv *x509svid.SVID, now time.Time) bool {
	c := sv.Certificates[0]
	half := c.NotBefore.Add(c.NotAfter.Sub(c.NotBefore) / 2)
	return !now.Before(half)
}

// Snapshot returns the current SVIDs sorted by SPIFFE ID, and a channel
// closed at the next change.
func (s *Store) Snapshot() ([]*x509svid.SVID, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*x509svid.SVID, 0, len(s.svids))
	for _, sv := range s.svids {
		out = append(out, sv)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID.String() < out[j].ID.String() })
	return out, s.changed
}

// NextRotation is the earliest time an SVID becomes due for rotation (now
// for one signed by a replaced CA), or the zero time if the store is empty.
func (s *Store) NextRotation() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	var next time.Time
	for a, sv := range s.svids {
		if s.gens[a] != s.caGen {
			return s.now()
		}
		c := sv.Certificates[0]
		half := c.NotBefore.Add(c.NotAfter.Sub(c.NotBefore) / 2)
		if next.IsZero() || half.Before(next) {
			next = half
		}
	}
	return next
}
