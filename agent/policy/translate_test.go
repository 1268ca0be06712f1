package policy

import (
	"fmt"
	"net/netip"
	"runtime"
	"strings"
	"testing"

	securityv1beta1 "istio.io/api/security/v1beta1"
	typev1beta1 "istio.io/api/type/v1beta1"
	"sigs.k8s.io/yaml"

	"aether.io/node/api/istio/security"
	"aether.io/node/pkg/authz"
	"aether.io/node/xds/workload"
)

func parse(t *testing.T, doc string) *Object {
	t.Helper()
	raw, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	o, err := ParseObject(raw)
	if err != nil && o == nil {
		t.Fatal(err)
	}
	return o
}

var (
	client = &authz.Conn{Source: netip.MustParseAddr("10.0.0.2"), Identity: "spiffe://cluster.local/ns/shop/sa/client", Dest: netip.MustParseAddrPort("10.0.0.9:8080")}
	batch  = &authz.Conn{Source: netip.MustParseAddr("10.1.0.7"), Identity: "spiffe://cluster.local/ns/batch/sa/job", Dest: netip.MustParseAddrPort("10.0.0.9:8080")}
	admin  = &authz.Conn{Source: netip.MustParseAddr("10.0.0.2"), Identity: "spiffe://cluster.local/ns/shop/sa/client", Dest: netip.MustParseAddrPort("10.0.0.9:9090")}
	plain  = &authz.Conn{Source: netip.MustParseAddr("10.0.0.2"), Dest: netip.MustParseAddrPort("10.0.0.9:8080")}
)

// TestTranslateEndToEnd runs Istio's documented L4 examples (and the
// fail-safe cases) through Translate and then the proxy's decision: the
// contract is what a ztunnel would consume.
func TestTranslateEndToEnd(t *testing.T) {
	for _, tc := range []struct {
		name    string
		doc     string
		scope   security.Scope
		allowed []*authz.Conn
		denied  []*authz.Conn
		dryRun  []*authz.Conn // allowed, reported as dry-run
		warning string
	}{
		{
			name: "allow one service account to reach a workload", doc: `
metadata: {name: allow-client, namespace: shop}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules:
  - from:
    - source: {principals: ["cluster.local/ns/shop/sa/client"]}`,
			scope: security.Scope_WORKLOAD_SELECTOR, allowed: []*authz.Conn{client, admin}, denied: []*authz.Conn{batch, plain},
		},
		{
			name: "deny a namespace", doc: `
metadata: {name: deny-batch, namespace: shop}
spec:
  action: DENY
  rules:
  - from:
    - source: {namespaces: ["batch"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client, plain}, denied: []*authz.Conn{batch},
		},
		{
			name: "port-restricted rule", doc: `
metadata: {name: http-only, namespace: shop}
spec:
  rules:
  - to:
    - operation: {ports: ["8080"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client, batch, plain}, denied: []*authz.Conn{admin},
		},
		{
			name: "an L7 rule in an ALLOW policy fails safe (dropped)", doc: `
metadata: {name: get-only, namespace: shop}
spec:
  rules:
  - to:
    - operation: {methods: ["GET"]}`,
			scope: security.Scope_NAMESPACE, denied: []*authz.Conn{client, batch, plain}, warning: "to[0].operation.methods is an HTTP attribute",
		},
		{
			name: "an L7 rule in a DENY policy keeps its L4 part", doc: `
metadata: {name: no-admin, namespace: shop}
spec:
  action: DENY
  rules:
  - to:
    - operation: {ports: ["9090"], paths: ["/admin"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client}, denied: []*authz.Conn{admin}, warning: "enforced without it",
		},
		{
			name: "when conditions", doc: `
metadata: {name: when, namespace: shop}
spec:
  rules:
  - when:
    - {key: source.namespace, values: ["shop"]}
    - {key: destination.port, notValues: ["9090"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client}, denied: []*authz.Conn{admin, batch, plain},
		},
		{
			name: "an HTTP condition in an ALLOW policy drops the rule", doc: `
metadata: {name: jwt, namespace: shop}
spec:
  rules:
  - when:
    - {key: "request.auth.claims[iss]", values: ["x"]}`,
			scope: security.Scope_NAMESPACE, denied: []*authz.Conn{client}, warning: `when[0] key "request.auth.claims[iss]"`,
		},
		{
			name: "root namespace is mesh-wide", doc: `
metadata: {name: mesh-deny, namespace: istio-system}
spec:
  action: DENY
  rules:
  - from:
    - source: {notNamespaces: ["shop"]}`,
			scope: security.Scope_GLOBAL, allowed: []*authz.Conn{client}, denied: []*authz.Conn{batch, plain},
		},
		{
			name: "AUDIT is logged, never blocks", doc: `
metadata: {name: audit, namespace: shop}
spec:
  action: AUDIT
  rules:
  - from:
    - source: {namespaces: ["batch"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client}, dryRun: []*authz.Conn{batch},
		},
		{
			name: "dry-run annotation", doc: `
metadata: {name: dry, namespace: shop, annotations: {istio.io/dry-run: "true"}}
spec:
  action: DENY
  rules:
  - from:
    - source: {namespaces: ["batch"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client}, dryRun: []*authz.Conn{batch},
		},
		{
			name: "CUSTOM fails closed", doc: `
metadata: {name: ext, namespace: shop}
spec:
  action: CUSTOM
  provider: {name: opa}
  rules:
  - {}`,
			scope: security.Scope_NAMESPACE, denied: []*authz.Conn{client, batch, plain}, warning: "cannot be enforced",
		},
		{
			name: "an invalid CIDR in an ALLOW rule drops the rule", doc: `
metadata: {name: bad-allow, namespace: shop}
spec:
  rules:
  - from:
    - source: {ipBlocks: ["10.0.0.0/33"]}`,
			scope: security.Scope_NAMESPACE, denied: []*authz.Conn{client, plain}, warning: "invalid CIDR",
		},
		{
			name: "an invalid CIDR in a DENY rule widens it", doc: `
metadata: {name: bad-deny, namespace: shop}
spec:
  action: DENY
  rules:
  - from:
    - source: {ipBlocks: ["10.9.0.0/16", "nonsense"]}
    to:
    - operation: {ports: ["8080"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{admin}, denied: []*authz.Conn{client, batch, plain}, warning: "invalid address",
		},
		{
			name: "an unknown field fails closed", doc: `
metadata: {name: typo, namespace: shop}
spec:
  rules:
  - from:
    - source: {principal: ["cluster.local/ns/shop/sa/client"]}`,
			scope: security.Scope_NAMESPACE, denied: []*authz.Conn{client, batch, plain}, warning: "served failing closed",
		},
		{
			name: "ALLOW with no rules denies all", doc: `
metadata: {name: deny-all, namespace: shop}
spec: {}`,
			scope: security.Scope_NAMESPACE, denied: []*authz.Conn{client, plain},
		},
		{
			name: "ALLOW with an empty rule allows all", doc: `
metadata: {name: allow-all, namespace: shop}
spec:
  rules: [{}]`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client, batch, plain},
		},
		{
			name: "service accounts", doc: `
metadata: {name: sa, namespace: shop}
spec:
  rules:
  - from:
    - source: {serviceAccounts: ["client", "batch/job"]}`,
			scope: security.Scope_NAMESPACE, allowed: []*authz.Conn{client, batch}, denied: []*authz.Conn{plain},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := parse(t, tc.doc)
			tr := Translate("istio-system", o)
			if tr.Authorization.GetScope() != tc.scope {
				t.Errorf("scope %v, want %v", tr.Authorization.GetScope(), tc.scope)
			}
			all := strings.Join(tr.Warnings, "\n")
			if tc.warning != "" && !strings.Contains(all, tc.warning) {
				t.Errorf("warnings %q lack %q", all, tc.warning)
			}
			if tc.warning == "" && len(tr.Warnings) > 0 {
				t.Errorf("unexpected warnings: %s", all)
			}
			tb := authz.NewTable()
			if err := tb.Upsert(tr.Authorization); err != nil {
				t.Fatalf("the proxy rejects the translation: %v", err)
			}
			dst := authz.Target{Namespace: "shop", Policies: []string{o.Key()}}
			for _, c := range tc.allowed {
				if d := tb.Decide(c, dst); !d.Allow || d.DryRun != "" {
					t.Errorf("%s -> %s: %s, want allowed", c.Identity, c.Dest, d)
				}
			}
			for _, c := range tc.denied {
				if d := tb.Decide(c, dst); d.Allow {
					t.Errorf("%s -> %s: %s, want denied", c.Identity, c.Dest, d)
				}
			}
			for _, c := range tc.dryRun {
				if d := tb.Decide(c, dst); !d.Allow || d.DryRun != o.Key() {
					t.Errorf("%s -> %s: %+v, want allowed with dry-run %s", c.Identity, c.Dest, d, o.Key())
				}
			}
		})
	}
}

// BenchmarkTranslate10k: 10,000 AuthorizationPolicies (a principal, a
// namespace, a port and a CIDR each) translated and served by the model,
// with the heap they hold afterwards.
func BenchmarkTranslate10k(b *testing.B) {
	objs := make([]*Object, 10000)
	for i := range objs {
		objs[i] = &Object{Namespace: fmt.Sprintf("ns-%d", i%100), Name: fmt.Sprintf("p-%d", i), Spec: &securityv1beta1.AuthorizationPolicy{
			Selector: &typev1beta1.WorkloadSelector{MatchLabels: map[string]string{"app": fmt.Sprintf("app-%d", i%50)}},
			Rules: []*securityv1beta1.Rule{{
				From: []*securityv1beta1.Rule_From{{Source: &securityv1beta1.Source{
					Principals: []string{fmt.Sprintf("cluster.local/ns/ns-%d/sa/sa-%d", i%100, i)}, Namespaces: []string{"shop"}, IpBlocks: []string{"10.0.0.0/8"},
				}}},
				To: []*securityv1beta1.Rule_To{{Operation: &securityv1beta1.Operation{Ports: []string{"8080"}}}},
			}},
		}}
	}
	var heap uint64
	for b.Loop() {
		before := liveHeap()
		x := workload.NewIndex()
		m := New("istio-system", x, nil, nil)
		m.Replace(objs)
		heap = liveHeap() - before
		if x.Authorizations().Len() != len(objs) {
			b.Fatalf("%d served", x.Authorizations().Len())
		}
		runtime.KeepAlive(m)
	}
	b.ReportMetric(float64(heap)/float64(len(objs)), "B/policy")
}

func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
