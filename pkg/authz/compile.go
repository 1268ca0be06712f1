package authz

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"aether.io/node/api/istio/security"
)

// policy is an Authorization compiled for matching: addresses as
// prefixes, string matches as kind and value, nothing to parse per
// connection.
type policy struct {
	key, namespace string
	scope          security.Scope
	action         security.Action
	dryRun         bool
	// groups are ORed: the policy matches when one group does. No group:
	// nothing matches (an ALLOW without rules denies everything, a DENY
	// without rules denies nothing).
	groups [][]rules
	// restricted: the policy can match only sources of srcNamespaces or
	// srcPrincipals (every group requires one of them exactly); see
	// policySet.
	restricted                   bool
	srcNamespaces, srcPrincipals []string
}

// rules are ANDed within a group; the matches of one rules are ORed.
type rules []match

// match is one ztunnel Match: every field that is set must hold (ANDed);
// a positive field holds when one of its values does, a not_ field when
// none does.
type match struct {
	namespaces, notNamespaces []stringMatch
	principals, notPrincipals []stringMatch
	accounts, notAccounts     []account
	srcIPs, notSrcIPs         []netip.Prefix
	dstIPs, notDstIPs         []netip.Prefix
	ports, notPorts           []uint16
}

type account struct{ namespace, name string }

type matchKind uint8

const (
	exact matchKind = iota
	prefix
	suffix
	presence
)

type stringMatch struct {
	kind  matchKind
	value string
}

func (m stringMatch) matches(s string) bool {
	switch m.kind {
	case exact:
		return s == m.value
	case prefix:
		return strings.HasPrefix(s, m.value)
	case suffix:
		return strings.HasSuffix(s, m.value)
	default:
		return s != ""
	}
}

// compile checks and compiles a; every address must be a valid prefix and
// every port in 1-65535 (the agent's translator never serves others: an
// invalid one here is a bad server).
func compile(a *security.Authorization) (*policy, error) {
	if a.GetName() == "" || a.GetNamespace() == "" {
		return nil, errors.New("invalid authorization: name and namespace are required")
	}
	p := &policy{key: Key(a.GetNamespace(), a.GetName()), namespace: a.GetNamespace(), scope: a.GetScope(), action: a.GetAction(), dryRun: a.GetDryRun()}
	switch p.scope {
	case security.Scope_GLOBAL, security.Scope_NAMESPACE, security.Scope_WORKLOAD_SELECTOR:
	default:
		return nil, fmt.Errorf("invalid authorization %s: unknown scope %d", p.key, p.scope)
	}
	switch p.action {
	case security.Action_ALLOW, security.Action_DENY:
	default:
		return nil, fmt.Errorf("invalid authorization %s: unknown action %d", p.key, p.action)
	}
	for gi, g := range a.GetGroups() {
		var grp []rules
		for ri, r := range g.GetRules() {
			var rs rules
			for mi, m := range r.GetMatches() {
				cm, err := compileMatch(m)
				if err != nil {
					return nil, fmt.Errorf("invalid authorization %s: group %d rules %d match %d: %w", p.key, gi, ri, mi, err)
				}
				rs = append(rs, cm)
			}
			grp = append(grp, rs)
		}
		p.groups = append(p.groups, grp)
	}
	p.srcNamespaces, p.srcPrincipals, p.restricted = sources(p.groups)
	return p, nil
}

// sources returns the exact source namespaces and principals outside
// which no group of the policy can match, or restricted=false when some
// group can match any source: a group is restricted when one of its rules
// has only matches that name exact namespaces or exact principals. A
// policy without groups matches nothing: restricted to none.
func sources(groups [][]rules) (namespaces, principals []string, restricted bool) {
	exactOnly := func(ms []stringMatch) bool {
		return len(ms) > 0 && !slices.ContainsFunc(ms, func(s stringMatch) bool { return s.kind != exact })
	}
	for _, g := range groups {
		found := false
		for _, rs := range g {
			var ns, ps []string
			ok := len(rs) > 0
			for _, m := range rs {
				switch {
				case exactOnly(m.principals):
					for _, s := range m.principals {
						ps = append(ps, s.value)
					}
				case exactOnly(m.namespaces):
					for _, s := range m.namespaces {
						ns = append(ns, s.value)
					}
				default:
					ok = false
				}
				if !ok {
					break
				}
			}
			if ok {
				namespaces, principals, found = append(namespaces, ns...), append(principals, ps...), true
				break
			}
		}
		if !found {
			return nil, nil, false
		}
	}
	slices.Sort(namespaces)
	slices.Sort(principals)
	return slices.Compact(namespaces), slices.Compact(principals), true
}

// matches reports whether one of p's groups matches.
func (p *policy) matches(c *Conn, id *identity) bool {
	for _, g := range p.groups {
		if groupMatches(g, c, id) {
			return true
		}
	}
	return false
}

// groupMatches: every rules of the group holds (a group without rules,
// Istio's `rules: [{}]`, matches everything).
func groupMatches(g []rules, c *Conn, id *identity) bool {
	for _, rs := range g {
		ok := false
		for i := range rs {
			if rs[i].matches(c, id) {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

func (m *match) matches(c *Conn, id *identity) bool {
	src, dst := c.Source.Unmap(), c.Dest.Addr().Unmap()
	return strField(m.namespaces, m.notNamespaces, id.ok, id.namespace) &&
		strField(m.principals, m.notPrincipals, id.ok, id.principal) &&
		accountField(m.accounts, m.notAccounts, id) &&
		ipField(m.srcIPs, m.notSrcIPs, src) &&
		ipField(m.dstIPs, m.notDstIPs, dst) &&
		portField(m.ports, m.notPorts, c.Dest.Port())
}

// strField: a positive list needs an identity with one matching value; a
// not_ list fails when an identity matches one (no identity: it holds,
// which is how a DENY of not_principals presence refuses plaintext).
func strField(pos, neg []stringMatch, ok bool, v string) bool {
	if len(pos) > 0 {
		if !ok || !slices.ContainsFunc(pos, func(m stringMatch) bool { return m.matches(v) }) {
			return false
		}
	}
	if ok && slices.ContainsFunc(neg, func(m stringMatch) bool { return m.matches(v) }) {
		return false
	}
	return true
}

func accountField(pos, neg []account, id *identity) bool {
	is := func(a account) bool { return a.namespace == id.namespace && a.name == id.account }
	if len(pos) > 0 && (!id.ok || !slices.ContainsFunc(pos, is)) {
		return false
	}
	return !id.ok || !slices.ContainsFunc(neg, is)
}

func ipField(pos, neg []netip.Prefix, a netip.Addr) bool {
	in := func(p netip.Prefix) bool { return p.Contains(a) }
	if len(pos) > 0 && !slices.ContainsFunc(pos, in) {
		return false
	}
	return !slices.ContainsFunc(neg, in)
}

func portField(pos, neg []uint16, p uint16) bool {
	if len(pos) > 0 {
		if _, ok := slices.BinarySearch(pos, p); !ok {
			return false
		}
	}
	_, hit := slices.BinarySearch(neg, p)
	return !hit
}

func compileMatch(m *security.Match) (match, error) {
	var out match
	var err error
	strs := func(in []*security.StringMatch) []stringMatch {
		var o []stringMatch
		for _, s := range in {
			switch v := s.GetMatchType().(type) {
			case *security.StringMatch_Exact:
				o = append(o, stringMatch{kind: exact, value: v.Exact})
			case *security.StringMatch_Prefix:
				o = append(o, stringMatch{kind: prefix, value: v.Prefix})
			case *security.StringMatch_Suffix:
				o = append(o, stringMatch{kind: suffix, value: v.Suffix})
			case *security.StringMatch_Presence:
				o = append(o, stringMatch{kind: presence})
			default:
				err = errors.Join(err, errors.New("a string match without a match type"))
			}
		}
		return o
	}
	addrs := func(in []*security.Address) []netip.Prefix {
		var o []netip.Prefix
		for _, a := range in {
			ip, ok := netip.AddrFromSlice(a.GetAddress())
			if !ok {
				err = errors.Join(err, fmt.Errorf("an address of %d bytes, want 4 or 16", len(a.GetAddress())))
				continue
			}
			ip = ip.Unmap()
			if int(a.GetLength()) > ip.BitLen() {
				err = errors.Join(err, fmt.Errorf("address %s/%d: prefix longer than the address", ip, a.GetLength()))
				continue
			}
			pf, perr := ip.Prefix(int(a.GetLength()))
			if perr != nil {
				err = errors.Join(err, fmt.Errorf("address %s/%d: %w", ip, a.GetLength(), perr))
				continue
			}
			o = append(o, pf)
		}
		return o
	}
	ports := func(in []uint32) []uint16 {
		var o []uint16
		for _, p := range in {
			if p == 0 || p > 65535 {
				err = errors.Join(err, fmt.Errorf("port %d, want 1-65535", p))
				continue
			}
			o = append(o, uint16(p))
		}
		slices.Sort(o)
		return o
	}
	accts := func(in []*security.ServiceAccountMatch) []account {
		var o []account
		for _, a := range in {
			o = append(o, account{namespace: a.GetNamespace(), name: a.GetServiceAccount()})
		}
		return o
	}
	out.namespaces, out.notNamespaces = strs(m.GetNamespaces()), strs(m.GetNotNamespaces())
	out.principals, out.notPrincipals = strs(m.GetPrincipals()), strs(m.GetNotPrincipals())
	out.accounts, out.notAccounts = accts(m.GetServiceAccounts()), accts(m.GetNotServiceAccounts())
	out.srcIPs, out.notSrcIPs = addrs(m.GetSourceIps()), addrs(m.GetNotSourceIps())
	out.dstIPs, out.notDstIPs = addrs(m.GetDestinationIps()), addrs(m.GetNotDestinationIps())
	out.ports, out.notPorts = ports(m.GetDestinationPorts()), ports(m.GetNotDestinationPorts())
	return out, err
}
