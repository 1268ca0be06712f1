package services

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"aether.io/node/registry"
	"aether.io/node/xds/workload"
)

// content is every Address the index serves, name → version.
func content(x *workload.Index) map[string]string {
	sub, cancel := x.Addresses().Watch()
	defer cancel()
	sub.SetSotW(nil)
	out := map[string]string{}
	for _, r := range x.Addresses().SotWResponse(sub).Resources {
		out[r.Name] = r.Version
	}
	return out
}

func diff(a, b map[string]string) []string {
	var out []string
	for k, v := range a {
		if b[k] != v {
			out = append(out, fmt.Sprintf("%s: %q vs %q", k, v, b[k]))
		}
	}
	for k, v := range b {
		if _, ok := a[k]; !ok {
			out = append(out, fmt.Sprintf("%s: missing vs %q", k, v))
		}
	}
	slices.Sort(out)
	return out
}

// value reads a counter.
func value(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func testMetrics() Metrics {
	return Metrics{
		UnresolvedTargetPorts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "unresolved"}, []string{"reason"}),
		Recomputes:            prometheus.NewCounter(prometheus.CounterOpts{Name: "recomputes"}),
		Updates:               prometheus.NewCounter(prometheus.CounterOpts{Name: "updates"}),
	}
}

// randomOp is one change of a random sequence over two Services (web,
// api) and eight slices whose endpoints overlap (a pod in several slices
// and Services), whose label moves them between the Services (or to
// none), whose ports are resolved, missing or invalid.
func randomOp(r *rand.Rand, b Batch) {
	switch n := r.IntN(10); {
	case n < 2:
		name := []string{"web", "api"}[r.IntN(2)]
		k := key("shop", name)
		if r.IntN(4) == 0 {
			b.Services[k] = nil
			return
		}
		svc := webService()
		svc.Name = name
		svc.Spec.ClusterIPs = []string{fmt.Sprintf("10.96.0.%d", 10+len(name))}
		if r.IntN(3) == 0 {
			svc.Spec.Ports[0].TargetPort = intstr.FromInt32(8080)
		}
		svc.Spec.PublishNotReadyAddresses = r.IntN(3) == 0
		b.Services[k] = svc
	default:
		name := fmt.Sprintf("s-%d", r.IntN(8))
		k := key("shop", name)
		if r.IntN(6) == 0 {
			b.Slices[k] = nil
			return
		}
		port := []int32{8080, 8081, 0, -1}[r.IntN(4)]
		var eps []sliceEP
		for range r.IntN(5) {
			p := r.IntN(12)
			eps = append(eps, sliceEP{pod: fmt.Sprintf("p%d", p), ip: fmt.Sprintf("10.0.0.%d", p+1), node: "n1", ready: ptr.To(r.IntN(4) != 0)})
		}
		es := slice(name, max(port, 1), eps...)
		switch port {
		case 0:
			es.Ports[0].Port = ptr.To[int32](0) // invalid
		case -1:
			es.Ports = es.Ports[1:] // no http port: not declared
		}
		es.Labels[LabelServiceName] = []string{"web", "web", "api", ""}[r.IntN(4)]
		b.Slices[k] = es
	}
}

// TestApplyBatchMatchesOneByOne: a random sequence of changes applied in
// batches (each Service recomputed once per batch, the last state of each
// object) serves exactly what applying them one at a time serves, after
// every batch.
func TestApplyBatchMatchesOneByOne(t *testing.T) {
	r := rand.New(rand.NewPCG(26, 2))
	xa, xb := workload.NewIndex(), workload.NewIndex()
	one, batched := New(testCfg, xa, Metrics{}, nil), New(testCfg, xb, testMetrics(), nil)
	for _, x := range []*workload.Index{xa, xb} { // some pods have a record of their own
		for p := range 3 {
			ep := registry.Endpoint{
				Key: fmt.Sprintf("sandbox-%d", p), Namespace: "shop", Name: fmt.Sprintf("p%d", p), Node: "n1", Healthy: true,
				IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 0, 0, byte(p + 1)})},
			}
			w, err := workload.Build(workload.Config{ClusterID: "Kubernetes", TrustDomain: "cluster.local", HBONE: true}, ep)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := x.Writer("local").Upsert(ep.Key, w); err != nil {
				t.Fatal(err)
			}
		}
	}
	ops := 0
	for round := range 300 {
		b := newBatch()
		for range 1 + r.IntN(8) {
			op := newBatch()
			randomOp(r, op)
			one.Apply(op)
			ops++
			for k, v := range op.Services {
				b.Services[k] = v
			}
			for k, v := range op.Slices {
				b.Slices[k] = v
			}
		}
		batched.Apply(b)
		if d := diff(content(xa), content(xb)); len(d) > 0 {
			t.Fatalf("round %d: one by one and batched serve differently:\n%v", round, d)
		}
	}
	if n := value(t, batched.met.Recomputes); n >= float64(ops) {
		t.Errorf("%v recomputes for %d changes in 300 batches", n, ops)
	}
}

// gate holds the first Apply until released, then hands every batch to
// the model; done receives after each.
type gate struct {
	m       *Model
	entered chan struct{}
	release chan struct{}
	done    chan struct{}

	mu      sync.Mutex
	batches []Batch
}

func (g *gate) Apply(b Batch) {
	g.mu.Lock()
	g.batches = append(g.batches, b)
	first := len(g.batches) == 1
	g.mu.Unlock()
	if first {
		close(g.entered)
		<-g.release
	}
	g.m.Apply(b)
	g.done <- struct{}{}
}

func (g *gate) Replace(svcs []*corev1.Service, ess []*discoveryv1.EndpointSlice) {
	g.m.Replace(svcs, ess)
}

// bigSlice is slice n (of 100 endpoints) of a 5,000-endpoint Service;
// endpoint notReady (-1: none) is not ready.
func bigSlice(n, notReady int) *discoveryv1.EndpointSlice {
	var eps []sliceEP
	for i := range 100 {
		id := n*100 + i
		eps = append(eps, sliceEP{pod: fmt.Sprintf("web-%d", id), ip: fmt.Sprintf("10.%d.%d.%d", id>>16&255, id>>8&255, id&255), node: "n1", ready: ptr.To(i != notReady)})
	}
	return slice(fmt.Sprintf("web-%d", n), 8080, eps...)
}

// TestCoalescedStorm: 1,000 EndpointSlice updates of a 5,000-endpoint
// Service (and one of another Service) arrive while the model applies a
// change: they are merged into one batch, so the model recomputes each
// Service once more, and it ends serving exactly what applying every
// update one by one serves (the last state of each slice wins, the other
// Service's update is not lost).
func TestCoalescedStorm(t *testing.T) {
	x, ref := workload.NewIndex(), workload.NewIndex()
	met := testMetrics()
	m, want := New(testCfg, x, met, nil), New(testCfg, ref, Metrics{}, nil)
	for _, mm := range []*Model{m, want} {
		mm.UpsertService(webService())
		for n := range 50 {
			mm.UpsertSlice(bigSlice(n, -1))
		}
	}
	if x.Len() != 5000 {
		t.Fatalf("%d workloads", x.Len())
	}
	base := value(t, met.Recomputes)

	g := &gate{m: m, entered: make(chan struct{}), release: make(chan struct{}), done: make(chan struct{}, 4)}
	q := newCoalescer(g, met.Updates)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { q.run(ctx, nil, nil) })
	t.Cleanup(func() { cancel(); wg.Wait() })

	update := func(i int) {
		es := bigSlice(i%50, (i/50)%100)
		q.record(func(b Batch) { b.Slices[key(es.Namespace, es.Name)] = es })
		want.UpsertSlice(es)
	}
	update(0)
	<-g.entered // the model is busy with update 0
	const storm = 1000
	for i := 1; i < storm; i++ {
		update(i)
		if i == storm/2 {
			api := webService()
			api.Name = "api"
			q.record(func(b Batch) { b.Services[key("shop", "api")] = api })
			want.UpsertService(api)
		}
	}
	close(g.release)
	<-g.done
	<-g.done
	cancel()
	wg.Wait()

	if len(g.batches) != 2 {
		t.Fatalf("%d batches for %d updates, want 2 (the first, then the rest merged)", len(g.batches), storm+1)
	}
	if n := g.batches[1].Len(); n != 51 {
		t.Errorf("the merged batch names %d objects, want 51 (50 slices and a Service)", n)
	}
	if n := value(t, met.Recomputes) - base; n != 3 {
		t.Errorf("%v recomputes, want 3 (web, then web and api once each)", n)
	}
	if n := value(t, met.Updates); n != storm+1 {
		t.Errorf("%v updates counted, want %d", n, storm+1)
	}
	if d := diff(content(ref), content(x)); len(d) > 0 {
		t.Fatalf("after the storm, served differently from one-by-one:\n%v", d)
	}
}

// TestCoalescerSyncReplaces: once the caches synced, the worker drops
// what is pending (the caches hold it) and replaces the model's content
// with theirs.
func TestCoalescerSyncReplaces(t *testing.T) {
	x := workload.NewIndex()
	m := New(testCfg, x, Metrics{}, nil)
	m.UpsertService(webService()) // restored from a snapshot; gone from the API
	q := newCoalescer(m, nil)
	api := webService()
	api.Name = "api"
	q.record(func(b Batch) { b.Services[key("shop", "api")] = api })
	synced := make(chan struct{})
	close(synced)
	replaced := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		q.run(ctx, synced, func(a applier) {
			a.Replace([]*corev1.Service{api}, nil)
			close(replaced)
		})
	})
	<-replaced
	cancel()
	wg.Wait()
	if m.Len() != 1 || served(t, x, "shop/api.shop.svc.cluster.local") == nil || served(t, x, webHost) != nil {
		t.Errorf("after the sync: %d services, api served %v, web served %v", m.Len(),
			served(t, x, "shop/api.shop.svc.cluster.local") != nil, served(t, x, webHost) != nil)
	}
}

// lastApplied hands batches to the model and signals when one held the
// awaited slice.
type lastApplied struct {
	m     *Model
	await atomic.Pointer[discoveryv1.EndpointSlice]
	done  chan struct{}
}

func (l *lastApplied) Apply(b Batch) {
	l.m.Apply(b)
	for _, es := range b.Slices {
		if es != nil && es == l.await.Load() {
			l.done <- struct{}{}
		}
	}
}

func (l *lastApplied) Replace(svcs []*corev1.Service, ess []*discoveryv1.EndpointSlice) {
	l.m.Replace(svcs, ess)
}

// BenchmarkSliceStorm: a storm of 1,000 EndpointSlice updates of one
// Service of 5,000 endpoints in 50 slices (update i changes slice i%50: an
// endpoint turns not ready), delivered back to back as an informer would
// deliver a backlog; time until the last one is served, index writes
// included. per-update applies each update before taking the next (what
// the informers did before); coalesced records them for the worker
// (Informers), which merges what arrives while it applies a batch.
func BenchmarkSliceStorm(b *testing.B) {
	const storm = 1000
	for _, mode := range []string{"per-update", "coalesced"} {
		b.Run(mode, func(b *testing.B) {
			x := workload.NewIndex()
			met := testMetrics()
			m := New(testCfg, x, met, nil)
			m.UpsertService(webService())
			for n := range 50 {
				m.UpsertSlice(bigSlice(n, -1))
			}
			updates := make([][]*discoveryv1.EndpointSlice, 2)
			for v := range updates { // two storms, alternated, so every update changes something
				for i := range storm {
					updates[v] = append(updates[v], bigSlice(i%50, (i/50+v*7)%100))
				}
			}
			l := &lastApplied{m: m, done: make(chan struct{}, 1)}
			q := newCoalescer(l, nil)
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			wg.Go(func() { q.run(ctx, nil, nil) })
			defer func() { cancel(); wg.Wait() }()
			base := value(b, met.Recomputes)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				us := updates[i%2]
				if mode == "per-update" {
					for _, es := range us {
						m.UpsertSlice(es)
					}
					continue
				}
				l.await.Store(us[storm-1])
				for _, es := range us {
					q.record(func(bt Batch) { bt.Slices[key(es.Namespace, es.Name)] = es })
				}
				<-l.done
			}
			b.StopTimer()
			b.ReportMetric((value(b, met.Recomputes)-base)/float64(b.N), "recomputes/op")
		})
	}
}
