package etcd_test

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	"aether.io/node/registry/etcd/etcdtest"
	"aether.io/node/xds/workload"
)

// Scale of BenchmarkRegistryScale and the agent defaults it runs with.
const (
	scaleNodes    = 100
	scalePods     = 100
	scaleTTL      = 10 * time.Second // aether-agent --etcd-lease-ttl default
	scaleLiveness = 5 * time.Second  // aether-agent --liveness-interval default
	// scaleWindow is how long steady-state etcd traffic is counted.
	scaleWindow = 15 * time.Second
	// scalePeerObservers is how many agents run the peer model: each of its
	// polls decodes every endpoint, and 100 such pollers need more than this
	// 2-core machine. Its per-node figures do not depend on how many poll.
	scalePeerObservers = 10
)

var scaleConfig = workload.Config{ClusterID: "Kubernetes", TrustDomain: "cluster.local"}

// counter counts one simulated node's etcd traffic: requests (unary calls
// and messages sent on streams: lease keepalives, watch creates) and keys
// received (Range results and watch events).
type counter struct{ reqs, keys atomic.Int64 }

func (c *counter) unary(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	c.reqs.Add(1)
	err := invoker(ctx, method, req, reply, cc, opts...)
	if r, ok := reply.(*etcdserverpb.RangeResponse); ok {
		c.keys.Add(int64(len(r.Kvs)))
	}
	return err
}

func (c *counter) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		return nil, err
	}
	return countedStream{ClientStream: s, c: c}, nil
}

type countedStream struct {
	grpc.ClientStream
	c *counter
}

func (s countedStream) SendMsg(m any) error {
	s.c.reqs.Add(1)
	return s.ClientStream.SendMsg(m)
}

func (s countedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if w, ok := m.(*etcdserverpb.WatchResponse); ok && err == nil {
		s.c.keys.Add(int64(len(w.Events)))
	}
	return err
}

// scaleNode is one simulated agent: an etcd client with its counter and
// the node's registry (lease, keepalive, its pods' endpoints).
type scaleNode struct {
	name string
	cli  *clientv3.Client
	reg  *etcdreg.Registry
	n    *counter
}

func newScaleNode(b *testing.B, e *etcdtest.Etcd, name string) *scaleNode {
	b.Helper()
	n := &counter{}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints: []string{e.Endpoint()}, Logger: zap.NewNop(), DialTimeout: 5 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(n.unary), grpc.WithChainStreamInterceptor(n.stream)},
	})
	if err != nil {
		b.Fatal(err)
	}
	reg, err := etcdreg.NewWithClient(cli, etcdreg.Options{Node: name, LeaseTTL: scaleTTL})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = reg.Close(); _ = cli.Close() })
	return &scaleNode{name: name, cli: cli, reg: reg, n: n}
}

// scaleEndpoint is pod i of node.
func scaleEndpoint(node string, nodeIdx, i int) registry.Endpoint {
	return registry.Endpoint{
		Key: fmt.Sprintf("%s-sb-%d", node, i), Node: node, Namespace: "shop", Name: fmt.Sprintf("%s-web-%d", node, i),
		IPs:     []netip.Addr{netip.AddrFrom4([4]byte{10, byte(nodeIdx >> 8), byte(nodeIdx), byte(i)})},
		Owner:   &registry.Owner{Kind: "ReplicaSet", Name: "web-5c6d7f8b9"},
		Labels:  map[string]string{"app": "web"},
		Healthy: true, ServiceAccount: "web",
	}
}

// observer is how one simulated agent learns the cluster's endpoints.
type observer interface {
	// has reports whether the agent serves uid.
	has(uid string) bool
}

// followerObserver is ours: the registry's watch into an xds/workload
// index through a Follower, as aether-agent runs it.
type followerObserver struct{ idx *workload.Index }

func (o *followerObserver) has(uid string) bool { return o.idx.Get(uid) != nil }

// pollObserver is the peer: a naive poller that lists every node's
// endpoints each liveness interval and serves that list.
type pollObserver struct {
	mu   sync.Mutex
	uids map[string]struct{}
}

func (o *pollObserver) has(uid string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.uids[uid]
	return ok
}

// scaleRun is the figures of one model.
type scaleRun struct {
	prop         []time.Duration // change registered → served by an observer
	reqsPerMin   float64         // etcd requests per node per minute at steady state
	keysPerMin   float64         // keys received per node per minute at steady state
	heapPerAgent float64         // heap of one more agent, synced
	syncNewAgent time.Duration   // one more agent: start → serving every endpoint
}

// BenchmarkRegistryScale simulates scaleNodes agents with scalePods pods
// each on one etcd (in-process registry/etcd instances on their own
// clients, agent defaults: lease TTL 10 s, liveness every 5 s, which
// lists the node's own endpoints). ours: every agent follows the registry
// (watch → Follower → xDS index); peer: scalePeerObservers agents poll the
// full list each liveness interval (the naive model, and what liveness did
// before it read only its own prefix). Reported: propagation of a new endpoint to every
// other agent (p50/p99 over agents × changes), etcd requests and keys
// received per node per minute at steady state, live heap per agent (the
// observers' heap once synced, over their number; the etcd server and the
// registries are outside it) and one more agent's time to sync.
func BenchmarkRegistryScale(b *testing.B) {
	e := etcdtest.Start(b)
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	nodes := make([]*scaleNode, scaleNodes)
	for i := range nodes {
		nodes[i] = newScaleNode(b, e, fmt.Sprintf("node-%03d", i))
	}
	var wg sync.WaitGroup
	errs := make(chan error, scaleNodes)
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range scalePods {
				if err := n.reg.Register(ctx, scaleEndpoint(n.name, i, j)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		b.Fatalf("failed to register the simulated pods: %v", err)
	}
	// Every agent's liveness loop reads its own endpoints each interval.
	livenessCtx, stopLiveness := context.WithCancel(ctx)
	var liveWG sync.WaitGroup
	for i, n := range nodes {
		liveWG.Add(1)
		go func() {
			defer liveWG.Done()
			// Staggered like independent agents.
			every(livenessCtx, time.Duration(i)*scaleLiveness/scaleNodes, func() {
				lctx, c := context.WithTimeout(livenessCtx, scaleLiveness)
				defer c()
				_, _ = n.reg.ListNode(lctx)
			})
		}()
	}
	b.Cleanup(func() { stopLiveness(); liveWG.Wait() })

	models := []struct {
		name      string
		observers int // agents running the model: nodes[:observers]
		start     func(ctx context.Context, n *scaleNode, wg *sync.WaitGroup) observer
	}{
		{"ours", scaleNodes, func(ctx context.Context, n *scaleNode, wg *sync.WaitGroup) observer {
			idx := workload.NewIndex()
			f := workload.NewFollower(n.reg, scaleConfig, idx, nil)
			wg.Add(1)
			go func() { defer wg.Done(); _ = f.Run(ctx) }()
			return &followerObserver{idx: idx}
		}},
		{"peer", scalePeerObservers, func(ctx context.Context, n *scaleNode, wg *sync.WaitGroup) observer {
			o := &pollObserver{uids: map[string]struct{}{}}
			poll := func() {
				lctx, c := context.WithTimeout(ctx, scaleLiveness)
				defer c()
				eps, err := n.reg.List(lctx)
				if err != nil {
					return
				}
				uids := make(map[string]struct{}, len(eps))
				for _, ep := range eps {
					uids[workload.UID(scaleConfig.ClusterID, ep.Namespace, ep.Name)] = struct{}{}
				}
				o.mu.Lock()
				o.uids = uids
				o.mu.Unlock()
			}
			poll()
			wg.Add(1)
			go func() { defer wg.Done(); every(ctx, scaleLiveness, poll) }()
			return o
		}},
	}
	seq := 0
	for _, m := range models {
		var run *scaleRun
		var stop func()
		var obs []observer
		b.Run(m.name, func(b *testing.B) {
			if run == nil {
				run = &scaleRun{}
				mctx, mcancel := context.WithCancel(ctx)
				var mwg sync.WaitGroup
				stop = func() { mcancel(); mwg.Wait() }
				before := heapAlloc()
				obs = make([]observer, m.observers)
				for i := range obs {
					obs[i] = m.start(mctx, nodes[i], &mwg)
				}
				all := workload.UID(scaleConfig.ClusterID, "shop", fmt.Sprintf("node-%03d-web-%d", scaleNodes-1, scalePods-1))
				waitAll(b, obs, all, 5*time.Minute)
				run.heapPerAgent = float64(heapAlloc()-before) / float64(len(obs))
				run.reqsPerMin, run.keysPerMin = steadyState(nodes[:len(obs)])
				run.syncNewAgent = newAgent(b, e, mctx, m.start, all)
			}
			for b.Loop() {
				seq++
				i := seq % len(nodes)
				ep := scaleEndpoint(nodes[i].name, i, scalePods+seq)
				uid := workload.UID(scaleConfig.ClusterID, ep.Namespace, ep.Name)
				start := time.Now()
				if err := nodes[i].reg.Register(ctx, ep); err != nil {
					b.Fatal(err)
				}
				run.prop = append(run.prop, propagation(b, obs, i, uid, start)...)
			}
			slices.Sort(run.prop)
			b.ReportMetric(float64(run.prop[len(run.prop)/2]), "p50-ns")
			b.ReportMetric(float64(run.prop[len(run.prop)*99/100]), "p99-ns")
			b.ReportMetric(run.reqsPerMin, "etcd-req/node/min")
			b.ReportMetric(run.keysPerMin, "etcd-keys/node/min")
			b.ReportMetric(run.heapPerAgent, "heap-B/agent")
			b.ReportMetric(float64(run.syncNewAgent), "sync-ns")
		})
		if stop != nil {
			stop()
		}
	}
}

// every runs fn after first, then on a scaleLiveness ticker, until ctx
// ends.
func every(ctx context.Context, first time.Duration, fn func()) {
	select {
	case <-ctx.Done():
		return
	case <-time.After(first):
	}
	t := time.NewTicker(scaleLiveness)
	defer t.Stop()
	for {
		fn()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// waitAll waits until every observer serves uid.
func waitAll(b *testing.B, obs []observer, uid string, bound time.Duration) {
	b.Helper()
	deadline := time.Now().Add(bound)
	for _, o := range obs {
		for !o.has(uid) {
			if time.Now().After(deadline) {
				b.Fatalf("%s not served by every simulated agent within %v", uid, bound)
			}
			time.Sleep(time.Millisecond)
		}
	}
}

// propagation waits until every observer but the writer's (obs[writer],
// if there is one) serves uid and returns, per observer, the time from
// start until it did (polled every 200 µs).
func propagation(b *testing.B, obs []observer, writer int, uid string, start time.Time) []time.Duration {
	b.Helper()
	seen := make([]bool, len(obs))
	want := len(obs)
	if writer < len(obs) {
		seen[writer] = true
		want--
	}
	out := make([]time.Duration, 0, want)
	deadline := start.Add(2 * time.Minute)
	for len(out) < want {
		for i, o := range obs {
			if !seen[i] && o.has(uid) {
				seen[i] = true
				out = append(out, time.Since(start))
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s reached %d of %d agents within 2m", uid, len(out), want)
		}
		time.Sleep(200 * time.Microsecond)
	}
	return out
}

// steadyState counts every node's etcd traffic over scaleWindow and
// returns the mean per node per minute.
func steadyState(nodes []*scaleNode) (reqsPerMin, keysPerMin float64) {
	var r0, k0 int64
	for _, n := range nodes {
		r0 += n.n.reqs.Load()
		k0 += n.n.keys.Load()
	}
	time.Sleep(scaleWindow)
	var r1, k1 int64
	for _, n := range nodes {
		r1 += n.n.reqs.Load()
		k1 += n.n.keys.Load()
	}
	scale := float64(time.Minute) / float64(scaleWindow) / float64(len(nodes))
	return float64(r1-r0) * scale, float64(k1-k0) * scale
}

// newAgent starts one more simulated agent with start and returns how long
// it took to serve the last endpoint, uid.
func newAgent(b *testing.B, e *etcdtest.Etcd, ctx context.Context,
	start func(context.Context, *scaleNode, *sync.WaitGroup) observer, uid string,
) time.Duration {
	b.Helper()
	actx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	t0 := time.Now()
	n := newScaleNode(b, e, "node-new")
	o := start(actx, n, &wg)
	waitAll(b, []observer{o}, uid, 2*time.Minute)
	return time.Since(t0)
}

// heapAlloc returns the live heap after a collection.
func heapAlloc() int64 {
	var m runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}
