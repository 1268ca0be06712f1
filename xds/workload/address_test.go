package workload

import (
	"context"
	"errors"
	"maps"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	sotwclient "github.com/envoyproxy/go-control-plane/pkg/client/sotw/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	securitypb "aether.io/node/api/istio/security"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/resource"
)

func testService(name string, vip [4]byte) *workloadpb.Service {
	return &workloadpb.Service{
		Name: name, Namespace: "shop", Hostname: name + ".shop.svc.cluster.local",
		Addresses: []*workloadpb.NetworkAddress{{Address: vip[:]}},
		Ports:     []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}},
	}
}

// decodeAddress decodes an Address resource body.
func decodeAddress(t *testing.T, body []byte) *workloadpb.Address {
	t.Helper()
	var a workloadpb.Address
	if err := proto.Unmarshal(body, &a); err != nil {
		t.Fatalf("address does not decode: %v", err)
	}
	return &a
}

// TestAddressesMirrorWorkloads: every workload the index serves is served
// by its Address view under the same name, as Address{workload} holding the
// workload's exact bytes, and leaves it with the workload; Services live
// only in the Address view.
func TestAddressesMirrorWorkloads(t *testing.T) {
	x := NewIndex()
	fill(t, x, 3)
	a := x.Addresses()
	if a == nil || a.TypeURL() != resource.AddressType || a.Addresses() != nil {
		t.Fatalf("Addresses() = %v: want an Address index without a view of its own", a)
	}
	if a.Len() != 3 {
		t.Fatalf("address view holds %d, want 3", a.Len())
	}
	for _, name := range currentNames(x) {
		w, ad := x.Get(name), a.Get(name)
		if ad == nil {
			t.Fatalf("workload %s not in the address view", name)
		}
		got := decodeAddress(t, ad.Body).GetWorkload()
		var want workloadpb.Workload
		if err := proto.Unmarshal(w.Body, &want); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(got, &want) {
			t.Errorf("address of %s carries %v, want %v", name, got, &want)
		}
		if &ad.Body[len(ad.Body)-1] != &w.Body[len(w.Body)-1] {
			t.Errorf("address of %s holds a copy of the workload's bytes, want the same bytes", name)
		}
		if ad.Any().GetTypeUrl() != resource.AddressType || ad.Delta().GetResource().GetTypeUrl() != resource.AddressType {
			t.Errorf("address of %s typed %q", name, ad.Any().GetTypeUrl())
		}
	}
	svcs := a.Writer(ServiceSource)
	if _, err := svcs.UpsertService(testService("web", [4]byte{10, 96, 0, 10})); err != nil {
		t.Fatal(err)
	}
	if x.Len() != 3 || a.Len() != 4 {
		t.Fatalf("after a service: %d workloads, %d addresses; want 3, 4", x.Len(), a.Len())
	}
	got := decodeAddress(t, a.Get("shop/web.shop.svc.cluster.local").Body).GetService()
	if !proto.Equal(got, testService("web", [4]byte{10, 96, 0, 10})) {
		t.Errorf("service served as %v", got)
	}
	x.Remove(endpointN(1).Key)
	if a.Len() != 3 || a.Get(UID("Kubernetes", "shop", endpointN(1).Name)) != nil {
		t.Errorf("removed workload still in the address view (%d addresses)", a.Len())
	}
	if !svcs.RemoveService("shop", "web.shop.svc.cluster.local") || a.Len() != 2 {
		t.Errorf("service not removed: %d addresses", a.Len())
	}
}

func currentNames(x *Index) []string {
	return slices.Sorted(maps.Keys(currentVersions(x)))
}

func TestUpsertServiceRejects(t *testing.T) {
	x := NewIndex()
	if _, err := x.Writer(ServiceSource).UpsertService(testService("web", [4]byte{10, 96, 0, 1})); !errors.Is(err, ErrNotAddressIndex) {
		t.Errorf("service into the workload index: %v, want ErrNotAddressIndex", err)
	}
	w := x.Addresses().Writer(ServiceSource)
	for name, s := range map[string]*workloadpb.Service{
		"no hostname":  {Name: "web", Namespace: "shop"},
		"bad address":  {Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local", Addresses: []*workloadpb.NetworkAddress{{Address: []byte{10, 0, 1}}}},
		"port 0":       {Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local", Ports: []*workloadpb.Port{{TargetPort: 80}}},
		"port > 65535": {Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local", Ports: []*workloadpb.Port{{ServicePort: 70000}}},
	} {
		if _, err := w.UpsertService(s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if x.Addresses().Len() != 0 {
		t.Errorf("rejected services served: %d", x.Addresses().Len())
	}
}

// fakeMembers is a Membership keyed by uid.
type fakeMembers struct {
	mu sync.Mutex
	m  map[string]map[string]*workloadpb.PortList
}

func (f *fakeMembers) Services(uid string) map[string]*workloadpb.PortList {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.m[uid]
}

func (f *fakeMembers) set(uid string, s map[string]*workloadpb.PortList) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.m[uid] = s
}

func servicesOf(t *testing.T, x *Index, uid string) map[string]*workloadpb.PortList {
	t.Helper()
	var w workloadpb.Workload
	if err := proto.Unmarshal(x.Get(uid).Body, &w); err != nil {
		t.Fatal(err)
	}
	return w.GetServices()
}

// TestMembershipRefresh: upserted workloads carry their membership; a
// changed membership is served (in both views) by Refresh, and only for
// the workloads whose map changed.
func TestMembershipRefresh(t *testing.T) {
	x := NewIndex()
	web := map[string]*workloadpb.PortList{"shop/web.shop.svc.cluster.local": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}}
	uid0 := UID("Kubernetes", "shop", endpointN(0).Name)
	uid1 := UID("Kubernetes", "shop", endpointN(1).Name)
	m := &fakeMembers{m: map[string]map[string]*workloadpb.PortList{uid0: web}}
	x.SetMembership(m)
	fill(t, x, 2)
	if got := servicesOf(t, x, uid0); len(got) != 1 || got["shop/web.shop.svc.cluster.local"].GetPorts()[0].GetTargetPort() != 8080 {
		t.Fatalf("workload 0 services = %v", got)
	}
	if got := servicesOf(t, x, uid1); len(got) != 0 {
		t.Fatalf("workload 1 services = %v, want none", got)
	}
	sub, cancel := x.Addresses().Watch()
	defer cancel()
	sub.ApplyDelta(true, nil, nil)
	m.set(uid1, web)
	n, err := x.Refresh([]string{uid0, uid1, "Kubernetes//Pod/shop/absent"})
	if err != nil || n != 1 {
		t.Fatalf("Refresh = %d, %v; want 1 change (workload 1)", n, err)
	}
	if got := servicesOf(t, x, uid1); len(got) != 1 {
		t.Errorf("workload 1 services after refresh = %v", got)
	}
	d := x.Addresses().DeltaResponse(sub, nil, false, Known{})
	if got := resourceNames(d.Resources); !slices.Equal(got, []string{uid1}) {
		t.Errorf("address view pushed %v, want [%s]", got, uid1)
	}
	if got := decodeAddress(t, x.Addresses().Get(uid1).Body).GetWorkload().GetServices(); len(got) != 1 {
		t.Errorf("address view of workload 1: services %v", got)
	}
	if n, _ := x.Refresh([]string{uid0, uid1}); n != 0 {
		t.Errorf("unchanged refresh changed %d", n)
	}
}

// TestDeltaStreamServesBothTypes: one delta stream subscribes to Workload
// and Address, as ztunnel subscribes to several types on one stream; each
// type is answered with its own type URL and its own resources, and a
// change reaches each type once.
func TestDeltaStreamServesBothTypes(t *testing.T) {
	for name, opts := range codecs {
		t.Run(name, func(t *testing.T) { testDeltaBothTypes(t, opts) })
	}
}

func testDeltaBothTypes(t *testing.T, opts []grpc.ServerOption) {
	x := NewIndex()
	fill(t, x, 2)
	if _, err := x.Addresses().Writer(ServiceSource).UpsertService(testService("web", [4]byte{10, 96, 0, 10})); err != nil {
		t.Fatal(err)
	}
	ts := startServerWith(t, x, opts)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := discovery.NewAggregatedDiscoveryServiceClient(dialTest(t, ts.socket)).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, typ := range []string{resource.AddressType, resource.WorkloadType} {
		if err := s.Send(&discovery.DeltaDiscoveryRequest{Node: &core.Node{Id: "ztunnel-like"}, TypeUrl: typ, ResourceNamesSubscribe: []string{"*"}}); err != nil {
			t.Fatal(err)
		}
	}
	recv := func() *discovery.DeltaDiscoveryResponse {
		t.Helper()
		resp, err := s.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range resp.GetResources() {
			if r.GetResource().GetTypeUrl() != resp.GetTypeUrl() {
				t.Errorf("%s response holds a %s", resp.GetTypeUrl(), r.GetResource().GetTypeUrl())
			}
		}
		if err := s.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resp.GetTypeUrl(), ResponseNonce: resp.GetNonce()}); err != nil {
			t.Fatal(err)
		}
		return resp
	}
	got := map[string][]string{}
	for range 2 {
		resp := recv()
		got[resp.GetTypeUrl()] = names(resp)
	}
	if len(got[resource.AddressType]) != 3 || len(got[resource.WorkloadType]) != 2 {
		t.Fatalf("initial responses %v: want 3 addresses (2 workloads, 1 service) and 2 workloads", got)
	}
	// A workload change reaches both types; a service change only Address.
	x.Remove(endpointN(0).Key)
	gone := UID("Kubernetes", "shop", endpointN(0).Name)
	removed := map[string][]string{}
	deadline := time.After(10 * time.Second)
	for len(removed) < 2 {
		select {
		case <-deadline:
			t.Fatalf("removal reached %v only", removed)
		default:
		}
		resp := recv()
		removed[resp.GetTypeUrl()] = resp.GetRemovedResources()
	}
	for typ, r := range removed {
		if !slices.Equal(r, []string{gone}) {
			t.Errorf("%s removal = %v, want [%s]", typ, r, gone)
		}
	}
	if _, err := x.Addresses().Writer(ServiceSource).UpsertService(testService("api", [4]byte{10, 96, 0, 11})); err != nil {
		t.Fatal(err)
	}
	resp := recv()
	if resp.GetTypeUrl() != resource.AddressType || !slices.Equal(names(resp), []string{"shop/api.shop.svc.cluster.local"}) {
		t.Errorf("service push: %s %v", resp.GetTypeUrl(), names(resp))
	}
}

// TestSotWServesAddresses: a SotW client of resource.AddressType (go-control-plane's)
// gets every workload and Service as Addresses, and a Service change as
// the whole state.
func TestSotWServesAddresses(t *testing.T) {
	for name, opts := range codecs {
		t.Run(name, func(t *testing.T) {
			x := NewIndex()
			fill(t, x, 2)
			ts := startServerWith(t, x, opts)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c := sotwclient.NewADSClient(ctx, &core.Node{Id: "gcp-sotw-addr"}, resource.AddressType)
			if err := c.InitConnect(dialTest(t, ts.socket)); err != nil {
				t.Fatal(err)
			}
			count := func() (workloads, services int) {
				t.Helper()
				resp, err := c.Fetch()
				if err != nil {
					t.Fatal(err)
				}
				for _, a := range resp.Resources {
					if a.GetTypeUrl() != resource.AddressType {
						t.Errorf("resource type %q", a.GetTypeUrl())
					}
					switch ad := decodeAddress(t, a.GetValue()); {
					case ad.GetWorkload() != nil:
						workloads++
					case ad.GetService() != nil:
						services++
					}
				}
				if err := c.Ack(); err != nil {
					t.Fatal(err)
				}
				return workloads, services
			}
			if w, s := count(); w != 2 || s != 0 {
				t.Fatalf("initial state: %d workloads, %d services; want 2, 0", w, s)
			}
			if _, err := x.Addresses().Writer(ServiceSource).UpsertService(testService("web", [4]byte{10, 96, 0, 10})); err != nil {
				t.Fatal(err)
			}
			if w, s := count(); w != 2 || s != 1 {
				t.Fatalf("after a service: %d workloads, %d services; want 2, 1", w, s)
			}
		})
	}
}

// TestEndpointSourceYields: a workload known only from an EndpointSlice is
// served until the pod's own record claims the uid, which then wins
// whatever the order, and is served again once the record goes.
func TestEndpointSourceYields(t *testing.T) {
	x := NewIndex()
	ep := endpointN(0)
	real, err := Build(testConfig, ep)
	if err != nil {
		t.Fatal(err)
	}
	stub := &workloadpb.Workload{Uid: real.GetUid(), Name: real.GetName(), Namespace: "shop", Addresses: real.GetAddresses()}
	eps, local := x.Writer(EndpointSource), x.Writer("local")
	if _, err := eps.Upsert("ep/"+real.GetUid(), stub); err != nil {
		t.Fatal(err)
	}
	served := func() *workloadpb.Workload {
		var w workloadpb.Workload
		if err := proto.Unmarshal(x.Get(real.GetUid()).Body, &w); err != nil {
			t.Fatal(err)
		}
		return &w
	}
	if served().GetServiceAccount() != "" {
		t.Fatal("stub not served")
	}
	if _, err := local.Upsert(ep.Key, real); err != nil {
		t.Fatal(err)
	}
	stub.Node = "changed" // a later EndpointSlice update
	if _, err := eps.Upsert("ep/"+real.GetUid(), stub); err != nil {
		t.Fatal(err)
	}
	if got := served(); got.GetServiceAccount() != real.GetServiceAccount() {
		t.Fatalf("served %v, want the pod's record", got)
	}
	local.Remove(ep.Key)
	if got := served(); got.GetNode() != "changed" {
		t.Fatalf("after the record went, served %v, want the endpoint stub", got)
	}
}

// TestLazyClaimBuiltWhenServed: a lazy claim (Writer.UpsertLazy) is
// validated at once but holds no resource while the pod's record holds
// its uid (a Refresh does not build it either); once the record goes it
// is built and served with the membership of that moment, and when the
// record comes back it drops its resource again.
func TestLazyClaimBuiltWhenServed(t *testing.T) {
	x := NewIndex()
	ep := endpointN(0)
	real, err := Build(testConfig, ep)
	if err != nil {
		t.Fatal(err)
	}
	uid := real.GetUid()
	m := &fakeMembers{m: map[string]map[string]*workloadpb.PortList{}}
	x.SetMembership(m)
	eps, local := x.Writer(EndpointSource), x.Writer("local")
	if _, err := eps.UpsertLazy("ep/bad", func() *workloadpb.Workload { return &workloadpb.Workload{Uid: "bad"} }); err == nil {
		t.Fatal("a lazy claim without an address was accepted")
	}
	if _, err := local.Upsert(ep.Key, real); err != nil {
		t.Fatal(err)
	}
	builds := 0
	build := func() *workloadpb.Workload {
		builds++
		return &workloadpb.Workload{Uid: uid, Name: real.GetName(), Namespace: "shop", Node: "stub", Addresses: real.GetAddresses()}
	}
	if changed, err := eps.UpsertLazy("ep/"+uid, build); err != nil || changed {
		t.Fatalf("UpsertLazy under a record = %v, %v; want no change", changed, err)
	}
	web := map[string]*workloadpb.PortList{"shop/web.shop.svc.cluster.local": {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}}}}
	m.set(uid, web)
	if _, err := x.Refresh([]string{uid}); err != nil {
		t.Fatal(err)
	}
	if builds != 1 || x.keys["ep/"+uid].res != nil {
		t.Fatalf("outranked lazy claim: %d builds, resource %v; want 1 (validation), none", builds, x.keys["ep/"+uid].res)
	}
	local.Remove(ep.Key)
	var w workloadpb.Workload
	if err := proto.Unmarshal(x.Get(uid).Body, &w); err != nil {
		t.Fatal(err)
	}
	if w.GetNode() != "stub" || len(w.GetServices()) != 1 || builds != 2 {
		t.Fatalf("after the record went: served %v after %d builds; want the stub with its services, 2 builds", &w, builds)
	}
	if a := decodeAddress(t, x.Addresses().Get(uid).Body).GetWorkload(); a.GetNode() != "stub" {
		t.Fatalf("address view serves %v, want the stub", a)
	}
	if _, err := local.Upsert(ep.Key, real); err != nil {
		t.Fatal(err)
	}
	if x.keys["ep/"+uid].res != nil || servicesOf(t, x, uid) == nil {
		t.Fatal("the record is back but the lazy claim kept its resource (or the record lost its services)")
	}
}

// BenchmarkIndexMemory reports the heap per workload of an index without
// and with its Address view (which shares the workloads' bytes).
func BenchmarkIndexMemory(b *testing.B) {
	const n = 20000
	for _, tc := range []struct {
		name string
		mk   func() *Index
	}{
		{"workloads-only", func() *Index { return newIndex(resource.WorkloadType) }},
		{"with-address-view", NewIndex},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var per float64
			for range b.N {
				before := liveHeap()
				x := tc.mk()
				fill(b, x, n)
				per = float64(liveHeap()-before) / n
				runtime.KeepAlive(x)
			}
			b.ReportMetric(per, "B/workload")
		})
	}
}

func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// bindingMembers is a Membership that also binds policies.
type bindingMembers struct {
	fakeMembers
	policies  map[string][]string
	forgotten []string
}

func (b *bindingMembers) Policies(uid string) []string { return b.policies[uid] }
func (b *bindingMembers) Forget(uid string)            { b.forgotten = append(b.forgotten, uid) }

// TestAuthorizationView: policies are served under <namespace>/<name> in
// the Authorization view (and only there); a PolicyBinding fills each
// workload's authorization_policies, and is told when a uid goes.
func TestAuthorizationView(t *testing.T) {
	x := NewIndex()
	uid0 := UID("Kubernetes", "shop", endpointN(0).Name)
	b := &bindingMembers{fakeMembers: fakeMembers{m: map[string]map[string]*workloadpb.PortList{}}, policies: map[string][]string{uid0: {"shop/web-allow"}}}
	x.SetMembership(b)
	fill(t, x, 1)
	var w workloadpb.Workload
	if err := proto.Unmarshal(x.Get(uid0).Body, &w); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(w.GetAuthorizationPolicies(), []string{"shop/web-allow"}) {
		t.Errorf("authorization_policies = %v", w.GetAuthorizationPolicies())
	}
	if _, err := x.Addresses().Writer(AuthorizationSource).UpsertAuthorization(&securitypb.Authorization{Name: "p", Namespace: "shop"}); !errors.Is(err, ErrNotAuthorizationIndex) {
		t.Errorf("policy into the Address view: %v", err)
	}
	aw := x.Authorizations().Writer(AuthorizationSource)
	if _, err := aw.UpsertAuthorization(&securitypb.Authorization{Name: "web-allow", Namespace: "shop", Scope: securitypb.Scope_WORKLOAD_SELECTOR}); err != nil {
		t.Fatal(err)
	}
	if _, err := aw.UpsertAuthorization(&securitypb.Authorization{Namespace: "shop"}); err == nil {
		t.Error("a policy without a name was accepted")
	}
	r := x.Authorizations().Get("shop/web-allow")
	if r == nil || r.Any().GetTypeUrl() != resource.AuthorizationType || x.Addresses().Get("shop/web-allow") != nil {
		t.Fatalf("policy served as %v", r)
	}
	x.Remove(endpointN(0).Key)
	if !slices.Equal(b.forgotten, []string{uid0}) {
		t.Errorf("forgotten %v, want [%s]", b.forgotten, uid0)
	}
}
