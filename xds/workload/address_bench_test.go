package workload

// Benchmarks of the Address view (Services and their endpoints' workloads,
// resource.AddressType) against go-control-plane's delta server on a
// LinearCache holding the same Address resources, as bench_test.go does
// for the Workload type. Goals in bench/goals/wds.json. 10,000 Services of
// 10 endpoints run only with AETHER_BENCH_LARGE=1 (a minute or two of
// setup on 2 cores); 1,000 of 10 otherwise.

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/resource"
)

// endpointsPerService is the endpoints of each benchmark Service.
const endpointsPerService = 10

// serviceCounts are the numbers of Services the Address benchmarks run.
func serviceCounts() []int {
	if os.Getenv("AETHER_BENCH_LARGE") != "" {
		return []int{1000, 10000}
	}
	return []int{1000}
}

// addressSet is S Services of endpointsPerService endpoints: the Services
// and their endpoints' workloads, each a member of its Service (port 80,
// target 8080) through members (what the agent's Service model answers:
// its uid → ServiceName → ports map).
type addressSet struct {
	services  []*workloadpb.Service
	workloads []*workloadpb.Workload // without their services map
	members   map[string]map[string]*workloadpb.PortList
}

func benchService(s int) *workloadpb.Service {
	return &workloadpb.Service{
		Name: fmt.Sprintf("svc-%05d", s), Namespace: "shop", Hostname: fmt.Sprintf("svc-%05d.shop.svc.cluster.local", s),
		Addresses:  []*workloadpb.NetworkAddress{{Network: "net1", Address: []byte{10, 96, byte(s >> 8), byte(s)}}},
		Ports:      []*workloadpb.Port{{ServicePort: 80, TargetPort: 0, AppProtocol: workloadpb.AppProtocol_HTTP11}},
		IpFamilies: workloadpb.IPFamilies_IPV4_ONLY,
	}
}

func memberPorts(s int, target uint32) map[string]*workloadpb.PortList {
	svc := benchService(s)
	return map[string]*workloadpb.PortList{ServiceName(svc.GetNamespace(), svc.GetHostname()): {Ports: []*workloadpb.Port{{ServicePort: 80, TargetPort: target}}}}
}

func benchAddresses(b *testing.B, services int) addressSet {
	b.Helper()
	as := addressSet{members: map[string]map[string]*workloadpb.PortList{}}
	for s := range services {
		as.services = append(as.services, benchService(s))
	}
	for i, w := range benchWorkloads(b, services*endpointsPerService) {
		as.workloads = append(as.workloads, w)
		as.members[w.GetUid()] = memberPorts(i/endpointsPerService, 8080)
	}
	return as
}

// addressServer is one of the two Address servers under comparison.
// A change is prepared (not measured), then applied (measured).
type addressServer interface {
	set(as addressSet)
	// endpoint prepares workload w's membership of Service s with target
	// port target (an EndpointSlice update resolving another port) and
	// returns what applies it.
	endpoint(w *workloadpb.Workload, s int, target uint32) func()
	// service prepares Service s with port 8080 added (a Service update)
	// and returns what applies it.
	service(s int, round int) func()
	socket() string
}

type oursAddress struct {
	x    *Index
	mem  *fakeMembers // as the agent's Service model answers
	svcs *Writer
	sock string
}

func (o *oursAddress) set(as addressSet) {
	o.mem.mu.Lock()
	for uid, p := range as.members {
		o.mem.m[uid] = p
	}
	o.mem.mu.Unlock()
	for _, s := range as.services {
		if _, err := o.svcs.UpsertService(s); err != nil {
			panic(err)
		}
	}
	for _, w := range as.workloads {
		if _, err := o.x.Upsert(w.GetUid(), w); err != nil {
			panic(err)
		}
	}
}

// endpoint is what the Service model does for a slice update: its
// membership changes, then Index.Refresh re-encodes the workload.
func (o *oursAddress) endpoint(w *workloadpb.Workload, s int, target uint32) func() {
	uid := w.GetUid()
	o.mem.set(uid, memberPorts(s, target))
	return func() {
		if n, err := o.x.Refresh([]string{uid}); err != nil || n != 1 {
			panic(fmt.Sprintf("refresh of %s changed %d resources: %v", uid, n, err))
		}
	}
}

func (o *oursAddress) service(s, round int) func() {
	svc := changedService(s, round)
	return func() {
		if _, err := o.svcs.UpsertService(svc); err != nil {
			panic(err)
		}
	}
}

func (o *oursAddress) socket() string { return o.sock }

// changedService is Service s with a second port whose number changes
// with round (every round a new version).
func changedService(s, round int) *workloadpb.Service {
	svc := benchService(s)
	svc.Ports = append(svc.Ports, &workloadpb.Port{ServicePort: uint32(8000 + round%1000), TargetPort: 8080})
	return svc
}

type peerAddress struct {
	c    *cachev3.LinearCache
	sock string
}

func (p *peerAddress) set(as addressSet) {
	m := make(map[string]types.Resource, len(as.services)+len(as.workloads))
	// Messages of its own (deep copies, services maps included), as a
	// cache holding what its agent built.
	for _, s := range as.services {
		m[ServiceName(s.GetNamespace(), s.GetHostname())] = proto.CloneOf(&workloadpb.Address{Type: &workloadpb.Address_Service{Service: s}})
	}
	for _, w := range as.workloads {
		w = proto.CloneOf(w)
		w.Services = as.members[w.GetUid()]
		m[w.GetUid()] = proto.CloneOf(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}})
	}
	p.c.SetResources(m)
}

// endpoint builds the workload's new message (what a go-control-plane
// agent's model would hand its cache) and returns its update.
func (p *peerAddress) endpoint(w *workloadpb.Workload, s int, target uint32) func() {
	w = proto.CloneOf(w)
	w.Services = memberPorts(s, target)
	a := &workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: w}}
	return func() {
		if err := p.c.UpdateResource(w.GetUid(), a); err != nil {
			panic(err)
		}
	}
}

func (p *peerAddress) service(s, round int) func() {
	svc := changedService(s, round)
	a := &workloadpb.Address{Type: &workloadpb.Address_Service{Service: svc}}
	return func() {
		if err := p.c.UpdateResource(ServiceName(svc.GetNamespace(), svc.GetHostname()), a); err != nil {
			panic(err)
		}
	}
}

func (p *peerAddress) socket() string { return p.sock }

func newAddressServer(b *testing.B, kind string) addressServer {
	b.Helper()
	if kind == "ours" {
		x := NewIndex()
		mem := &fakeMembers{m: map[string]map[string]*workloadpb.PortList{}}
		x.SetMembership(mem)
		srv, err := NewServer(x, ServerOptions{})
		if err != nil {
			b.Fatal(err)
		}
		o := &oursAddress{x: x, mem: mem, svcs: x.Addresses().Writer(ServiceSource)}
		o.sock = serveBench(b, ServerGRPCOptions(0), srv.Register)
		return o
	}
	c := cachev3.NewLinearCache(resource.AddressType)
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	srv := serverv3.NewServer(ctx, c, nil)
	p := &peerAddress{c: c}
	p.sock = serveBench(b, transportOptions(0), func(g *grpc.Server) {
		discovery.RegisterAggregatedDiscoveryServiceServer(g, srv)
	})
	return p
}

// BenchmarkAddressFanout: S Services of 10 endpoints (10·S workloads and S
// Services in the Address view), 4 synced wildcard Address clients that
// decode every resource; one change per op, timed from the update call
// until every client has received and decoded it (one sample per op: the
// last client). change=endpoint is an EndpointSlice update (an endpoint's
// resolved target port changes: its workload's services map); ours
// applies it as the Service model does (Index.Refresh), the peer gets the
// new message (UpdateResource). change=service is a Service update.
func BenchmarkAddressFanout(b *testing.B) {
	const clients = 4
	for _, n := range serviceCounts() {
		as := benchAddresses(b, n)
		total := n + len(as.workloads)
		for _, change := range []string{"endpoint", "service"} {
			for _, kind := range kinds {
				b.Run(fmt.Sprintf("n=%dx%d/clients=%d/change=%s/%s", n, endpointsPerService, clients, change, kind), func(b *testing.B) {
					s := newAddressServer(b, kind)
					s.set(as)
					cs := make([]*benchClient, clients)
					for i := range cs {
						conn := dialBench(b, s.socket())
						defer conn.Close()
						cs[i] = openBenchType(b, conn, resource.AddressType, true, nil, nil, false)
						defer cs[i].close()
						cs[i].waitResources(b, total)
					}
					samples := make([]time.Duration, 0, b.N)
					b.ResetTimer()
					for i := range b.N {
						b.StopTimer()
						var apply func()
						if change == "endpoint" {
							j := (i * 7919) % len(as.workloads)
							apply = s.endpoint(as.workloads[j], j/endpointsPerService, uint32(8081+i%2))
						} else {
							apply = s.service((i*7919)%n, i)
						}
						b.StartTimer()
						start := time.Now()
						apply()
						var last time.Time
						for _, c := range cs {
							if at, _ := c.waitResources(b, 1); at.After(last) {
								last = at
							}
						}
						samples = append(samples, last.Sub(start))
					}
					b.StopTimer()
					b.ReportMetric(percentile(samples, 0.5), "p50-ns")
					b.ReportMetric(percentile(samples, 0.99), "p99-ns")
				})
			}
		}
	}
}

// BenchmarkAddressMemory: live heap of the server side holding S Services
// of 10 endpoints as Addresses, with 4 synced wildcard Address clients
// that keep nothing: ours is the index (its Workload and Address views)
// and the server; the peer the LinearCache of the same Address messages
// (its own copies) and its delta server. The input, and the membership
// maps both read from it (the Service model's state), stay alive across
// the measurement, so neither side is charged for them. What a stream
// still has in flight (a response being written) adds to the heap and
// varies: run -benchtime 1x in several rounds (make bench BENCHCOUNT=N)
// and read the median.
func BenchmarkAddressMemory(b *testing.B) {
	const clients = 4
	for _, n := range serviceCounts() {
		for _, kind := range kinds {
			b.Run(fmt.Sprintf("n=%dx%d/clients=%d/%s", n, endpointsPerService, clients, kind), func(b *testing.B) {
				var peak float64
				total := n * (endpointsPerService + 1)
				for range b.N {
					as := benchAddresses(b, n)
					before := heapInUse()
					s := newAddressServer(b, kind)
					s.set(as)
					peak = max(peak, heldWithClients(b, before, s.socket(), resource.AddressType, clients, total))
					runtime.KeepAlive(as)
					runtime.KeepAlive(s)
				}
				b.ReportMetric(peak, "heap-B")
				b.ReportMetric(peak/float64(total), "heap-B/resource")
			})
		}
	}
}
