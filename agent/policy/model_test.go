package policy

import (
	"net/netip"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/registry"
	"aether.io/node/xds/workload"
)

type fakeServices map[string]map[string]bool // uid -> "ns/name"

func (f fakeServices) Services(string) map[string]*workloadpb.PortList { return nil }
func (f fakeServices) MemberOf(uid, ns, name string) bool              { return f[uid][ns+"/"+name] }

func boundTo(t *testing.T, x *workload.Index, uid string) []string {
	t.Helper()
	var w workloadpb.Workload
	if err := proto.Unmarshal(x.Get(uid).Body, &w); err != nil {
		t.Fatal(err)
	}
	return w.GetAuthorizationPolicies()
}

// TestModelBindsWorkloads: selector policies bind the workloads whose
// labels match (root-namespace ones in every namespace), targetRefs bind a
// Service's endpoints, namespace policies bind none; a policy change
// rebinds the workloads at once; policies are served by key.
func TestModelBindsWorkloads(t *testing.T) {
	x := workload.NewIndex()
	web, batch := workload.UID("Kubernetes", "shop", "web-1"), workload.UID("Kubernetes", "batch", "job-1")
	m := New("istio-system", x, fakeServices{web: {"shop/web": true}}, nil)
	cfg := workload.Config{ClusterID: "Kubernetes", ObserveLabels: m.ObserveLabels}
	for _, ep := range []registry.Endpoint{
		{Key: "a", Namespace: "shop", Name: "web-1", Labels: map[string]string{"app": "web"}, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}},
		{Key: "b", Namespace: "batch", Name: "job-1", Labels: map[string]string{"app": "job"}, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.2")}},
	} {
		w, err := workload.Build(cfg, ep)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Upsert(ep.Key, w); err != nil {
			t.Fatal(err)
		}
	}
	m.Upsert(parse(t, `
metadata: {name: web-sel, namespace: shop}
spec: {selector: {matchLabels: {app: web}}}`))
	m.Upsert(parse(t, `
metadata: {name: mesh-jobs, namespace: istio-system}
spec: {selector: {matchLabels: {app: job}}, action: DENY, rules: [{}]}`))
	m.Upsert(parse(t, `
metadata: {name: by-service, namespace: shop}
spec: {targetRefs: [{kind: Service, name: web}], rules: [{}]}`))
	m.Upsert(parse(t, `
metadata: {name: ns-wide, namespace: shop}
spec: {rules: [{}]}`))
	if got := boundTo(t, x, web); !slices.Equal(got, []string{"shop/by-service", "shop/web-sel"}) {
		t.Errorf("web bound to %v", got)
	}
	if got := boundTo(t, x, batch); !slices.Equal(got, []string{"istio-system/mesh-jobs"}) {
		t.Errorf("job bound to %v", got)
	}
	if x.Authorizations().Len() != 4 || m.Len() != 4 {
		t.Errorf("%d policies served, %d held; want 4", x.Authorizations().Len(), m.Len())
	}
	m.Upsert(parse(t, `
metadata: {name: web-sel, namespace: shop}
spec: {selector: {matchLabels: {app: other}}}`))
	if got := boundTo(t, x, web); !slices.Equal(got, []string{"shop/by-service"}) {
		t.Errorf("after the selector changed, web bound to %v", got)
	}
	m.Replace(nil)
	if got := boundTo(t, x, web); len(got) != 0 || x.Authorizations().Len() != 0 {
		t.Errorf("after Replace(nil): web bound to %v, %d served", got, x.Authorizations().Len())
	}
	x.Remove("a")
	if _, ok := m.podNS[web]; ok {
		t.Error("a removed workload's labels are kept")
	}
}
