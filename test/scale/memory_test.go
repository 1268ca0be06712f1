package scale

import (
	"fmt"
	"math"
	"net/netip"
	"os"
	"runtime"
	"testing"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	streamv3 "github.com/envoyproxy/go-control-plane/pkg/server/stream/v3"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"aether.io/node/agent/services"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/proxy/peers"
	"aether.io/node/registry"
	"aether.io/node/xds/adsclient"
	"aether.io/node/xds/resource"
	"aether.io/node/xds/workload"
)

// endpoints is the endpoints of each Service (one EndpointSlice).
const endpoints = 10

// sizes are the numbers of Services: 10,000 (the size: 100,000
// workloads) only with AETHER_BENCH_LARGE=1.
func sizes() []int {
	if os.Getenv("AETHER_BENCH_LARGE") != "" {
		return []int{1000, 10000}
	}
	return []int{1000}
}

var kinds = []string{"ours", "peer"}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// objects are n Services (ClusterIP, port 80 to the named target port
// http) with one EndpointSlice of 10 ready pods each (http resolved to
// 8080), trimmed as the agent's informers keep them.
func objects(n int) ([]*corev1.Service, []*discoveryv1.EndpointSlice) {
	var svcs []*corev1.Service
	var ess []*discoveryv1.EndpointSlice
	for s := range n {
		name := fmt.Sprintf("svc-%05d", s)
		svc := &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "shop", ResourceVersion: "1"},
			Spec: corev1.ServiceSpec{
				Type: corev1.ServiceTypeClusterIP, ClusterIP: fmt.Sprintf("10.96.%d.%d", s>>8, s&255),
				ClusterIPs: []string{fmt.Sprintf("10.96.%d.%d", s>>8, s&255)},
				Ports:      []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http"), Protocol: corev1.ProtocolTCP}},
			},
		}
		es := &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: name + "-abcde", Namespace: "shop", ResourceVersion: "1", Labels: map[string]string{services.LabelServiceName: name}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
		}
		for e := range endpoints {
			id := s*endpoints + e
			es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{
				Addresses: []string{ip(id).String()}, NodeName: ptr.To(fmt.Sprintf("node-%02d", id%100)),
				Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
				TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: pod(id)},
			})
		}
		t, _ := services.TrimService(svc)
		svcs = append(svcs, t.(*corev1.Service))
		te, _ := services.TrimSlice(es)
		ess = append(ess, te.(*discoveryv1.EndpointSlice))
	}
	return svcs, ess
}

func ip(id int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, byte(id >> 16), byte(id >> 8), byte(id)})
}

func pod(id int) string { return fmt.Sprintf("svc-%05d-7d9f8c6b5-%05d", id/endpoints, id) }

// records are the endpoints' pods as the registry serves them (every pod
// in the mesh), built as the agent's follower builds them.
func records(b *testing.B, n int) map[string]*workloadpb.Workload {
	b.Helper()
	cfg := workload.Config{ClusterID: "Kubernetes", TrustDomain: "cluster.local", HBONE: true}
	out := make(map[string]*workloadpb.Workload, n*endpoints)
	for id := range n * endpoints {
		w, err := workload.Build(cfg, registry.Endpoint{
			Key: fmt.Sprintf("sandbox-%06d", id), Node: fmt.Sprintf("node-%02d", id%100), Namespace: "shop", Name: pod(id),
			IPs: []netip.Addr{ip(id)}, ServiceAccount: "default", Labels: map[string]string{"app": fmt.Sprintf("svc-%05d", id/endpoints)},
			Owner: &registry.Owner{Kind: "ReplicaSet", Name: fmt.Sprintf("svc-%05d-7d9f8c6b5", id/endpoints)}, Healthy: true,
			Locality: registry.Locality{Region: "eu-west-1", Zone: "eu-west-1a"},
		})
		if err != nil {
			b.Fatal(err)
		}
		out[fmt.Sprintf("sandbox-%06d", id)] = w
	}
	return out
}

// agent is the agent's state for n Services: the workload index with the
// pods' records (as the registry follower writes them) and the Service
// model holding the Services and EndpointSlices.
type agent struct {
	x *workload.Index
	m *services.Model
}

func loadAgent(recs map[string]*workloadpb.Workload, svcs []*corev1.Service, ess []*discoveryv1.EndpointSlice) (agent, error) {
	x := workload.NewIndex()
	m := services.New(services.Config{ClusterID: "Kubernetes", ClusterDomain: "cluster.local"}, x, services.Metrics{}, nil)
	w := x.Writer(workload.FollowerSource)
	for key, r := range recs {
		if _, err := w.Upsert(key, r); err != nil {
			return agent{}, err
		}
	}
	m.Replace(svcs, ess)
	return agent{x: x, m: m}, nil
}

// cluster returns the pods' records of n Services and the Addresses an
// agent holding them serves (its state is dropped: only those are read).
func cluster(b *testing.B, n int) (map[string]*workloadpb.Workload, []*workload.Resource) {
	b.Helper()
	recs := records(b, n)
	svcs, ess := objects(n)
	a, err := loadAgent(recs, svcs, ess)
	if err != nil {
		b.Fatal(err)
	}
	rs := served(a.x)
	if len(rs) != n*(endpoints+1) {
		b.Fatalf("%d Addresses served, want %d", len(rs), n*(endpoints+1))
	}
	return recs, rs
}

// served returns every Address the index serves (name, version, bytes).
func served(x *workload.Index) []*workload.Resource {
	sub, cancel := x.Addresses().Watch()
	defer cancel()
	sub.SetSotW(nil)
	return x.Addresses().SotWResponse(sub).Resources
}

// peerCache is go-control-plane's LinearCache holding the Addresses (its
// own decoded messages), each marshalled and hashed once as serving a
// first delta client does.
func peerCache(b *testing.B, rs []*workload.Resource) *cachev3.LinearCache {
	b.Helper()
	m := make(map[string]types.Resource, len(rs))
	for _, r := range rs {
		a := &workloadpb.Address{}
		if err := proto.Unmarshal(r.Body, a); err != nil {
			b.Fatal(err)
		}
		m[r.Name] = a
	}
	c := cachev3.NewLinearCache(resource.AddressType)
	c.SetResources(m)
	ch := make(chan cachev3.DeltaResponse, 1)
	sub := streamv3.NewDeltaSubscription([]string{"*"}, nil, nil, true)
	if _, err := c.CreateDeltaWatch(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.AddressType, ResourceNamesSubscribe: []string{"*"}}, &sub, ch); err != nil {
		b.Fatal(err)
	}
	resp, err := (<-ch).GetDeltaDiscoveryResponse()
	if err != nil || len(resp.GetResources()) != len(rs) {
		b.Fatalf("peer served %d of %d resources: %v", len(resp.GetResources()), len(rs), err)
	}
	return c
}

// report measures the heap held by hold() (the inputs it reads were
// allocated before and stay alive, so they are not counted), the least of
// the iterations.
func report(b *testing.B, resources int, hold func() any) {
	b.Helper()
	least := math.Inf(1)
	for range b.N {
		before := heapInUse()
		held := hold()
		least = min(least, float64(heapInUse())-float64(before))
		runtime.KeepAlive(held)
	}
	b.ReportMetric(least, "heap-B")
	b.ReportMetric(least/float64(resources), "heap-B/resource")
}

// versusPeer runs the ours and peer sub-benchmarks of n Services: ours
// measures what ours holds, the peer a LinearCache of rs (peerCache).
func versusPeer(b *testing.B, n int, rs []*workload.Resource, ours func(*testing.B) any) {
	for _, kind := range kinds {
		b.Run(fmt.Sprintf("n=%dx%d/%s", n, endpoints, kind), func(b *testing.B) {
			report(b, len(rs), func() any {
				if kind == "peer" {
					return peerCache(b, rs)
				}
				return ours(b)
			})
		})
	}
}

// BenchmarkServicesAgentMemory: the agent's heap for n Services of 10
// endpoints each, every pod in the mesh: ours is the Service model with
// the trimmed Services and EndpointSlices it holds (as the informers'
// caches share them) and the workload index (the records, their Address
// view with each workload's services map, the Services, and the
// endpoints' own workloads the model keeps beneath the records); the
// peer is a LinearCache holding the same Address resources (10n
// workloads and n Services), marshalled once. The pods' records arrive
// as messages built before (the follower's transient input).
func BenchmarkServicesAgentMemory(b *testing.B) {
	for _, n := range sizes() {
		recs, rs := cluster(b, n)
		versusPeer(b, n, rs, func(b *testing.B) any {
			svcs, ess := objects(n)
			a, err := loadAgent(recs, svcs, ess)
			if err != nil {
				b.Fatal(err)
			}
			return a
		})
		runtime.KeepAlive(recs)
	}
}

// proxyIndex is what aether-proxy keeps of the Addresses it subscribes
// to: its peer index and Service table (proxy/peers, fed as the proxy's
// Address handler feeds them) and its delta client's versions.
type proxyIndex struct {
	peers    *peers.Index
	services *peers.Services
	versions *adsclient.Versions
}

func loadProxy(b *testing.B, rs []*workload.Resource) proxyIndex {
	b.Helper()
	p := proxyIndex{peers: peers.NewIndex(), services: peers.NewServices(), versions: &adsclient.Versions{}}
	for _, r := range rs {
		a := &workloadpb.Address{}
		if err := proto.Unmarshal(r.Body, a); err != nil {
			b.Fatal(err)
		}
		switch {
		case a.GetWorkload() != nil:
			p.peers.Upsert(a.GetWorkload())
			p.services.UpsertWorkload(a.GetWorkload())
		case a.GetService() != nil:
			p.services.UpsertService(a.GetService())
		}
		p.versions.Set(r.Name, r.Version)
	}
	return p
}

// BenchmarkServicesProxyMemory: the proxy's heap for the Addresses of n
// Services of 10 endpoints (ours: proxy/peers' index and Service table
// and the delta client's versions, fed the agent's served bytes) against
// the peer LinearCache holding the same Address resources, as
// BenchmarkServicesAgentMemory.
func BenchmarkServicesProxyMemory(b *testing.B) {
	for _, n := range sizes() {
		_, rs := cluster(b, n)
		versusPeer(b, n, rs, func(b *testing.B) any { return loadProxy(b, rs) })
	}
}
