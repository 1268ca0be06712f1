// Package authz decides, at L4, whether a connection reaches a workload,
// from istio.security.Authorization resources exactly as ztunnel does (see
// README.md). It is pure: no I/O, no Kubernetes types; the proxy feeds it
// from workload discovery and asks it once per connection.
package authz

import (
	"fmt"
	"net/netip"
	"strings"
	"sync"

	"aether.io/node/api/istio/security"
)

// Conn is what a decision knows of a connection.
type Conn struct {
	// Source is the client's address.
	Source netip.Addr
	// Identity is the verified SPIFFE ID of the client
	// (spiffe://<trust domain>/ns/<ns>/sa/<sa>); empty for plaintext.
	Identity string
	// Dest is the address and port the client reaches (the app's).
	Dest netip.AddrPort
}

// Target is the destination workload: its namespace and the keys
// (<namespace>/<name>) of the selector-scoped policies it is bound to
// (istio.workload.Workload.authorization_policies).
type Target struct {
	Namespace string
	Policies  []string
}

// Decision is the outcome of Decide.
type Decision struct {
	// Allow is the verdict.
	Allow bool
	// Policy is the key of the policy that decided (the DENY that matched,
	// or the ALLOW that matched); empty when no policy decided.
	Policy string
	// Reason says why: ReasonDenied, ReasonNoAllowMatch, ReasonAllowed,
	// ReasonNoPolicy.
	Reason string
	// DryRun is the key of a dry-run policy whose enforcement would have
	// changed the verdict (logged, never enforced); empty when none.
	DryRun string
}

// Reasons of a Decision.
const (
	// ReasonDenied: a DENY policy matched.
	ReasonDenied = "denied_by_policy"
	// ReasonNoAllowMatch: ALLOW policies select the workload and none matched.
	ReasonNoAllowMatch = "no_allow_match"
	// ReasonAllowed: an ALLOW policy matched.
	ReasonAllowed = "allowed_by_policy"
	// ReasonNoPolicy: no ALLOW policy selects the workload and no DENY matched.
	ReasonNoPolicy = "no_policy"
)

// Table holds the policies served and decides with them. It is safe for
// concurrent use; Decide takes a read lock and allocates nothing.
type Table struct {
	mu     sync.RWMutex
	byKey  map[string]*policy
	global policySet
	byNS   map[string]*policySet
}

// policySet is the policies of one scope, indexed by the source namespaces
// a policy can match at all: a policy every group of which requires the
// source's namespace to be one of a few exact values is evaluated only for
// connections from those namespaces (a policy of 1,000 mesh-wide ones that
// names another namespace costs a connection nothing); the others are
// evaluated for every connection.
type policySet struct {
	any    []*policy
	bySrc  map[string][]*policy // by source namespace
	byPrin map[string][]*policy // by source principal
	allows int                  // enforced ALLOW policies, evaluated or not
	// dryAllows are the dry-run ALLOW policies (evaluated or not: had one
	// been enforced, a connection none matches would be denied).
	dryAllows []*policy
}

func drop(ps []*policy, p *policy) []*policy {
	out := ps[:0]
	for _, q := range ps {
		if q != p {
			out = append(out, q)
		}
	}
	return out
}

func (s *policySet) add(p *policy) {
	switch {
	case p.action == security.Action_ALLOW && !p.dryRun:
		s.allows++
	case p.action == security.Action_ALLOW:
		s.dryAllows = append(s.dryAllows, p)
	}
	if !p.restricted {
		s.any = append(s.any, p)
		return
	}
	if s.bySrc == nil {
		s.bySrc, s.byPrin = map[string][]*policy{}, map[string][]*policy{}
	}
	for _, ns := range p.srcNamespaces {
		s.bySrc[ns] = append(s.bySrc[ns], p)
	}
	for _, pr := range p.srcPrincipals {
		s.byPrin[pr] = append(s.byPrin[pr], p)
	}
}

func (s *policySet) remove(p *policy) {
	switch {
	case p.action == security.Action_ALLOW && !p.dryRun:
		s.allows--
	case p.action == security.Action_ALLOW:
		s.dryAllows = drop(s.dryAllows, p)
	}
	if !p.restricted {
		s.any = drop(s.any, p)
		return
	}
	for _, ns := range p.srcNamespaces {
		if s.bySrc[ns] = drop(s.bySrc[ns], p); len(s.bySrc[ns]) == 0 {
			delete(s.bySrc, ns)
		}
	}
	for _, pr := range p.srcPrincipals {
		if s.byPrin[pr] = drop(s.byPrin[pr], p); len(s.byPrin[pr]) == 0 {
			delete(s.byPrin, pr)
		}
	}
}

func (s *policySet) empty() bool {
	return len(s.any) == 0 && len(s.bySrc) == 0 && len(s.byPrin) == 0 && s.allows == 0 && len(s.dryAllows) == 0
}

// NewTable returns an empty table.
func NewTable() *Table {
	return &Table{byKey: map[string]*policy{}, byNS: map[string]*policySet{}}
}

// Key is a policy's key: <namespace>/<name>, as workloads name it.
func Key(namespace, name string) string { return namespace + "/" + name }

// Upsert sets a policy (replacing the one of the same key). A policy that
// does not compile is an error and leaves the table as it was.
func (t *Table) Upsert(a *security.Authorization) error {
	p, err := compile(a)
	if err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.removeLocked(p.key)
	t.byKey[p.key] = p
	switch p.scope {
	case security.Scope_GLOBAL:
		t.global.add(p)
	case security.Scope_NAMESPACE:
		if t.byNS[p.namespace] == nil {
			t.byNS[p.namespace] = &policySet{}
		}
		t.byNS[p.namespace].add(p)
	}
	return nil
}

// Remove drops the policy of key (a no-op for an unknown key).
func (t *Table) Remove(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.removeLocked(key)
}

// Len returns the number of policies.
func (t *Table) Len() int {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.byKey)
}

func (t *Table) removeLocked(key string) {
	p, ok := t.byKey[key]
	if !ok {
		return
	}
	delete(t.byKey, key)
	switch p.scope {
	case security.Scope_GLOBAL:
		t.global.remove(p)
	case security.Scope_NAMESPACE:
		if s := t.byNS[p.namespace]; s != nil {
			if s.remove(p); s.empty() {
				delete(t.byNS, p.namespace)
			}
		}
	}
}

// Decide applies ztunnel's order to the policies that select dst: the
// mesh-wide ones (GLOBAL), those of dst's namespace (NAMESPACE) and those
// dst is bound to (WORKLOAD_SELECTOR, by key, as the agent bound them). Any matching DENY denies;
// with no ALLOW policy, the connection is allowed; otherwise an ALLOW must
// match. Dry-run policies never change the verdict: the first whose
// enforcement would have is reported in Decision.DryRun.
func (t *Table) Decide(c *Conn, dst Target) Decision {
	t.mu.RLock()
	defer t.mu.RUnlock()
	id := parseIdentity(c.Identity)
	var e eval
	sets := [2]*policySet{&t.global, t.byNS[dst.Namespace]}
	for _, s := range sets {
		if s == nil {
			continue
		}
		e.hasAllow = e.hasAllow || s.allows > 0
		if e.firstDryAllow == "" && len(s.dryAllows) > 0 {
			e.firstDryAllow = s.dryAllows[0].key
		}
		for _, p := range s.any {
			if e.apply(p, c, &id) {
				return e.denied()
			}
		}
		if id.ok {
			for _, p := range s.bySrc[id.namespace] {
				if e.apply(p, c, &id) {
					return e.denied()
				}
			}
			for _, p := range s.byPrin[id.principal] {
				if e.apply(p, c, &id) {
					return e.denied()
				}
			}
		}
	}
	for _, k := range dst.Policies {
		// The agent binds: a root-namespace selector policy binds
		// workloads of every namespace.
		if p := t.byKey[k]; p != nil && p.scope == security.Scope_WORKLOAD_SELECTOR {
			if e.apply(p, c, &id) {
				return e.denied()
			}
		}
	}
	return e.verdict()
}

// eval accumulates one decision.
type eval struct {
	deny, allow, dryDeny, dryAllow string
	firstDryAllow                  string // the first dry-run ALLOW seen
	hasAllow                       bool
}

// apply evaluates p; it reports true when p is an enforced DENY that
// matched (the decision is made).
func (e *eval) apply(p *policy, c *Conn, id *identity) bool {
	switch {
	case p.action == security.Action_DENY && !p.dryRun:
		if p.matches(c, id) {
			e.deny = p.key
			return true
		}
	case p.action == security.Action_DENY:
		if e.dryDeny == "" && p.matches(c, id) {
			e.dryDeny = p.key
		}
	case !p.dryRun:
		e.hasAllow = true
		if e.allow == "" && p.matches(c, id) {
			e.allow = p.key
		}
	default:
		if e.firstDryAllow == "" {
			e.firstDryAllow = p.key
		}
		if e.dryAllow == "" && p.matches(c, id) {
			e.dryAllow = p.key
		}
	}
	return false
}

func (e *eval) denied() Decision { return Decision{Policy: e.deny, Reason: ReasonDenied} }

func (e *eval) verdict() Decision {
	var d Decision
	switch {
	case !e.hasAllow:
		d = Decision{Allow: true, Reason: ReasonNoPolicy}
	case e.allow != "":
		d = Decision{Allow: true, Policy: e.allow, Reason: ReasonAllowed}
	default:
		d = Decision{Reason: ReasonNoAllowMatch}
	}
	switch {
	case d.Allow && e.dryDeny != "":
		d.DryRun = e.dryDeny
	case d.Allow && !e.hasAllow && e.firstDryAllow != "" && e.dryAllow == "":
		// Enforced, the dry-run ALLOW policies would have denied.
		d.DryRun = e.firstDryAllow
	}
	return d
}

// identity is a SPIFFE ID's parts, pointing into the ID string.
type identity struct {
	ok                 bool
	principal          string // <trust domain>/ns/<ns>/sa/<sa>
	namespace, account string
}

// parseIdentity splits spiffe://<td>/ns/<ns>/sa/<sa> without allocating;
// anything else is no identity.
func parseIdentity(s string) identity {
	p, ok := strings.CutPrefix(s, "spiffe://")
	if !ok {
		return identity{}
	}
	_, rest, ok := strings.Cut(p, "/ns/")
	if !ok {
		return identity{}
	}
	ns, sa, ok := strings.Cut(rest, "/sa/")
	if !ok || ns == "" || sa == "" {
		return identity{}
	}
	return identity{ok: true, principal: p, namespace: ns, account: sa}
}

// String renders a Decision for logs.
func (d Decision) String() string {
	v := "deny"
	if d.Allow {
		v = "allow"
	}
	if d.Policy == "" {
		return fmt.Sprintf("%s (%s)", v, d.Reason)
	}
	return fmt.Sprintf("%s by %s (%s)", v, d.Policy, d.Reason)
}
