// Package policy is the agent's authorization model: it translates Istio's
// security.istio.io AuthorizationPolicy objects (istio.io/api types) into
// the istio.security.Authorization resources ztunnel consumes, serves them
// in workload discovery, and binds each workload to the selector-scoped
// ones (its authorization_policies). See README.md.
package policy

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/protobuf/types/known/emptypb"
	securityv1beta1 "istio.io/api/security/v1beta1"

	"aether.io/node/api/istio/security"
)

// AnnotationDryRun is Istio's dry-run annotation: decide and log, never
// enforce.
const AnnotationDryRun = "istio.io/dry-run"

// Object is one AuthorizationPolicy as the model reads it.
type Object struct {
	Namespace, Name string
	Annotations     map[string]string
	Spec            *securityv1beta1.AuthorizationPolicy
	// Malformed is why the spec could not be read as written (ParseObject);
	// such a policy is served failing closed.
	Malformed error
	// Raw is the JSON the object was read from (ParseObject): what a
	// snapshot keeps.
	Raw []byte
}

// Key is the object's <namespace>/<name>.
func (o *Object) Key() string { return o.Namespace + "/" + o.Name }

// Translation is the result of Translate.
type Translation struct {
	// Authorization is what is served; nil when nothing is (a policy
	// attached by targetRefs to something other than a Service).
	Authorization *security.Authorization
	// Warnings say what was not enforced as written, naming the policy
	// and the field (L7 attributes, CUSTOM, invalid values).
	Warnings []string
}

// l4When are the condition keys ztunnel enforces (Istio's list, plus
// remote.ip: at L4 the remote address is the source's).
var l4When = []string{"source.ip", "remote.ip", "source.namespace", "source.principal", "destination.ip", "destination.port"}

// Translate turns an AuthorizationPolicy into the Authorization served for
// it, with ztunnel's L4 semantics, failing safe wherever it cannot enforce
// what is written:
//   - scope: no selector (and no targetRefs) is NAMESPACE, GLOBAL in the
//     root namespace; a selector or targetRefs is WORKLOAD_SELECTOR (bound
//     per workload by the model);
//   - ALLOW and DENY as written; AUDIT is served as a dry-run DENY (its
//     matches are logged, never blocked); CUSTOM cannot be enforced here:
//     it is served as a DENY of everything it selects (fail closed);
//   - a rule with L7 attributes: in an ALLOW policy the rule is dropped
//     (it matches nothing), in a DENY policy its L4 part is kept (it
//     denies more); each is a warning naming the attribute;
//   - an invalid value (a CIDR or port that does not parse): in an ALLOW
//     rule the rule is dropped; in a DENY rule the field it is in no
//     longer narrows the rule; a warning names it. A bad policy never
//     opens what it was written to close.
func Translate(rootNamespace string, o *Object) Translation {
	var tr Translation
	warn := func(format string, args ...any) {
		tr.Warnings = append(tr.Warnings, fmt.Sprintf("authorization policy %s: ", o.Key())+fmt.Sprintf(format, args...))
	}
	spec := o.Spec
	if spec == nil {
		spec = &securityv1beta1.AuthorizationPolicy{}
	}
	a := &security.Authorization{Name: o.Name, Namespace: o.Namespace, Scope: security.Scope_NAMESPACE}
	switch {
	case len(spec.GetTargetRefs()) > 0 || spec.GetTargetRef() != nil:
		a.Scope = security.Scope_WORKLOAD_SELECTOR
	case len(spec.GetSelector().GetMatchLabels()) > 0:
		a.Scope = security.Scope_WORKLOAD_SELECTOR
	case o.Namespace == rootNamespace:
		a.Scope = security.Scope_GLOBAL
	}
	if v, ok := o.Annotations[AnnotationDryRun]; ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			warn("annotation %s=%q is not a boolean; enforced (not dry-run)", AnnotationDryRun, v)
		}
		a.DryRun = b
	}
	switch spec.GetAction() {
	case securityv1beta1.AuthorizationPolicy_ALLOW:
		a.Action = security.Action_ALLOW
	case securityv1beta1.AuthorizationPolicy_DENY:
		a.Action = security.Action_DENY
	case securityv1beta1.AuthorizationPolicy_AUDIT:
		a.Action, a.DryRun = security.Action_DENY, true
	default: // CUSTOM, or an action this build does not know
		warn("action %s cannot be enforced by the node proxy (no external authorizer at L4): every connection to the workloads it selects is denied", spec.GetAction())
		a.Action, a.DryRun = security.Action_DENY, false
		a.Groups = []*security.Group{{}}
		tr.Authorization = a
		return tr
	}
	if o.Malformed != nil {
		// Fail closed: an ALLOW that cannot be read allows nothing (its
		// presence still requires another ALLOW to match), a DENY that
		// cannot be read denies everything it selects.
		warn("%v: served failing closed", o.Malformed)
		if a.Action == security.Action_DENY {
			a.Groups = []*security.Group{{}}
		}
		tr.Authorization = a
		return tr
	}
	for i, r := range spec.GetRules() {
		if g := translateRule(a.Action, o.Namespace, i, r, warn); g != nil {
			a.Groups = append(a.Groups, g)
		}
	}
	tr.Authorization = a
	return tr
}

// translateRule turns one rule into a group: its from matches ORed in one
// rules, its to matches in another, each condition in one more (all
// ANDed). nil: the rule matches nothing (an ALLOW rule with L7 attributes
// or invalid values).
func translateRule(action security.Action, ns string, i int, r *securityv1beta1.Rule, warn func(string, ...any)) *security.Group {
	allow := action == security.Action_ALLOW
	drop := false
	l7 := func(field string) {
		if allow {
			warn("rule %d: %s is an HTTP attribute the node proxy cannot see: the rule is dropped (it matches nothing; more restrictive than written)", i, field)
			drop = true
		} else {
			warn("rule %d: %s is an HTTP attribute the node proxy cannot see: the rule is enforced without it (more restrictive than written)", i, field)
		}
	}
	// bad reports a field with an invalid value: an ALLOW rule is dropped,
	// a DENY rule loses the field's constraint (returns true: clear it).
	bad := func(field string, err error) bool {
		if allow {
			warn("rule %d: %s: %v: the rule is dropped (it matches nothing)", i, field, err)
			drop = true
			return false
		}
		warn("rule %d: %s: %v: the field no longer narrows this DENY rule (it denies more)", i, field, err)
		return true
	}
	g := &security.Group{}
	var from []*security.Match
	for j, f := range r.GetFrom() {
		s := f.GetSource()
		// In a fixed order: a policy's warnings are compared to decide
		// whether to log them again.
		for _, f := range []struct {
			field string
			set   bool
		}{
			{"requestPrincipals", len(s.GetRequestPrincipals()) > 0}, {"notRequestPrincipals", len(s.GetNotRequestPrincipals()) > 0},
		} {
			if f.set {
				l7(fmt.Sprintf("from[%d].source.%s", j, f.field))
			}
		}
		m := &security.Match{
			Principals: stringMatches(s.GetPrincipals()), NotPrincipals: stringMatches(s.GetNotPrincipals()),
			Namespaces: stringMatches(s.GetNamespaces()), NotNamespaces: stringMatches(s.GetNotNamespaces()),
			ServiceAccounts: accounts(s.GetServiceAccounts(), ns), NotServiceAccounts: accounts(s.GetNotServiceAccounts(), ns),
		}
		var err error
		src := slices.Concat(s.GetIpBlocks(), s.GetRemoteIpBlocks())
		if m.SourceIps, err = addresses(src); err != nil && bad(fmt.Sprintf("from[%d].source.ipBlocks", j), err) {
			m.SourceIps = nil
		}
		notSrc := slices.Concat(s.GetNotIpBlocks(), s.GetNotRemoteIpBlocks())
		if m.NotSourceIps, err = addresses(notSrc); err != nil && bad(fmt.Sprintf("from[%d].source.notIpBlocks", j), err) {
			// A DENY's not-field that cannot be read: drop the whole
			// source, so the rule denies every source (fail closed).
			m = &security.Match{}
		}
		for _, p := range s.GetPrincipals() {
			if p != "*" && !strings.Contains(p, "/ns/") && !strings.HasPrefix(p, "*") && !strings.HasSuffix(p, "*") {
				warn("rule %d: from[%d].source.principals %q has no <trust domain>/ns/<namespace>/sa/<account> form: it matches no workload identity", i, j, p)
			}
		}
		from = append(from, m)
	}
	var to []*security.Match
	for j, t := range r.GetTo() {
		op := t.GetOperation()
		for _, f := range []struct {
			field string
			set   bool
		}{
			{"hosts", len(op.GetHosts()) > 0},
			{"notHosts", len(op.GetNotHosts()) > 0},
			{"methods", len(op.GetMethods()) > 0},
			{"notMethods", len(op.GetNotMethods()) > 0},
			{"paths", len(op.GetPaths()) > 0},
			{"notPaths", len(op.GetNotPaths()) > 0},
		} {
			if f.set {
				l7(fmt.Sprintf("to[%d].operation.%s", j, f.field))
			}
		}
		m := &security.Match{}
		var err error
		if m.DestinationPorts, err = ports(op.GetPorts()); err != nil && bad(fmt.Sprintf("to[%d].operation.ports", j), err) {
			m.DestinationPorts = nil
		}
		if m.NotDestinationPorts, err = ports(op.GetNotPorts()); err != nil && bad(fmt.Sprintf("to[%d].operation.notPorts", j), err) {
			m = &security.Match{}
		}
		to = append(to, m)
	}
	if len(to) > 0 {
		g.Rules = append(g.Rules, &security.Rules{Matches: to})
	}
	if len(from) > 0 {
		g.Rules = append(g.Rules, &security.Rules{Matches: from})
	}
	for j, c := range r.GetWhen() {
		if !slices.Contains(l4When, c.GetKey()) {
			l7(fmt.Sprintf("when[%d] key %q", j, c.GetKey()))
			continue
		}
		m, err := condition(c)
		if err != nil {
			if bad(fmt.Sprintf("when[%d] %s", j, c.GetKey()), err) {
				continue // the condition no longer narrows the DENY rule
			}
		}
		g.Rules = append(g.Rules, &security.Rules{Matches: []*security.Match{m}})
	}
	if drop {
		return nil
	}
	return g
}

// condition is one L4 when-condition as a match.
func condition(c *securityv1beta1.Condition) (*security.Match, error) {
	m := &security.Match{}
	var err, nerr error
	switch c.GetKey() {
	case "source.ip", "remote.ip":
		m.SourceIps, err = addresses(c.GetValues())
		m.NotSourceIps, nerr = addresses(c.GetNotValues())
	case "destination.ip":
		m.DestinationIps, err = addresses(c.GetValues())
		m.NotDestinationIps, nerr = addresses(c.GetNotValues())
	case "destination.port":
		m.DestinationPorts, err = ports(c.GetValues())
		m.NotDestinationPorts, nerr = ports(c.GetNotValues())
	case "source.namespace":
		m.Namespaces, m.NotNamespaces = stringMatches(c.GetValues()), stringMatches(c.GetNotValues())
	case "source.principal":
		m.Principals, m.NotPrincipals = stringMatches(c.GetValues()), stringMatches(c.GetNotValues())
	}
	if err == nil {
		err = nerr
	}
	return m, err
}

// stringMatches turns Istio's string forms into matches: "*" presence,
// "*x" suffix, "x*" prefix, else exact.
func stringMatches(vs []string) []*security.StringMatch {
	var out []*security.StringMatch
	for _, v := range vs {
		var sm *security.StringMatch
		switch {
		case v == "*":
			sm = &security.StringMatch{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}
		case strings.HasPrefix(v, "*"):
			sm = &security.StringMatch{MatchType: &security.StringMatch_Suffix{Suffix: v[1:]}}
		case strings.HasSuffix(v, "*"):
			sm = &security.StringMatch{MatchType: &security.StringMatch_Prefix{Prefix: v[:len(v)-1]}}
		default:
			sm = &security.StringMatch{MatchType: &security.StringMatch_Exact{Exact: v}}
		}
		out = append(out, sm)
	}
	return out
}

// accounts turns service accounts ("sa" in the policy's namespace, or
// "ns/sa") into matches.
func accounts(vs []string, ns string) []*security.ServiceAccountMatch {
	var out []*security.ServiceAccountMatch
	for _, v := range vs {
		n, sa, ok := strings.Cut(v, "/")
		if !ok {
			n, sa = ns, v
		}
		out = append(out, &security.ServiceAccountMatch{Namespace: n, ServiceAccount: sa})
	}
	return out
}

// addresses parses IPs and CIDRs; the first invalid one is the error.
func addresses(vs []string) ([]*security.Address, error) {
	var out []*security.Address
	for _, v := range vs {
		var pf netip.Prefix
		if strings.Contains(v, "/") {
			p, err := netip.ParsePrefix(v)
			if err != nil {
				return nil, fmt.Errorf("invalid CIDR %q: want an address or address/bits", v)
			}
			pf = p
		} else {
			a, err := netip.ParseAddr(v)
			if err != nil {
				return nil, fmt.Errorf("invalid address %q: want an address or address/bits", v)
			}
			pf = netip.PrefixFrom(a, a.BitLen())
		}
		out = append(out, &security.Address{Address: pf.Addr().AsSlice(), Length: uint32(pf.Bits())})
	}
	return out, nil
}

// ports parses port numbers; the first invalid one is the error.
func ports(vs []string) ([]uint32, error) {
	var out []uint32
	for _, v := range vs {
		p, err := strconv.ParseUint(v, 10, 16)
		if err != nil || p == 0 {
			return nil, fmt.Errorf("invalid port %q: want 1-65535", v)
		}
		out = append(out, uint32(p))
	}
	return out, nil
}
