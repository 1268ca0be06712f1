package peers

import (
	"fmt"
	"reflect"
	"testing"
	"unsafe"

	"google.golang.org/protobuf/proto"

	"aether.io/node/api/istio/workload"
)

// decoded returns endpoint i of Service web as the proxy receives it:
// decoded from the wire, so each carries its own copies of every string
// and its own services map.
func decoded(t *testing.T, i int, target uint32) *workload.Workload {
	t.Helper()
	w := &workload.Workload{
		Uid: fmt.Sprintf("Kubernetes//Pod/shop/web-%d", i), Name: fmt.Sprintf("web-%d", i), Namespace: "shop",
		WorkloadName: "web", CanonicalName: "web", CanonicalRevision: "latest", ClusterId: "Kubernetes",
		TrustDomain: "cluster.local", ServiceAccount: "web", Status: workload.WorkloadStatus_HEALTHY,
		Addresses: [][]byte{{10, 0, 0, byte(i + 1)}},
		Services: map[string]*workload.PortList{
			"shop/web.shop.svc.cluster.local": {Ports: []*workload.Port{{ServicePort: 80, TargetPort: target}}},
		},
	}
	b, err := proto.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	out := &workload.Workload{}
	if err := proto.Unmarshal(b, out); err != nil {
		t.Fatal(err)
	}
	return out
}

func sameString(a, b string) bool { return unsafe.StringData(a) == unsafe.StringData(b) }

// TestRepeatedStateHeldOnce: workloads of one Service, each decoded on its
// own, share one copy of their repeated strings (namespace, workload and
// canonical names, revision, cluster, SPIFFE id) and one services map per
// distinct content, in the peer index and the Service table; removing
// them all leaves nothing held.
func TestRepeatedStateHeldOnce(t *testing.T) {
	x, s := NewIndex(), NewServices()
	for i := range 3 {
		target := uint32(8080)
		if i == 2 {
			target = 9090 // another port mapping: its own map
		}
		w := decoded(t, i, target)
		x.Upsert(w)
		s.UpsertWorkload(w)
	}
	a, b := x.byUID["Kubernetes//Pod/shop/web-0"].peer, x.byUID["Kubernetes//Pod/shop/web-1"].peer
	for _, f := range []func(Peer) string{
		func(p Peer) string { return p.Namespace }, func(p Peer) string { return p.Workload },
		func(p Peer) string { return p.CanonicalName }, func(p Peer) string { return p.CanonicalRevision },
		func(p Peer) string { return p.Cluster }, func(p Peer) string { return p.Identity },
	} {
		if f(a) != f(b) || !sameString(f(a), f(b)) {
			t.Errorf("peers hold %q twice, want one copy", f(a))
		}
	}
	m0, m1, m2 := s.members["Kubernetes//Pod/shop/web-0"], s.members["Kubernetes//Pod/shop/web-1"], s.members["Kubernetes//Pod/shop/web-2"]
	if !sameString(m0.identity, m1.identity) {
		t.Error("members hold their SPIFFE id twice")
	}
	if reflect.ValueOf(m0.services).UnsafePointer() != reflect.ValueOf(m1.services).UnsafePointer() {
		t.Error("endpoints with the same services map hold one each")
	}
	if reflect.ValueOf(m0.services).UnsafePointer() == reflect.ValueOf(m2.services).UnsafePointer() {
		t.Error("endpoints with different target ports share a services map")
	}
	if got := m2.services["shop/web.shop.svc.cluster.local"].GetPorts()[0].GetTargetPort(); got != 9090 {
		t.Errorf("endpoint 2's target port %d, want its own 9090", got)
	}
	x.Upsert(decoded(t, 0, 8080)) // a new version: the strings stay held once
	for i := range 3 {
		uid := fmt.Sprintf("Kubernetes//Pod/shop/web-%d", i)
		x.Remove(uid)
		s.RemoveWorkload(uid)
	}
	if len(x.strs) != 0 || len(s.strs) != 0 || len(s.sets) != 0 {
		t.Errorf("after every workload went: %d, %d strings and %d services maps still held", len(x.strs), len(s.strs), len(s.sets))
	}
}
