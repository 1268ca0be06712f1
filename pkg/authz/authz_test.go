package authz

import (
	"fmt"
	"net/netip"
	"testing"

	"google.golang.org/protobuf/types/known/emptypb"

	"aether.io/node/api/istio/security"
)

func exactM(v string) *security.StringMatch {
	return &security.StringMatch{MatchType: &security.StringMatch_Exact{Exact: v}}
}

func prefixM(v string) *security.StringMatch {
	return &security.StringMatch{MatchType: &security.StringMatch_Prefix{Prefix: v}}
}

func suffixM(v string) *security.StringMatch {
	return &security.StringMatch{MatchType: &security.StringMatch_Suffix{Suffix: v}}
}

func presenceM() *security.StringMatch {
	return &security.StringMatch{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}
}

func cidr(s string) *security.Address {
	p := netip.MustParsePrefix(s)
	return &security.Address{Address: p.Addr().AsSlice(), Length: uint32(p.Bits())}
}

// pol is a policy of one group of one rules of the given matches (nil
// matches: a group without rules, Istio's `rules: [{}]`).
func pol(name string, scope security.Scope, action security.Action, matches ...*security.Match) *security.Authorization {
	a := &security.Authorization{Name: name, Namespace: "shop", Scope: scope, Action: action}
	g := &security.Group{}
	if len(matches) > 0 {
		g.Rules = []*security.Rules{{Matches: matches}}
	}
	a.Groups = []*security.Group{g}
	return a
}

var (
	web    = Target{Namespace: "shop", Policies: []string{"shop/sel"}}
	client = &Conn{Source: netip.MustParseAddr("10.0.0.2"), Identity: "spiffe://cluster.local/ns/shop/sa/client", Dest: netip.MustParseAddrPort("10.0.0.9:8080")}
	other  = &Conn{Source: netip.MustParseAddr("10.1.0.7"), Identity: "spiffe://cluster.local/ns/batch/sa/job", Dest: netip.MustParseAddrPort("10.0.0.9:9090")}
	plain  = &Conn{Source: netip.MustParseAddr("10.0.0.2"), Dest: netip.MustParseAddrPort("10.0.0.9:8080")}
)

type want struct {
	c      *Conn
	allow  bool
	policy string
	dryRun string
}

// TestSemantics is the table of Istio's L4 attributes and ordering rules,
// as ztunnel enforces them, against Decide.
func TestSemantics(t *testing.T) {
	A, D := security.Action_ALLOW, security.Action_DENY
	G, N, S := security.Scope_GLOBAL, security.Scope_NAMESPACE, security.Scope_WORKLOAD_SELECTOR
	dry := func(a *security.Authorization) *security.Authorization { a.DryRun = true; return a }
	inNS := func(a *security.Authorization, ns string) *security.Authorization { a.Namespace = ns; return a }
	emptyAllow := &security.Authorization{Name: "none", Namespace: "shop", Scope: N, Action: A}
	for _, tc := range []struct {
		name string
		pols []*security.Authorization
		want []want
	}{
		{"no policy: allow", nil, []want{{client, true, "", ""}, {plain, true, "", ""}}},
		{
			"principals exact",
			[]*security.Authorization{pol("p", N, A, &security.Match{Principals: []*security.StringMatch{exactM("cluster.local/ns/shop/sa/client")}})},
			[]want{{client, true, "shop/p", ""}, {other, false, "", ""}, {plain, false, "", ""}},
		},
		{
			"principals prefix and suffix",
			[]*security.Authorization{pol("p", N, A, &security.Match{Principals: []*security.StringMatch{prefixM("cluster.local/ns/batch/"), suffixM("/sa/client")}})},
			[]want{{client, true, "shop/p", ""}, {other, true, "shop/p", ""}, {plain, false, "", ""}},
		},
		{
			"principals presence (*) never matches plaintext",
			[]*security.Authorization{pol("p", N, A, &security.Match{Principals: []*security.StringMatch{presenceM()}})},
			[]want{{client, true, "shop/p", ""}, {plain, false, "", ""}},
		},
		{
			"notPrincipals",
			[]*security.Authorization{pol("p", N, A, &security.Match{NotPrincipals: []*security.StringMatch{exactM("cluster.local/ns/batch/sa/job")}})},
			[]want{{client, true, "shop/p", ""}, {other, false, "", ""}, {plain, true, "shop/p", ""}},
		},
		{
			"namespaces",
			[]*security.Authorization{pol("p", N, A, &security.Match{Namespaces: []*security.StringMatch{exactM("batch")}})},
			[]want{{client, false, "", ""}, {other, true, "shop/p", ""}, {plain, false, "", ""}},
		},
		{
			"deny a namespace",
			[]*security.Authorization{pol("d", N, D, &security.Match{Namespaces: []*security.StringMatch{exactM("batch")}})},
			[]want{{client, true, "", ""}, {other, false, "shop/d", ""}, {plain, true, "", ""}},
		},
		{
			"deny notNamespaces",
			[]*security.Authorization{pol("d", N, D, &security.Match{NotNamespaces: []*security.StringMatch{exactM("shop")}})},
			[]want{{client, true, "", ""}, {other, false, "shop/d", ""}, {plain, false, "shop/d", ""}},
		},
		{
			"service accounts",
			[]*security.Authorization{pol("p", N, A, &security.Match{ServiceAccounts: []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "client"}}})},
			[]want{{client, true, "shop/p", ""}, {other, false, "", ""}, {plain, false, "", ""}},
		},
		{
			"notServiceAccounts",
			[]*security.Authorization{pol("p", N, A, &security.Match{NotServiceAccounts: []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "client"}}})},
			[]want{{client, false, "", ""}, {other, true, "shop/p", ""}},
		},
		{
			"ipBlocks",
			[]*security.Authorization{pol("p", N, A, &security.Match{SourceIps: []*security.Address{cidr("10.0.0.0/24")}})},
			[]want{{client, true, "shop/p", ""}, {plain, true, "shop/p", ""}, {other, false, "", ""}},
		},
		{
			"notIpBlocks",
			[]*security.Authorization{pol("d", N, D, &security.Match{NotSourceIps: []*security.Address{cidr("10.0.0.0/24")}})},
			[]want{{client, true, "", ""}, {other, false, "shop/d", ""}},
		},
		{
			"destination.ip",
			[]*security.Authorization{pol("p", N, A, &security.Match{DestinationIps: []*security.Address{cidr("10.0.0.9/32")}})},
			[]want{{client, true, "shop/p", ""}},
		},
		{
			"notDestinationIps",
			[]*security.Authorization{pol("d", N, D, &security.Match{NotDestinationIps: []*security.Address{cidr("10.0.0.9/32")}})},
			[]want{{client, true, "", ""}},
		},
		{
			"ports",
			[]*security.Authorization{pol("p", N, A, &security.Match{DestinationPorts: []uint32{8080}})},
			[]want{{client, true, "shop/p", ""}, {other, false, "", ""}},
		},
		{
			"notPorts",
			[]*security.Authorization{pol("d", N, D, &security.Match{NotDestinationPorts: []uint32{8080}})},
			[]want{{client, true, "", ""}, {other, false, "shop/d", ""}},
		},
		{
			"fields of a match are ANDed",
			[]*security.Authorization{pol("p", N, A, &security.Match{Namespaces: []*security.StringMatch{exactM("shop")}, DestinationPorts: []uint32{9090}})},
			[]want{{client, false, "", ""}, {other, false, "", ""}},
		},
		{
			"matches of a rule are ORed",
			[]*security.Authorization{pol("p", N, A, &security.Match{Namespaces: []*security.StringMatch{exactM("shop")}}, &security.Match{DestinationPorts: []uint32{9090}})},
			[]want{{client, true, "shop/p", ""}, {other, true, "shop/p", ""}, {plain, false, "", ""}},
		},
		{"ALLOW without rules denies everything", []*security.Authorization{emptyAllow}, []want{{client, false, "", ""}, {plain, false, "", ""}}},
		{"ALLOW rules: [{}] allows everything", []*security.Authorization{pol("all", N, A)}, []want{{client, true, "shop/all", ""}, {plain, true, "shop/all", ""}}},
		{"DENY without rules denies nothing", []*security.Authorization{{Name: "none", Namespace: "shop", Scope: N, Action: D}}, []want{{client, true, "", ""}}},
		{
			"DENY before ALLOW",
			[]*security.Authorization{pol("all", N, A), pol("d", N, D, &security.Match{Namespaces: []*security.StringMatch{exactM("batch")}})},
			[]want{{client, true, "shop/all", ""}, {other, false, "shop/d", ""}},
		},
		{
			"STRICT as DENY notPrincipals presence",
			[]*security.Authorization{pol("strict", N, D, &security.Match{NotPrincipals: []*security.StringMatch{presenceM()}})},
			[]want{{client, true, "", ""}, {plain, false, "shop/strict", ""}},
		},
		{
			"dry-run DENY never blocks",
			[]*security.Authorization{dry(pol("d", N, D, &security.Match{Namespaces: []*security.StringMatch{exactM("batch")}}))},
			[]want{{other, true, "", "shop/d"}, {client, true, "", ""}},
		},
		{
			"dry-run ALLOW is not an ALLOW policy",
			[]*security.Authorization{dry(pol("p", N, A, &security.Match{Namespaces: []*security.StringMatch{exactM("shop")}}))},
			[]want{{client, true, "", ""}, {other, true, "", "shop/p"}},
		},
		{
			"root namespace (GLOBAL) applies everywhere",
			[]*security.Authorization{inNS(pol("mesh", G, D, &security.Match{Namespaces: []*security.StringMatch{exactM("batch")}}), "istio-system")},
			[]want{{other, false, "istio-system/mesh", ""}},
		},
		{"another namespace's policy does not apply", []*security.Authorization{inNS(pol("d", N, D), "batch")}, []want{{client, true, "", ""}}},
		{
			"a selector policy applies only to the workloads bound to it",
			[]*security.Authorization{pol("sel", S, A, &security.Match{Namespaces: []*security.StringMatch{exactM("batch")}}), pol("unbound", S, D)},
			[]want{{client, false, "", ""}, {other, true, "shop/sel", ""}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb := NewTable()
			for _, p := range tc.pols {
				if err := tb.Upsert(p); err != nil {
					t.Fatal(err)
				}
			}
			for _, w := range tc.want {
				d := tb.Decide(w.c, web)
				if d.Allow != w.allow || d.Policy != w.policy || d.DryRun != w.dryRun {
					t.Errorf("%s -> %s: %+v, want allow=%v policy=%q dry_run=%q", w.c.Identity, w.c.Dest, d, w.allow, w.policy, w.dryRun)
				}
			}
		})
	}
}

func TestUpsertRejectsAndRemove(t *testing.T) {
	tb := NewTable()
	for name, a := range map[string]*security.Authorization{
		"no name":      {Namespace: "shop"},
		"bad address":  pol("p", security.Scope_NAMESPACE, security.Action_ALLOW, &security.Match{SourceIps: []*security.Address{{Address: []byte{1, 2, 3}}}}),
		"bad length":   pol("p", security.Scope_NAMESPACE, security.Action_ALLOW, &security.Match{SourceIps: []*security.Address{{Address: []byte{10, 0, 0, 0}, Length: 33}}}),
		"port 0":       pol("p", security.Scope_NAMESPACE, security.Action_ALLOW, &security.Match{DestinationPorts: []uint32{0}}),
		"empty string": pol("p", security.Scope_NAMESPACE, security.Action_ALLOW, &security.Match{Principals: []*security.StringMatch{{}}}),
	} {
		if err := tb.Upsert(a); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if tb.Len() != 0 {
		t.Fatalf("rejected policies held: %d", tb.Len())
	}
	if err := tb.Upsert(pol("d", security.Scope_NAMESPACE, security.Action_DENY)); err != nil {
		t.Fatal(err)
	}
	if d := tb.Decide(client, web); d.Allow {
		t.Fatalf("deny-all not applied: %+v", d)
	}
	tb.Remove("shop/d")
	if d := tb.Decide(client, web); !d.Allow || tb.Len() != 0 {
		t.Fatalf("after Remove: %+v, %d policies", d, tb.Len())
	}
}

// BenchmarkDecide: 1,000 mesh-wide policies and 100 in the destination's
// namespace, none matching until the last ALLOW (the worst case: every
// policy evaluated).
func BenchmarkDecide(b *testing.B) {
	tb := NewTable()
	for i := range 1000 {
		a := pol(fmt.Sprintf("mesh-%d", i), security.Scope_GLOBAL, security.Action_DENY, &security.Match{Namespaces: []*security.StringMatch{exactM(fmt.Sprintf("ns-%d", i))}})
		a.Namespace = "istio-system"
		if err := tb.Upsert(a); err != nil {
			b.Fatal(err)
		}
	}
	for i := range 100 {
		p := &security.Match{Principals: []*security.StringMatch{exactM(fmt.Sprintf("cluster.local/ns/shop/sa/sa-%d", i))}}
		if i == 99 {
			p = &security.Match{Principals: []*security.StringMatch{exactM("cluster.local/ns/shop/sa/client")}, DestinationPorts: []uint32{8080}}
		}
		if err := tb.Upsert(pol(fmt.Sprintf("ns-%d", i), security.Scope_NAMESPACE, security.Action_ALLOW, p)); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if d := tb.Decide(client, web); !d.Allow {
			b.Fatal(d)
		}
	}
}
