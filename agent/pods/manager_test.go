package pods

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pgregory.net/rapid"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/enrolment"
	"aether.io/node/registry"
	"aether.io/node/registry/local"
)

// fakeSource is a podsource.Source held in memory.
type fakeSource struct {
	mu   sync.Mutex
	pods map[string]*podsource.Pod
	// stale makes Get answer as a lagging cache would: the pod as it was
	// before deletion was requested.
	stale bool
	// cached, when it holds a pod, is what Get answers for it (a cache
	// that missed a delete and re-create); Fetch always reads pods.
	cached map[string]*podsource.Pod
	// fetches counts Fetch calls.
	fetches int
}

func newFakeSource() *fakeSource { return &fakeSource{pods: map[string]*podsource.Pod{}} }

func (f *fakeSource) set(p *podsource.Pod) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := *p
	f.pods[p.ID()] = &c
}

func (f *fakeSource) remove(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.pods, id)
}

func (f *fakeSource) Get(_ context.Context, ns, name string) (*podsource.Pod, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p, ok := f.cached[ns+"/"+name]; ok {
		c := *p
		return &c, nil
	}
	if p, ok := f.pods[ns+"/"+name]; ok {
		c := *p
		if f.stale {
			c.Terminating = false
		}
		return &c, nil
	}
	return nil, podsource.ErrNotFound
}

func (f *fakeSource) Fetch(_ context.Context, ns, name string) (*podsource.Pod, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fetches++
	if p, ok := f.pods[ns+"/"+name]; ok {
		c := *p
		return &c, nil
	}
	return nil, podsource.ErrNotFound
}

func (f *fakeSource) Run(ctx context.Context, _ podsource.Handler) error { <-ctx.Done(); return nil }

func (f *fakeSource) Synced() <-chan struct{} { c := make(chan struct{}); close(c); return c }

func (f *fakeSource) List() []*podsource.Pod {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*podsource.Pod
	for _, p := range f.pods {
		c := *p
		out = append(out, &c)
	}
	return out
}

// checkingRegistry fails the test when a key of a terminating pod is
// registered. Replay registers concurrently: it is safe for concurrent use.
type checkingRegistry struct {
	*local.Registry
	terminating func(key string) bool
	t           interface{ Fatalf(string, ...any) }
	registers   atomic.Int64
}

func (c *checkingRegistry) Register(ctx context.Context, ep registry.Endpoint) error {
	c.registers.Add(1)
	if c.terminating(ep.Key) {
		c.t.Fatalf("registered endpoint %s of a terminating pod", ep.Key)
	}
	return c.Registry.Register(ctx, ep)
}

type alwaysHealthy struct{ healthy *bool }

func (a alwaysHealthy) Healthy(*store.Record) bool { return *a.healthy }

// TestNeverReregisterTerminating: random interleavings of AddPod,
// deletionTimestamp, deletion, liveness ticks (with health flapping),
// RemovePod and agent restarts never register a terminating pod, and a
// terminating pod is never left registered.
func TestNeverReregisterTerminating(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		dir := t.TempDir()
		ctx := context.Background()
		src := newFakeSource()
		const nPods = 3
		pods := make([]*podsource.Pod, nPods)
		for i := range pods {
			pods[i] = &podsource.Pod{
				Namespace: "ns", Name: fmt.Sprintf("p%d", i), UID: fmt.Sprintf("uid-%d", i), NodeName: "n",
				Labels: map[string]string{ManagedLabel: "true"},
			}
			src.set(pods[i])
		}
		terminatingPod := map[int]bool{} // the test's truth: deletion requested
		keyPod := map[string]int{}       // container ID -> pod index
		healthy := true
		isTerm := func(key string) bool { i, ok := keyPod[key]; return ok && terminatingPod[i] }

		var st *store.Store
		var m *Manager
		var reg *checkingRegistry
		open := func() {
			var err error
			st, err = store.Open(dir, store.Options{NoSync: true})
			if err != nil {
				rt.Fatalf("open store: %v", err)
			}
			reg = &checkingRegistry{Registry: local.New(), terminating: isTerm, t: rt}
			m = New(Config{Node: "n", Enrolment: enrolment.Rules{SystemNamespaces: enrolment.DefaultSystemNamespaces}}, st, reg, src, alwaysHealthy{&healthy}, nil, nil)
			if _, err := m.Replay(ctx); err != nil {
				rt.Fatalf("replay: %v", err)
			}
		}
		open()
		defer func() { st.Close() }()
		h := m.Handler(ctx)

		rt.Repeat(map[string]func(*rapid.T){
			"add": func(rt *rapid.T) {
				i := rapid.IntRange(0, nPods-1).Draw(rt, "pod")
				c := rapid.IntRange(0, 1).Draw(rt, "container")
				key := fmt.Sprintf("c-%d-%d", i, c)
				keyPod[key] = i
				stale := rapid.Bool().Draw(rt, "stale_source")
				src.mu.Lock()
				src.stale = stale
				src.mu.Unlock()
				res, err := m.AddPod(ctx, &cniv1.CNIPod{
					Namespace: "ns", Name: pods[i].Name, ContainerId: key,
					NetworkNamespace: "/x", Ips: []string{"10.0.0.1"},
				}, nil)
				if err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS {
					rt.Fatalf("AddPod %s = %v, %v", key, res, err)
				}
			},
			"deletionTimestamp": func(rt *rapid.T) {
				i := rapid.IntRange(0, nPods-1).Draw(rt, "pod")
				terminatingPod[i] = true
				pods[i].Terminating = true
				src.set(pods[i])
				h = m.Handler(ctx)
				h.OnPod(pods[i])
			},
			"delete": func(rt *rapid.T) {
				i := rapid.IntRange(0, nPods-1).Draw(rt, "pod")
				terminatingPod[i] = true
				src.remove(pods[i].ID())
				m.Handler(ctx).OnDelete(pods[i])
				src.set(&podsource.Pod{
					Namespace: "ns", Name: pods[i].Name, UID: pods[i].UID, NodeName: "n", Terminating: true,
					Labels: map[string]string{ManagedLabel: "true"},
				})
			},
			"relabel": func(rt *rapid.T) {
				i := rapid.IntRange(0, nPods-1).Draw(rt, "pod")
				p := *pods[i]
				p.Labels = map[string]string{ManagedLabel: "true", "v": rapid.StringMatching(`[a-z]{1,3}`).Draw(rt, "v")}
				if !p.Terminating {
					m.Handler(ctx).OnPod(&p)
				}
			},
			"liveness": func(rt *rapid.T) {
				healthy = rapid.Bool().Draw(rt, "healthy")
				m.LivenessTick(ctx)
			},
			"remove": func(rt *rapid.T) {
				i := rapid.IntRange(0, nPods-1).Draw(rt, "pod")
				c := rapid.IntRange(0, 1).Draw(rt, "container")
				if _, err := m.RemovePod(ctx, "ns", pods[i].Name, fmt.Sprintf("c-%d-%d", i, c), nil); err != nil {
					rt.Fatalf("RemovePod: %v", err)
				}
			},
			"restart": func(rt *rapid.T) {
				st.Close()
				open()
				m.Reconcile(ctx)
			},
			"": func(rt *rapid.T) {
				// Invariants after every step.
				eps, _ := reg.List(ctx)
				for _, ep := range eps {
					if isTerm(ep.Key) {
						rt.Fatalf("terminating pod %s is registered", ep.Key)
					}
				}
				for _, s := range m.List() {
					if isTerm(s.Record.Key()) && !s.Record.Pod.GetTerminating() {
						rt.Fatalf("record %s of a terminating pod is not marked terminating", s.Record.Key())
					}
					if !s.Record.Pod.GetTerminating() && !s.Registered {
						rt.Fatalf("live record %s is not registered", s.Record.Key())
					}
				}
			},
		})
	})
}

// preparingObserver logs the Observer and Preparer calls in order.
type preparingObserver struct {
	mu    sync.Mutex
	calls []string
}

func (o *preparingObserver) log(s string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.calls = append(o.calls, s)
}

func (o *preparingObserver) Prepare(rec *store.Record) { o.log("prepare " + rec.Key()) }

func (o *preparingObserver) RecordStored(rec *store.Record, _ registry.Endpoint) {
	o.log("stored " + rec.Key())
}

func (o *preparingObserver) RecordRemoved(key string) { o.log("removed " + key) }

// TestPreparerBeforeStored: an Observer that is a Preparer gets the record
// of an AddPod once, before it is told the record is stored; a
// ReportAddResult (same pod, no new build) and a RemovePod prepare nothing.
func TestPreparerBeforeStored(t *testing.T) {
	ctx := context.Background()
	st, src := webPodStore(t)
	live := true
	obs := &preparingObserver{}
	m := New(Config{Node: "n", PodWait: 200 * time.Millisecond, Observer: obs}, st, local.New(), src, alwaysHealthy{healthy: &live}, nil, nil)
	pod := &cniv1.CNIPod{Namespace: "ns", Name: "web", ContainerId: "c1", NetworkNamespace: "/x", Ips: []string{"10.0.0.1"}}
	if _, err := m.AddPod(ctx, pod, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := m.ReportAddResult(ctx, &cniv1.ReportAddResultRequest{ContainerId: "c1", Namespace: "ns", Name: "web"}); err != nil {
		t.Fatal(err)
	}
	if _, err := m.RemovePod(ctx, "ns", "web", "c1", nil); err != nil {
		t.Fatal(err)
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	want := []string{"prepare c1", "stored c1"}
	if len(obs.calls) < len(want) || obs.calls[0] != want[0] || obs.calls[1] != want[1] {
		t.Fatalf("calls %q, want them to start with %q", obs.calls, want)
	}
	for _, c := range obs.calls[1:] {
		if c == "prepare c1" {
			t.Fatalf("calls %q: prepared more than once", obs.calls)
		}
	}
	if last := obs.calls[len(obs.calls)-1]; last != "removed c1" {
		t.Fatalf("calls %q, want the last to be %q", obs.calls, "removed c1")
	}
}
