package peers_test

import (
	"fmt"
	"net/netip"
	"testing"

	"aether.io/node/api/istio/workload"
	"aether.io/node/proxy/peers"
)

const svcKey = "shop/web.shop.svc.cluster.local"

func webService(lb *workload.LoadBalancing, ports ...*workload.Port) *workload.Service {
	if len(ports) == 0 {
		ports = []*workload.Port{{ServicePort: 80, TargetPort: 8080}}
	}
	return &workload.Service{
		Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local",
		Addresses:     []*workload.NetworkAddress{{Address: raw("10.96.0.10")}, {Address: raw("fd00:96::10")}},
		Ports:         ports,
		LoadBalancing: lb,
	}
}

type ep struct {
	name, node, zone string
	addrs            []string
	unhealthy        bool
	ports            []*workload.Port // this endpoint's own mapping; nil: none
	notMember        bool
}

func (e ep) workload() *workload.Workload {
	w := &workload.Workload{
		Uid: "Kubernetes//Pod/shop/" + e.name, Name: e.name, Namespace: "shop", TrustDomain: "cluster.local",
		ServiceAccount: "web", TunnelProtocol: workload.TunnelProtocol_HBONE, Node: e.node,
		Locality: &workload.Locality{Region: "eu", Zone: e.zone},
	}
	for _, a := range e.addrs {
		w.Addresses = append(w.Addresses, raw(a))
	}
	if e.unhealthy {
		w.Status = workload.WorkloadStatus_UNHEALTHY
	}
	if !e.notMember {
		w.Services = map[string]*workload.PortList{svcKey: {Ports: e.ports}}
	}
	return w
}

var preferSameNode = []workload.LoadBalancing_Scope{
	workload.LoadBalancing_NETWORK, workload.LoadBalancing_REGION, workload.LoadBalancing_ZONE,
	workload.LoadBalancing_SUBZONE, workload.LoadBalancing_NODE,
}

var (
	client = ep{name: "client", node: "node-a", zone: "z1", addrs: []string{"10.0.0.2"}, notMember: true}
	vip4   = netip.MustParseAddrPort("10.96.0.10:80")
	src    = netip.MustParseAddr("10.0.0.2")
)

// chooseSet runs Choose many times and returns which endpoint uids' pod
// names were chosen, or the verdict when nothing was.
func chooseSet(t *testing.T, x *peers.Services, dst netip.AddrPort, exclude netip.AddrPort) (map[string]bool, peers.Verdict) {
	t.Helper()
	seen := map[string]bool{}
	var v peers.Verdict
	for range 400 {
		var e peers.Endpoint
		var ref peers.ServiceRef
		e, ref, v = x.Choose(src, dst, exclude)
		if v != peers.Chosen {
			return nil, v
		}
		if ref.Name != "web" || ref.Namespace != "shop" || ref.Hostname != "web.shop.svc.cluster.local" {
			t.Fatalf("service ref %+v", ref)
		}
		seen[fmt.Sprintf("%s@%s", e.UID[len("Kubernetes//Pod/shop/"):], e.Addr)] = true
	}
	return seen, v
}

func TestServicesChoose(t *testing.T) {
	// istiod's PreferSameNode: broadest scope first, ranked by how many
	// leading scopes match.
	preferClose := &workload.LoadBalancing{RoutingPreference: preferSameNode, Mode: workload.LoadBalancing_FAILOVER}
	strictNode := &workload.LoadBalancing{RoutingPreference: []workload.LoadBalancing_Scope{workload.LoadBalancing_NODE}, Mode: workload.LoadBalancing_STRICT}
	tests := []struct {
		name    string
		svc     *workload.Service
		eps     []ep
		dst     netip.AddrPort
		exclude netip.AddrPort
		want    []string // every endpoint that must be (and only those that may be) chosen
		verdict peers.Verdict
	}{
		{
			name: "uniform among healthy endpoints", svc: webService(nil),
			eps:  []ep{{name: "a", addrs: []string{"10.0.1.1"}}, {name: "b", addrs: []string{"10.0.1.2"}}, {name: "c", addrs: []string{"10.0.1.3"}}},
			want: []string{"a@10.0.1.1:8080", "b@10.0.1.2:8080", "c@10.0.1.3:8080"},
		},
		{
			name: "unhealthy endpoints are not chosen", svc: webService(nil),
			eps:  []ep{{name: "a", addrs: []string{"10.0.1.1"}}, {name: "b", addrs: []string{"10.0.1.2"}, unhealthy: true}},
			want: []string{"a@10.0.1.1:8080"},
		},
		{
			name: "ALLOW_ALL chooses unhealthy endpoints too", svc: webService(&workload.LoadBalancing{HealthPolicy: workload.LoadBalancing_ALLOW_ALL}),
			eps:  []ep{{name: "a", addrs: []string{"10.0.1.1"}}, {name: "b", addrs: []string{"10.0.1.2"}, unhealthy: true}},
			want: []string{"a@10.0.1.1:8080", "b@10.0.1.2:8080"},
		},
		{
			name: "only unhealthy endpoints: refused", svc: webService(nil),
			eps: []ep{{name: "b", addrs: []string{"10.0.1.2"}, unhealthy: true}}, verdict: peers.NoEndpoint,
		},
		{name: "no endpoints: refused", svc: webService(nil), verdict: peers.NoEndpoint},
		{
			name: "a workload naming no Service is no endpoint", svc: webService(nil),
			eps: []ep{{name: "a", addrs: []string{"10.0.1.1"}, notMember: true}}, verdict: peers.NoEndpoint,
		},
		{
			name: "named targetPort resolved per endpoint, unresolvable skipped",
			svc:  webService(nil, &workload.Port{ServicePort: 80}),
			eps: []ep{
				{name: "a", addrs: []string{"10.0.1.1"}, ports: []*workload.Port{{ServicePort: 80, TargetPort: 9001}}},
				{name: "b", addrs: []string{"10.0.1.2"}, ports: []*workload.Port{{ServicePort: 80, TargetPort: 9002}}},
				{name: "c", addrs: []string{"10.0.1.3"}},
			},
			want: []string{"a@10.0.1.1:9001", "b@10.0.1.2:9002"},
		},
		{
			name: "the endpoint's own mapping wins over the Service's target port", svc: webService(nil),
			eps:  []ep{{name: "a", addrs: []string{"10.0.1.1"}, ports: []*workload.Port{{ServicePort: 80, TargetPort: 9001}}}},
			want: []string{"a@10.0.1.1:9001"},
		},
		{
			name: "a port the Service does not have is no VIP", svc: webService(nil),
			eps: []ep{{name: "a", addrs: []string{"10.0.1.1"}}}, dst: netip.MustParseAddrPort("10.96.0.10:81"), verdict: peers.NotService,
		},
		{
			name: "another address is no VIP", svc: webService(nil),
			eps: []ep{{name: "a", addrs: []string{"10.0.1.1"}}}, dst: netip.MustParseAddrPort("10.0.1.1:80"), verdict: peers.NotService,
		},
		{
			name: "IPv4-mapped VIP", svc: webService(nil),
			eps: []ep{{name: "a", addrs: []string{"10.0.1.1"}}}, dst: netip.MustParseAddrPort("[::ffff:10.96.0.10]:80"), want: []string{"a@10.0.1.1:8080"},
		},
		{
			name: "IPv6 VIP chooses IPv6 endpoint addresses", svc: webService(nil),
			eps:  []ep{{name: "a", addrs: []string{"10.0.1.1", "fd00::1"}}, {name: "b", addrs: []string{"10.0.1.2"}}},
			dst:  netip.MustParseAddrPort("[fd00:96::10]:80"),
			want: []string{"a@[fd00::1]:8080"},
		},
		{
			name: "PreferSameNode: same node first", svc: webService(preferClose),
			eps: []ep{
				{name: "a", node: "node-a", zone: "z1", addrs: []string{"10.0.1.1"}},
				{name: "b", node: "node-b", zone: "z1", addrs: []string{"10.0.1.2"}},
				{name: "c", node: "node-c", zone: "z2", addrs: []string{"10.0.1.3"}},
			},
			want: []string{"a@10.0.1.1:8080"},
		},
		{
			name: "PreferSameNode: then the same zone", svc: webService(preferClose),
			eps: []ep{
				{name: "b", node: "node-b", zone: "z1", addrs: []string{"10.0.1.2"}},
				{name: "d", node: "node-d", zone: "z1", addrs: []string{"10.0.1.4"}},
				{name: "c", node: "node-c", zone: "z2", addrs: []string{"10.0.1.3"}},
			},
			want: []string{"b@10.0.1.2:8080", "d@10.0.1.4:8080"},
		},
		{
			name: "PreferSameNode: failover to anywhere", svc: webService(preferClose),
			eps:  []ep{{name: "c", node: "node-c", zone: "z2", addrs: []string{"10.0.1.3"}}},
			want: []string{"c@10.0.1.3:8080"},
		},
		{
			name: "STRICT node: nothing on the node is refused", svc: webService(strictNode),
			eps: []ep{{name: "c", node: "node-c", zone: "z1", addrs: []string{"10.0.1.3"}}}, verdict: peers.NoEndpoint,
		},
		{
			name: "STRICT node: the node's endpoint", svc: webService(strictNode),
			eps:  []ep{{name: "a", node: "node-a", addrs: []string{"10.0.1.1"}}, {name: "c", node: "node-c", addrs: []string{"10.0.1.3"}}},
			want: []string{"a@10.0.1.1:8080"},
		},
		{
			name: "retry avoids the endpoint that failed", svc: webService(nil),
			eps:     []ep{{name: "a", addrs: []string{"10.0.1.1"}}, {name: "b", addrs: []string{"10.0.1.2"}}},
			exclude: netip.MustParseAddrPort("10.0.1.1:8080"),
			want:    []string{"b@10.0.1.2:8080"},
		},
		{
			name: "retry with one endpoint goes to it again", svc: webService(nil),
			eps:     []ep{{name: "a", addrs: []string{"10.0.1.1"}}},
			exclude: netip.MustParseAddrPort("10.0.1.1:8080"),
			want:    []string{"a@10.0.1.1:8080"},
		},
		{
			name: "PASSTHROUGH is not balanced", svc: webService(&workload.LoadBalancing{Mode: workload.LoadBalancing_PASSTHROUGH}),
			eps: []ep{{name: "a", addrs: []string{"10.0.1.1"}}}, verdict: peers.Passthrough,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			x := peers.NewServices()
			x.UpsertWorkload(client.workload())
			// Endpoints before the Service, as a push may order them.
			for _, e := range tc.eps {
				x.UpsertWorkload(e.workload())
			}
			x.UpsertService(tc.svc)
			dst := tc.dst
			if !dst.IsValid() {
				dst = vip4
			}
			seen, v := chooseSet(t, x, dst, tc.exclude)
			if tc.want == nil {
				if v != tc.verdict {
					t.Fatalf("verdict %v, want %v", v, tc.verdict)
				}
				return
			}
			if v != peers.Chosen {
				t.Fatalf("verdict %v, want chosen", v)
			}
			if len(seen) != len(tc.want) {
				t.Fatalf("chosen %v, want exactly %v", seen, tc.want)
			}
			for _, w := range tc.want {
				if !seen[w] {
					t.Fatalf("chosen %v, want exactly %v", seen, tc.want)
				}
			}
		})
	}
}

func TestServicesFollowChanges(t *testing.T) {
	x := peers.NewServices()
	a := ep{name: "a", addrs: []string{"10.0.1.1"}}
	b := ep{name: "b", addrs: []string{"10.0.1.2"}}
	x.UpsertService(webService(nil))
	x.UpsertWorkload(a.workload())
	x.UpsertWorkload(b.workload())
	if seen, _ := chooseSet(t, x, vip4, netip.AddrPort{}); len(seen) != 2 {
		t.Fatalf("chosen %v, want a and b", seen)
	}
	// b leaves the Service (its services map no longer names it).
	b.notMember = true
	x.UpsertWorkload(b.workload())
	if seen, _ := chooseSet(t, x, vip4, netip.AddrPort{}); len(seen) != 1 || !seen["a@10.0.1.1:8080"] {
		t.Fatalf("after b left: %v", seen)
	}
	// a terminates (unhealthy): nothing left.
	a.unhealthy = true
	x.UpsertWorkload(a.workload())
	if _, v := chooseSet(t, x, vip4, netip.AddrPort{}); v != peers.NoEndpoint {
		t.Fatalf("after a became unhealthy: %v", v)
	}
	a.unhealthy = false
	x.UpsertWorkload(a.workload())
	// The Service goes away (and its VIP with it), its membership stays.
	x.RemoveService(svcKey)
	if _, v := chooseSet(t, x, vip4, netip.AddrPort{}); v != peers.NotService {
		t.Fatalf("after the Service was removed: %v", v)
	}
	if x.Len() != 0 {
		t.Fatalf("Len %d after removal", x.Len())
	}
	// It comes back with another VIP: its endpoints are found again.
	svc := webService(nil)
	svc.Addresses = []*workload.NetworkAddress{{Address: raw("10.96.0.11")}}
	x.UpsertService(svc)
	if _, v := chooseSet(t, x, vip4, netip.AddrPort{}); v != peers.NotService {
		t.Fatalf("old VIP still served: %v", v)
	}
	if seen, _ := chooseSet(t, x, netip.MustParseAddrPort("10.96.0.11:80"), netip.AddrPort{}); len(seen) != 1 {
		t.Fatalf("new VIP: %v", seen)
	}
	// Headless: no VIP, membership only.
	svc.Addresses = nil
	x.UpsertService(svc)
	if _, v := chooseSet(t, x, netip.MustParseAddrPort("10.96.0.11:80"), netip.AddrPort{}); v != peers.NotService {
		t.Fatalf("headless Service still balanced: %v", v)
	}
	x.RemoveWorkload(a.workload().GetUid())
	x.UpsertService(webService(nil))
	if _, v := chooseSet(t, x, vip4, netip.AddrPort{}); v != peers.NoEndpoint {
		t.Fatalf("removed workload still chosen: %v", v)
	}
}

func TestServicesCountsUnresolvedTargetPorts(t *testing.T) {
	x := peers.NewServices()
	x.UpsertService(webService(nil, &workload.Port{ServicePort: 80}))
	x.UpsertWorkload(ep{name: "c", addrs: []string{"10.0.1.3"}}.workload())
	if x.SkippedEndpointPorts() == 0 {
		t.Fatal("an endpoint without a target port was not counted")
	}
}

func benchServices(b testing.TB, n int, lb *workload.LoadBalancing) *peers.Services {
	x := peers.NewServices()
	x.UpsertWorkload(client.workload())
	x.UpsertService(webService(lb))
	for i := range n {
		x.UpsertWorkload(ep{name: fmt.Sprintf("p%d", i), node: fmt.Sprintf("node-%d", i%3), zone: "z1", addrs: []string{fmt.Sprintf("10.0.%d.%d", i/250, i%250+1)}}.workload())
	}
	return x
}

// TestChooseDoesNotAllocate: endpoint choice is on every connection's path.
func TestChooseDoesNotAllocate(t *testing.T) {
	for _, lb := range []*workload.LoadBalancing{nil, {RoutingPreference: preferSameNode}} {
		x := benchServices(t, 10, lb)
		allocs := testing.AllocsPerRun(200, func() {
			if _, _, v := x.Choose(src, vip4, netip.AddrPort{}); v != peers.Chosen {
				t.Fatal(v)
			}
		})
		if allocs != 0 {
			t.Fatalf("Choose allocates %.1f times per call (load balancing %v)", allocs, lb)
		}
	}
}

// BenchmarkChoose: endpoint choice per connection, 10 endpoints (goal: no
// allocation, ≤ 200 ns), uniform and with istiod's PreferSameNode preference.
func BenchmarkChoose(b *testing.B) {
	for _, c := range []struct {
		name string
		lb   *workload.LoadBalancing
	}{
		{"uniform", nil},
		{"prefer-close", &workload.LoadBalancing{RoutingPreference: preferSameNode}},
	} {
		b.Run(c.name, func(b *testing.B) {
			x := benchServices(b, 10, c.lb)
			b.ReportAllocs()
			for b.Loop() {
				x.Choose(src, vip4, netip.AddrPort{})
			}
		})
	}
}

func TestServiceOf(t *testing.T) {
	x := peers.NewServices()
	// web: 80 -> 8080; admin (another Service of the same pods): 9000 -> a
	// named port the endpoint maps to 9090.
	x.UpsertService(webService(nil))
	x.UpsertService(&workload.Service{
		Name: "admin", Namespace: "shop", Hostname: "admin.shop.svc.cluster.local",
		Addresses: []*workload.NetworkAddress{{Address: raw("10.96.0.11")}},
		Ports:     []*workload.Port{{ServicePort: 9000}},
	})
	// "aaa" also serves 8080, but only later; until then web is the one.
	w := ep{name: "web-1", addrs: []string{"10.0.1.1", "fd00::1:1"}}.workload()
	w.Services["shop/admin.shop.svc.cluster.local"] = &workload.PortList{Ports: []*workload.Port{{ServicePort: 9000, TargetPort: 9090}}}
	x.UpsertWorkload(w)
	x.UpsertWorkload(client.workload())

	for _, tc := range []struct {
		dst  string
		want string // hostname; "" none
	}{
		{"10.0.1.1:8080", "web.shop.svc.cluster.local"},
		{"[fd00::1:1]:8080", "web.shop.svc.cluster.local"},
		{"10.0.1.1:9090", "admin.shop.svc.cluster.local"},
		{"10.0.1.1:80", ""},     // a service port, not a target port
		{"10.0.0.2:8080", ""},   // a workload of no Service
		{"10.0.9.9:8080", ""},   // not a workload
		{"10.96.0.10:8080", ""}, // a VIP is no workload address
	} {
		ref, ok := x.ServiceOf(netip.MustParseAddrPort(tc.dst))
		if ok != (tc.want != "") || ref.Hostname != tc.want {
			t.Errorf("ServiceOf(%s) = %+v, %v; want %q", tc.dst, ref, ok, tc.want)
		}
	}
	if ref, _ := x.ServiceOf(netip.MustParseAddrPort("10.0.1.1:9090")); ref.Name != "admin" || ref.Namespace != "shop" {
		t.Errorf("ServiceOf named port: %+v", ref)
	}
	// Two Services target 8080: the first by key wins, whatever the order.
	x.UpsertService(&workload.Service{
		Name: "aaa", Namespace: "shop", Hostname: "aaa.shop.svc.cluster.local",
		Addresses: []*workload.NetworkAddress{{Address: raw("10.96.0.12")}},
		Ports:     []*workload.Port{{ServicePort: 80, TargetPort: 8080}},
	})
	w.Services["shop/aaa.shop.svc.cluster.local"] = &workload.PortList{}
	x.UpsertWorkload(w)
	for range 20 {
		if ref, _ := x.ServiceOf(netip.MustParseAddrPort("10.0.1.1:8080")); ref.Hostname != "aaa.shop.svc.cluster.local" {
			t.Fatalf("ServiceOf with two matches = %+v, want aaa", ref)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = x.ServiceOf(netip.MustParseAddrPort("10.0.1.1:8080")) }); n != 0 {
		t.Errorf("ServiceOf allocates %v times", n)
	}
}
