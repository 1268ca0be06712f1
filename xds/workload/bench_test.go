package workload

// Benchmarks of the WDS server against go-control-plane's delta server on a
// LinearCache holding the same resources (the peer), both served over gRPC
// on a unix socket to the same raw delta clients. Each comparison is one
// Benchmark with "ours" and "peer" sub-benchmarks (docs/CONTRIBUTING.md);
// goals are in bench/goals/wds.json. 100k workloads run only with
// AETHER_BENCH_LARGE=1 (minutes of setup on 2 cores).

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/xds/adsclient"
	"aether.io/node/xds/resource"
)

// benchServer is one of the two servers under comparison.
type benchServer interface {
	// set replaces the content with ws (setup, not measured).
	set(ws []*workloadpb.Workload)
	// take returns the server-side time samples collected so far.
	take() []time.Duration
	// update upserts one workload (measured).
	update(w *workloadpb.Workload)
	socket() string
}

type oursServer struct {
	x    *Index
	sock string
	timer
}

func (o *oursServer) set(ws []*workloadpb.Workload) {
	for _, w := range ws {
		if _, err := o.x.Upsert(w.GetUid(), w); err != nil {
			panic(err)
		}
	}
}

func (o *oursServer) update(w *workloadpb.Workload) {
	if _, err := o.x.Upsert(w.GetUid(), w); err != nil {
		panic(err)
	}
}

func (o *oursServer) socket() string { return o.sock }

type peerServer struct {
	c    *cachev3.LinearCache
	sock string
	timer
}

// timer measures, on the server side of every stream, the time from the
// first request decoded to the first response handed to gRPC (same
// interceptor for both servers).
type timer struct {
	mu      sync.Mutex
	samples []time.Duration
}

func (tm *timer) interceptor() grpc.ServerOption {
	return grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(srv, &timedStream{ServerStream: ss, tm: tm})
	})
}

func (tm *timer) take() []time.Duration {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	s := tm.samples
	tm.samples = nil
	return s
}

type timedStream struct {
	grpc.ServerStream
	tm   *timer
	recv time.Time
	done bool
}

func (s *timedStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	if err == nil && s.recv.IsZero() {
		s.recv = time.Now()
	}
	return err
}

func (s *timedStream) SendMsg(m any) error {
	err := s.ServerStream.SendMsg(m)
	if !s.done && !s.recv.IsZero() {
		s.done = true
		d := time.Since(s.recv)
		s.tm.mu.Lock()
		s.tm.samples = append(s.tm.samples, d)
		s.tm.mu.Unlock()
	}
	return err
}

func (p *peerServer) set(ws []*workloadpb.Workload) {
	m := make(map[string]types.Resource, len(ws))
	for _, w := range ws {
		m[w.GetUid()] = w
	}
	p.c.SetResources(m)
}

func (p *peerServer) update(w *workloadpb.Workload) {
	if err := p.c.UpdateResource(w.GetUid(), w); err != nil {
		panic(err)
	}
}

func (p *peerServer) socket() string { return p.sock }

func serveBench(b *testing.B, opts []grpc.ServerOption, register func(*grpc.Server)) string {
	b.Helper()
	sock := filepath.Join(b.TempDir(), "run", "xds.sock")
	lis, err := unixsock.Listen(sock)
	if err != nil {
		b.Fatal(err)
	}
	g := grpc.NewServer(opts...)
	register(g)
	go func() { _ = g.Serve(lis) }()
	b.Cleanup(g.Stop)
	return sock
}

func newBenchServer(b *testing.B, kind string) benchServer {
	b.Helper()
	switch kind {
	case "ours":
		x := NewIndex()
		srv, err := NewServer(x, ServerOptions{})
		if err != nil {
			b.Fatal(err)
		}
		o := &oursServer{x: x}
		opts := ServerGRPCOptions(0)
		if os.Getenv("WDS_BENCH_STOCK_CODEC") != "" {
			opts = transportOptions(0) // A/B: our server with the stock proto codec
		}
		o.sock = serveBench(b, append(opts, o.interceptor()), srv.Register)
		return o
	default:
		c := cachev3.NewLinearCache(resource.WorkloadType)
		ctx, cancel := context.WithCancel(context.Background())
		b.Cleanup(cancel)
		srv := serverv3.NewServer(ctx, c, nil)
		// The peer gets the same transport settings (message limit, windows)
		// but its own, stock proto codec.
		p := &peerServer{c: c}
		p.sock = serveBench(b, append(transportOptions(0), p.interceptor()), func(g *grpc.Server) {
			discovery.RegisterAggregatedDiscoveryServiceServer(g, srv)
		})
		return p
	}
}

func benchWorkloads(b *testing.B, n int) []*workloadpb.Workload {
	b.Helper()
	out := make([]*workloadpb.Workload, n)
	for i := range n {
		w, err := Build(testConfig, endpointN(i))
		if err != nil {
			b.Fatal(err)
		}
		out[i] = w
	}
	return out
}

// benchClient is a raw delta ADS client: it ACKs every response, tracks the
// versions it holds and reports what it received; it decodes the resources
// only when asked to (decode), so client cost is the same for both servers.
type benchClient struct {
	conn   *grpc.ClientConn
	stream discovery.AggregatedDiscoveryService_DeltaAggregatedResourcesClient
	cancel context.CancelFunc
	done   chan struct{} // closed when loop returns
	// versions are what the client holds, as xds/adsclient keeps them (in
	// wire form, in the order received); nil when not tracking.
	versions *adsclient.Versions
	// events receives, per response, its resource count and wire size.
	events chan benchEvent
	// typeURL is what the stream subscribes to; decode makes the client
	// unmarshal every resource as an istio.workload.Address (what a
	// proxy must do before it can use one) before it reports the response.
	typeURL string
	decode  bool
}

type benchEvent struct {
	at        time.Time
	resources int
	bytes     int
	err       error
}

func dialBench(b *testing.B, sock string) *grpc.ClientConn {
	b.Helper()
	// The codec of our delta client (xds/adsclient) for both servers: it
	// encodes a reconnect's initial_resource_versions by hand, and decodes
	// as the stock codec does.
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecureCreds()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30), grpc.MaxCallSendMsgSize(1<<30), grpc.ForceCodecV2(adsclient.Codec())))
	if err != nil {
		b.Fatal(err)
	}
	conn.Connect()
	return conn
}

// openBench opens a stream whose first request carries initial (nil: no
// versions); the client then keeps its versions in initial, or in new
// Versions when initial is nil.
func openBench(b *testing.B, conn *grpc.ClientConn, initial *adsclient.Versions) *benchClient {
	return openBenchTracking(b, conn, initial, nil, true)
}

// openBenchTracking opens a stream; track=false keeps no versions (for
// memory measurements of the server alone). A non-nil asMap is sent as
// the versions instead of initial (in map order, as a client that keeps a
// map sends them); the client still keeps its versions in initial.
func openBenchTracking(b *testing.B, conn *grpc.ClientConn, initial *adsclient.Versions, asMap map[string]string, track bool) *benchClient {
	return openBenchType(b, conn, resource.WorkloadType, false, initial, asMap, track)
}

// openBenchType is openBenchTracking for a stream of typeURL; decode
// makes the client decode every resource as an Address.
func openBenchType(b *testing.B, conn *grpc.ClientConn, typeURL string, decode bool, initial *adsclient.Versions, asMap map[string]string, track bool) *benchClient {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		b.Fatal(err)
	}
	c := &benchClient{conn: conn, stream: s, cancel: cancel, done: make(chan struct{}), events: make(chan benchEvent, 1024), typeURL: typeURL, decode: decode}
	if track {
		c.versions = initial
		if c.versions == nil {
			c.versions = &adsclient.Versions{}
		}
	}
	first := &discovery.DeltaDiscoveryRequest{
		Node: &core.Node{Id: "bench"}, TypeUrl: typeURL, ResourceNamesSubscribe: []string{"*"},
	}
	var req any = first
	if asMap != nil {
		first.InitialResourceVersions = asMap // encoded by adsclient.Codec, in map order
	} else {
		enc, err := initial.Request(first)
		if err != nil {
			b.Fatal(err)
		}
		req = enc
	}
	if err := s.SendMsg(req); err != nil {
		b.Fatal(err)
	}
	go c.loop()
	return c
}

func (c *benchClient) loop() {
	defer close(c.done)
	for {
		resp, err := c.stream.Recv()
		if err != nil {
			c.events <- benchEvent{err: err}
			return
		}
		if c.decode {
			for _, r := range resp.GetResources() {
				var a workloadpb.Address
				if err := proto.Unmarshal(r.GetResource().GetValue(), &a); err != nil {
					c.events <- benchEvent{err: fmt.Errorf("failed to decode address %q: %w", r.GetName(), err)}
					return
				}
			}
		}
		at := time.Now()
		if c.versions != nil {
			for _, r := range resp.GetResources() {
				c.versions.Set(r.GetName(), r.GetVersion())
			}
			for _, n := range resp.GetRemovedResources() {
				c.versions.Delete(n)
			}
		}
		if err := c.stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: c.typeURL, ResponseNonce: resp.GetNonce()}); err != nil {
			c.events <- benchEvent{err: err}
			return
		}
		c.events <- benchEvent{at: at, resources: len(resp.GetResources()) + len(resp.GetRemovedResources()), bytes: proto.Size(resp)}
	}
}

// waitResources reads events until n resources arrived in total; it
// returns the time of the last response and the bytes received.
func (c *benchClient) waitResources(b *testing.B, n int) (time.Time, int) {
	b.Helper()
	got, bytes := 0, 0
	var last time.Time
	timeout := time.After(5 * time.Minute)
	for got < n {
		select {
		case ev := <-c.events:
			if ev.err != nil {
				b.Fatalf("client stream: %v", ev.err)
			}
			got += ev.resources
			bytes += ev.bytes
			last = ev.at
		case <-timeout:
			b.Fatalf("client got %d of %d resources within 5 min", got, n)
		}
	}
	return last, bytes
}

// close ends the stream and waits for the client to stop (it no longer
// changes its versions).
func (c *benchClient) close() {
	c.cancel()
	<-c.done
}

func sizes() []int {
	s := []int{1000, 10000}
	if os.Getenv("AETHER_BENCH_LARGE") != "" {
		s = append(s, 100000)
	}
	return s
}

var kinds = []string{"ours", "peer"}

func percentile(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(p*float64(len(s))))].Nanoseconds())
}

// BenchmarkWDSInitialPush: K wildcard clients open streams at once; time
// until every one holds all N workloads, and wire bytes per client.
func BenchmarkWDSInitialPush(b *testing.B) {
	for _, n := range sizes() {
		ws := benchWorkloads(b, n)
		for _, k := range []int{1, 4, 16} {
			for _, kind := range kinds {
				b.Run(fmt.Sprintf("n=%d/clients=%d/%s", n, k, kind), func(b *testing.B) {
					s := newBenchServer(b, kind)
					s.set(ws)
					conns := make([]*grpc.ClientConn, k)
					for i := range conns {
						conns[i] = dialBench(b, s.socket())
						defer conns[i].Close()
					}
					var samples []time.Duration
					bytes := 0
					b.ResetTimer()
					for range b.N {
						start := time.Now()
						cs := make([]*benchClient, k)
						for i := range cs {
							cs[i] = openBench(b, conns[i], nil)
						}
						var last time.Time
						for _, c := range cs {
							at, by := c.waitResources(b, n)
							if at.After(last) {
								last = at
							}
							bytes = by
						}
						samples = append(samples, last.Sub(start))
						for _, c := range cs {
							c.close()
						}
					}
					b.StopTimer()
					b.ReportMetric(percentile(samples, 0.5), "p50-ns")
					b.ReportMetric(percentile(samples, 0.99), "p99-ns")
					b.ReportMetric(float64(bytes), "bytes/client")
				})
			}
		}
	}
}

// BenchmarkWDSFanout: K synced wildcard clients; one workload changes; time
// from the update call until each client has it (one sample per client).
func BenchmarkWDSFanout(b *testing.B) {
	for _, n := range sizes() {
		ws := benchWorkloads(b, n)
		for _, k := range []int{1, 4, 16} {
			for _, kind := range kinds {
				b.Run(fmt.Sprintf("n=%d/clients=%d/%s", n, k, kind), func(b *testing.B) {
					s := newBenchServer(b, kind)
					s.set(ws)
					cs := make([]*benchClient, k)
					for i := range cs {
						conn := dialBench(b, s.socket())
						defer conn.Close()
						cs[i] = openBench(b, conn, nil)
						defer cs[i].close()
						cs[i].waitResources(b, n)
					}
					target := proto.Clone(ws[n/2]).(*workloadpb.Workload)
					samples := make([]time.Duration, 0, b.N*k)
					b.ResetTimer()
					for i := range b.N {
						target.ServiceAccount = fmt.Sprintf("sa-%d", i)
						start := time.Now()
						s.update(proto.Clone(target).(*workloadpb.Workload))
						for _, c := range cs {
							at, _ := c.waitResources(b, 1)
							samples = append(samples, at.Sub(start))
						}
					}
					b.StopTimer()
					b.ReportMetric(percentile(samples, 0.5), "p50-ns")
					b.ReportMetric(percentile(samples, 0.99), "p99-ns")
				})
			}
		}
	}
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// heldWithClients opens k wildcard streams of typeURL to sock whose clients
// keep nothing, waits until each holds n resources, and returns the heap
// in use then above before; the streams are closed before it returns.
func heldWithClients(b *testing.B, before uint64, sock, typeURL string, k, n int) float64 {
	b.Helper()
	var cs []*benchClient
	for range k {
		c := openBenchType(b, dialBench(b, sock), typeURL, false, nil, nil, false)
		c.waitResources(b, n)
		cs = append(cs, c)
	}
	used := float64(heapInUse()) - float64(before)
	for _, c := range cs {
		c.close()
		_ = c.conn.Close()
	}
	return used
}

// BenchmarkWDSMemory: live heap of a server holding N workloads with K
// synced clients (the in-process clients keep nothing of what they receive,
// so the difference is the server's state plus gRPC buffers).
func BenchmarkWDSMemory(b *testing.B) {
	for _, n := range sizes() {
		for _, k := range []int{1, 4, 16} {
			for _, kind := range kinds {
				b.Run(fmt.Sprintf("n=%d/clients=%d/%s", n, k, kind), func(b *testing.B) {
					var peak float64
					for range b.N {
						ws := benchWorkloads(b, n)
						before := heapInUse()
						s := newBenchServer(b, kind)
						s.set(ws)
						ws = nil //nolint:ineffassign,wastedassign // drop the input so the GC reclaims it before the heap is measured
						peak = max(peak, heldWithClients(b, before, s.socket(), resource.WorkloadType, k, n))
						runtime.KeepAlive(s)
					}
					b.ReportMetric(peak, "heap-B")
					b.ReportMetric(peak/float64(n), "heap-B/workload")
				})
			}
		}
	}
}

// BenchmarkWDSReconnect: 70k workloads; C of them change while a client is
// away; it reconnects with initial_resource_versions. Time from opening the
// stream to receiving the difference (which must be exactly C resources).
//
// WDS_BENCH_MAP_ORDER=1 makes the client send its versions in map order
// (as Istio's clients, which keep a map, do) instead of in the order the
// full state came.
func BenchmarkWDSReconnect(b *testing.B) {
	const n = 70000
	mapOrder := os.Getenv("WDS_BENCH_MAP_ORDER") != ""
	ws := benchWorkloads(b, n)
	for _, changed := range []int{0, 10, 100, 1000} {
		for _, kind := range kinds {
			b.Run(fmt.Sprintf("n=%d/changed=%d/%s", n, changed, kind), func(b *testing.B) {
				s := newBenchServer(b, kind)
				s.set(ws)
				conn := dialBench(b, s.socket())
				defer conn.Close()
				c := openBench(b, conn, nil)
				c.waitResources(b, n)
				versions := c.versions
				c.close()
				s.take()
				var samples []time.Duration
				var mu sync.Mutex
				b.ResetTimer()
				for i := range b.N {
					b.StopTimer()
					for j := range changed {
						w := proto.Clone(ws[(j*7919)%n]).(*workloadpb.Workload)
						w.ServiceAccount = fmt.Sprintf("sa-%d-%d", i, j)
						s.update(w)
					}
					var asMap map[string]string
					if mapOrder {
						asMap = versions.Map()
					}
					b.StartTimer()
					start := time.Now()
					rc := openBenchTracking(b, conn, versions, asMap, true)
					var at time.Time
					if changed == 0 {
						// Both servers answer an unchanged reconnect with an empty response.
						ev := <-rc.events
						if ev.err != nil {
							b.Fatal(ev.err)
						}
						if ev.resources != 0 {
							b.Fatalf("unchanged reconnect sent %d resources", ev.resources)
						}
						at = ev.at
					} else {
						at, _ = rc.waitResources(b, changed)
					}
					b.StopTimer()
					mu.Lock()
					samples = append(samples, at.Sub(start))
					mu.Unlock()
					select {
					case ev := <-rc.events:
						if ev.err == nil {
							b.Fatalf("reconnect sent %d more resources than the %d changed", ev.resources, changed)
						}
					case <-time.After(50 * time.Millisecond):
					}
					rc.close() // rc kept what the reconnect brought in versions
					b.StartTimer()
				}
				b.StopTimer()
				server := s.take()
				b.ReportMetric(percentile(samples, 0.5)/1e6, "p50-ms")
				b.ReportMetric(percentile(samples, 0.99)/1e6, "p99-ms")
				b.ReportMetric(percentile(server, 0.5)/1e6, "server-p50-ms")
			})
		}
	}
}

// BenchmarkWDSDecodeVersions: server-side decoding of a 70k-entry
// initial_resource_versions request as gRPC hands it over (16 KiB frames):
// our codec (the server's deltaRequest: gathered into a pooled buffer,
// entries validated and counted, no map) against the stock proto codec the
// peer uses (a map).
func BenchmarkWDSDecodeVersions(b *testing.B) {
	const n = 70000
	req := &discovery.DeltaDiscoveryRequest{TypeUrl: resource.WorkloadType, ResourceNamesSubscribe: []string{"*"}, InitialResourceVersions: map[string]string{}}
	for i := range n {
		req.InitialResourceVersions[UID("Kubernetes", "shop", endpointN(i).Name)] = fmt.Sprintf("%016x", i*7919)
	}
	wire, err := proto.Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	var frames mem.BufferSlice
	for rest := wire; len(rest) > 0; {
		l := min(len(rest), 16<<10)
		frames = append(frames, mem.SliceBuffer(rest[:l]))
		rest = rest[l:]
	}
	for _, kind := range kinds {
		b.Run(fmt.Sprintf("n=%d/%s", n, kind), func(b *testing.B) {
			samples := make([]time.Duration, 0, b.N)
			for range b.N {
				start := time.Now()
				got := 0
				if kind == "ours" {
					dr := &deltaRequest{DeltaDiscoveryRequest: &discovery.DeltaDiscoveryRequest{}}
					err = newCodec().Unmarshal(frames, dr)
					got = dr.versions().Len()
					dr.release()
				} else {
					dr := &discovery.DeltaDiscoveryRequest{}
					err = encoding.GetCodecV2("proto").Unmarshal(frames, dr)
					got = len(dr.GetInitialResourceVersions())
				}
				samples = append(samples, time.Since(start))
				if err != nil || got != n {
					b.Fatalf("decoded %d versions: %v", got, err)
				}
			}
			b.ReportMetric(percentile(samples, 0.5), "p50-ns")
			b.ReportMetric(percentile(samples, 0.99), "p99-ns")
		})
	}
}

// BenchmarkWDSCompareVersions: the index's side of a reconnect at 70k
// workloads, nothing changed: Index.DeltaResponse for a new wildcard
// subscription whose initial_resource_versions are every workload's, in
// the order the full state came ("in-order", what xds/adsclient sends) and
// in a shuffled order ("shuffled", a client that keeps a map). No gRPC, no
// decoding: the comparison alone.
func BenchmarkWDSCompareVersions(b *testing.B) {
	const n = 70000
	x := NewIndex()
	for _, w := range benchWorkloads(b, n) {
		if _, err := x.Upsert(w.GetUid(), w); err != nil {
			b.Fatal(err)
		}
	}
	x.mu.RLock()
	all := x.allLocked()
	x.mu.RUnlock()
	shuffled := slices.Clone(all)
	for i := range shuffled { // a fixed permutation (7919 is prime, n is not a multiple)
		shuffled[i] = all[(i*7919)%n]
	}
	for _, order := range []struct {
		name string
		rs   []*Resource
	}{{"in-order", all}, {"shuffled", shuffled}} {
		var wire []byte
		for _, r := range order.rs {
			wire = appendKnownEntry(wire, r.Name, r.Version)
		}
		known := Known{wire: wire, n: n}
		b.Run(fmt.Sprintf("n=%d/%s", n, order.name), func(b *testing.B) {
			samples := make([]time.Duration, 0, b.N)
			for range b.N {
				sub, cancel := x.Watch()
				added, wild := sub.ApplyDelta(true, []string{"*"}, nil)
				start := time.Now()
				d := x.DeltaResponse(sub, added, wild, known)
				samples = append(samples, time.Since(start))
				cancel()
				if len(d.Resources)+len(d.Removed) != 0 {
					b.Fatalf("unchanged reconnect selected %d resources, %d removed", len(d.Resources), len(d.Removed))
				}
			}
			b.ReportMetric(percentile(samples, 0.5), "p50-ns")
			b.ReportMetric(percentile(samples, 0.99), "p99-ns")
		})
	}
}
