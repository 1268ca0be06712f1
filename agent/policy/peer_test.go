package policy

import (
	"net/netip"
	"slices"
	"testing"

	"sigs.k8s.io/yaml"

	"aether.io/node/pkg/authz"
	"aether.io/node/registry"
	"aether.io/node/xds/workload"
)

func peer(t *testing.T, doc string) *PeerObject {
	t.Helper()
	raw, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	o, err := ParsePeerObject(raw)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// TestPeerAuthentication: the effective mTLS mode of each workload, as
// Istio picks it (mesh, then namespace, then workload; the oldest at a
// level; DISABLE as PERMISSIVE), becomes the policies it is bound to, and
// the proxy's decision refuses plaintext exactly where the mode is STRICT
// (port-level modes included); HBONE always passes.
func TestPeerAuthentication(t *testing.T) {
	const (
		meshStrict = `
metadata: {name: mesh, namespace: istio-system, creationTimestamp: "2026-01-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}`
		nsPermissive = `
metadata: {name: open, namespace: legacy, creationTimestamp: "2026-01-01T00:00:00Z"}
spec: {mtls: {mode: PERMISSIVE}}`
		nsNewerStrict = `
metadata: {name: newer, namespace: legacy, creationTimestamp: "2026-06-01T00:00:00Z"}
spec: {mtls: {mode: STRICT}}`
		dbPorts = `
metadata: {name: db, namespace: shop, creationTimestamp: "2026-01-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: db}}
  portLevelMtls:
    "9090": {mode: DISABLE}`
		cachePorts = `
metadata: {name: cache, namespace: legacy, creationTimestamp: "2026-01-01T00:00:00Z"}
spec:
  selector: {matchLabels: {app: cache}}
  portLevelMtls:
    "6379": {mode: STRICT}`
	)
	x := workload.NewIndex()
	m := New("istio-system", x, nil, nil)
	cfg := workload.Config{ClusterID: "Kubernetes", ObserveLabels: m.ObserveLabels}
	pods := map[string]registry.Endpoint{
		"web":   {Key: "1", Namespace: "shop", Name: "web", Labels: map[string]string{"app": "web"}},
		"db":    {Key: "2", Namespace: "shop", Name: "db", Labels: map[string]string{"app": "db"}},
		"old":   {Key: "3", Namespace: "legacy", Name: "old", Labels: map[string]string{"app": "old"}},
		"cache": {Key: "4", Namespace: "legacy", Name: "cache", Labels: map[string]string{"app": "cache"}},
	}
	for _, ep := range pods {
		ep.IPs = []netip.Addr{netip.MustParseAddr("10.0.0." + ep.Key)}
		w, err := workload.Build(cfg, ep)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Upsert(ep.Key, w); err != nil {
			t.Fatal(err)
		}
	}
	m.ReplacePeers([]*PeerObject{peer(t, meshStrict), peer(t, nsPermissive), peer(t, nsNewerStrict), peer(t, dbPorts), peer(t, cachePorts)})

	tb := authz.NewTable()
	for _, name := range []string{"istio-system/" + StaticStrictName, "shop/" + peerPolicyPrefix + "db", "legacy/" + peerPolicyPrefix + "cache"} {
		r := x.Authorizations().Get(name)
		if r == nil {
			t.Fatalf("%s not served", name)
		}
		a, err := decodeAuthorization(r.Body)
		if err != nil {
			t.Fatal(err)
		}
		if err := tb.Upsert(a); err != nil {
			t.Fatal(err)
		}
	}
	plaintext := func(pod string, port uint16) bool {
		ep := pods[pod]
		uid := workload.UID("Kubernetes", ep.Namespace, ep.Name)
		d := tb.Decide(&authz.Conn{Source: netip.MustParseAddr("10.9.9.9"), Dest: netip.AddrPortFrom(netip.MustParseAddr("10.0.0."+ep.Key), port)},
			authz.Target{Namespace: ep.Namespace, Policies: boundTo(t, x, uid)})
		return d.Allow
	}
	mtls := func(pod string, port uint16) bool {
		ep := pods[pod]
		uid := workload.UID("Kubernetes", ep.Namespace, ep.Name)
		d := tb.Decide(&authz.Conn{Source: netip.MustParseAddr("10.9.9.9"), Identity: "spiffe://cluster.local/ns/x/sa/y", Dest: netip.AddrPortFrom(netip.MustParseAddr("10.0.0."+ep.Key), port)},
			authz.Target{Namespace: ep.Namespace, Policies: boundTo(t, x, uid)})
		return d.Allow
	}
	for _, tc := range []struct {
		pod       string
		port      uint16
		plaintext bool
	}{
		{"web", 8080, false},   // mesh STRICT
		{"db", 8080, false},    // mesh STRICT, port-level only on 9090
		{"db", 9090, true},     // DISABLE on the port: PERMISSIVE
		{"old", 8080, true},    // namespace PERMISSIVE (the oldest of two) over mesh STRICT
		{"cache", 8080, true},  // namespace PERMISSIVE
		{"cache", 6379, false}, // port-level STRICT
	} {
		if got := plaintext(tc.pod, tc.port); got != tc.plaintext {
			t.Errorf("plaintext to %s:%d allowed=%v, want %v (bound to %v)", tc.pod, tc.port, got, tc.plaintext,
				boundTo(t, x, workload.UID("Kubernetes", pods[tc.pod].Namespace, tc.pod)))
		}
		if !mtls(tc.pod, tc.port) {
			t.Errorf("HBONE to %s:%d refused", tc.pod, tc.port)
		}
	}
	// The mesh-wide one goes: web is PERMISSIVE, nothing is bound.
	m.DeletePeer("istio-system", "mesh")
	if got := boundTo(t, x, workload.UID("Kubernetes", "shop", "web")); len(got) != 0 {
		t.Errorf("without the mesh policy web is bound to %v", got)
	}
	if got := boundTo(t, x, workload.UID("Kubernetes", "shop", "db")); slices.Contains(got, "shop/"+peerPolicyPrefix+"db") {
		t.Errorf("db's port-level policy still bound though every port is now permissive: %v", got)
	}
}
