package pods

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	"aether.io/node/agent/telemetry"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	"aether.io/node/registry/etcd/etcdtest"
	"aether.io/node/registry/local"
)

// bound is how long a test waits for something that must happen; reaching
// it means a deadlock or a lost write, never slowness.
const bound = 30 * time.Second

// gateRegistry is a local registry whose Register of a gated key waits for
// its gate to close (telling entered first), whose Deregister fails while
// failDeregs is positive, and whose List fails while listErr is set.
type gateRegistry struct {
	*local.Registry
	entered chan string

	mu         sync.Mutex
	gates      map[string]chan struct{}
	failDeregs int
	deregs     int
	listErr    error
	withdrawn  []string
}

func newGateRegistry() *gateRegistry {
	return &gateRegistry{Registry: local.New(), entered: make(chan string, 16), gates: map[string]chan struct{}{}}
}

func (g *gateRegistry) Register(ctx context.Context, ep registry.Endpoint) error {
	g.mu.Lock()
	gate := g.gates[ep.Key]
	g.mu.Unlock()
	if gate != nil {
		g.entered <- ep.Key
		<-gate
	}
	return g.Registry.Register(ctx, ep)
}

func (g *gateRegistry) Deregister(ctx context.Context, key string) error {
	g.mu.Lock()
	g.deregs++
	fail := g.failDeregs > 0
	if fail {
		g.failDeregs--
	}
	g.mu.Unlock()
	if fail {
		return errors.New("etcd unavailable")
	}
	return g.Registry.Deregister(ctx, key)
}

func (g *gateRegistry) Withdraw(key string) {
	g.mu.Lock()
	g.withdrawn = append(g.withdrawn, key)
	g.mu.Unlock()
	g.Registry.Withdraw(key)
}

func (g *gateRegistry) wasWithdrawn(key string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Contains(g.withdrawn, key)
}

func (g *gateRegistry) List(ctx context.Context) ([]registry.Endpoint, error) {
	g.mu.Lock()
	err := g.listErr
	g.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return g.Registry.List(ctx)
}

func (g *gateRegistry) deregCalls() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.deregs
}

// keys returns the registered keys, sorted.
func keys(t *testing.T, reg registry.Registry) []string {
	t.Helper()
	eps, err := reg.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, ep := range eps {
		out = append(out, ep.Key)
	}
	slices.Sort(out)
	return out
}

// metric reads the value of the metric family name (one series) from reg.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		m := mf.GetMetric()[0]
		if c := m.GetCounter(); c != nil {
			return c.GetValue()
		}
		return m.GetGauge().GetValue()
	}
	t.Errorf("metric %s not registered", name)
	return -1
}

// testManager builds a manager on a fresh store over reg, with managed pods
// named names on node "n" (uid "uid-<name>").
func testManager(t *testing.T, reg registry.Registry, names ...string) (*Manager, *telemetry.Metrics) {
	t.Helper()
	st := openStore(t)
	src := newFakeSource()
	for _, n := range names {
		src.set(&podsource.Pod{Namespace: "ns", Name: n, UID: "uid-" + n, NodeName: "n", Labels: map[string]string{ManagedLabel: "true"}})
	}
	healthy := true
	metrics := telemetry.NewMetrics()
	return New(Config{Node: "n", PodWait: time.Second}, st, reg, src, alwaysHealthy{&healthy}, metrics, nil), metrics
}

// openStore opens a store in a temporary directory, closed in t.Cleanup.
func openStore(t *testing.T) *store.Store {
	t.Helper()
	st, err := store.Open(t.TempDir(), store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func addPod(ctx context.Context, m *Manager, name string) error {
	res, err := m.AddPod(ctx, &cniv1.CNIPod{
		Namespace: "ns", Name: name, ContainerId: "sb-" + name, NetworkNamespace: "/x", Ips: []string{"10.0.0.1"},
	}, nil)
	if err == nil && res != cniv1.AddPodResponse_RESULT_SUCCESS {
		err = fmt.Errorf("AddPod %s = %v", name, res)
	}
	return err
}

// within runs fn and fails the test if it has not returned within bound
// or returned an error. fn must not touch t (it may outlive the test).
func within(t *testing.T, what string, fn func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("%s: %v", what, err)
		}
	case <-time.After(bound):
		t.Fatalf("%s did not complete: blocked behind a registry write in flight", what)
	}
}

// eventually polls cond (under the manager's own locking) until it holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, bound)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestRegistryWritesOutsideTheLock: while one pod's Register hangs (an
// etcd brownout), AddPod of another pod, the admin list and Get complete;
// and a pod marked terminating, or removed, while its Register is in
// flight is withdrawn at once and ends deregistered (the stale write is
// followed by a corrective Deregister).
func TestRegistryWritesOutsideTheLock(t *testing.T) {
	for _, tc := range []struct {
		name string
		// act ends pod a's life while its Register is in flight; gone
		// reports (through the manager) that it did.
		act  func(ctx context.Context, m *Manager) error
		gone func(m *Manager) bool
	}{
		{
			name: "terminating",
			act: func(ctx context.Context, m *Manager) error {
				m.MarkTerminating(ctx, "ns", "a", "uid-a", "deletion_timestamp")
				return nil
			},
			gone: func(m *Manager) bool { s, ok := m.Get("sb-a"); return ok && s.Record.Pod.GetTerminating() },
		},
		{
			name: "removed",
			act: func(ctx context.Context, m *Manager) error {
				_, err := m.RemovePod(ctx, "ns", "a", "sb-a", nil)
				return err
			},
			gone: func(m *Manager) bool { _, ok := m.Get("sb-a"); return !ok },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			reg := newGateRegistry()
			gate := make(chan struct{})
			reg.gates["sb-a"] = gate
			release := sync.OnceFunc(func() { close(gate) })
			t.Cleanup(release)
			m, _ := testManager(t, reg, "a", "b")

			addA := make(chan error, 1)
			go func() { addA <- addPod(ctx, m, "a") }()
			select {
			case <-reg.entered:
			case <-time.After(bound):
				t.Fatal("Register of pod a never started")
			}
			within(t, "AddPod of another pod", func() error { return addPod(ctx, m, "b") })
			within(t, "the admin list", func() error {
				if n := len(m.List()); n != 2 {
					return fmt.Errorf("List holds %d records, want 2", n)
				}
				return nil
			})
			if s, ok := m.Get("sb-b"); !ok || !s.Registered {
				t.Errorf("pod b registered = %v, want true", s.Registered)
			}

			acted := make(chan error, 1)
			go func() { acted <- tc.act(ctx, m) }()
			eventually(t, "pod a's end recorded", func() bool { return tc.gone(m) })
			// Withdrawn where its end is recorded, not after the write in
			// flight: a lease re-grant meanwhile must not put it back.
			if !reg.wasWithdrawn("sb-a") {
				t.Error("pod a was not withdrawn from the registry while its Register was in flight")
			}
			release()
			select {
			case err := <-acted:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(bound):
				t.Fatal("ending pod a did not complete after its Register returned")
			}
			if err := <-addA; err != nil {
				t.Fatal(err)
			}
			if got := keys(t, reg); !slices.Equal(got, []string{"sb-b"}) {
				t.Errorf("registered keys = %v, want [sb-b]: a pod that ended during its Register stays registered", got)
			}
			if s, ok := m.Get("sb-a"); ok && s.Registered {
				t.Error("pod a still marked registered")
			}
		})
	}
}

// TestFailedDeregistrationRetried: a deregistration that fails is retried
// with a doubling backoff on the liveness loop until it succeeds, also
// when the registry cannot be listed (so the ghost sweep cannot help), and
// the pending count is exported.
func TestFailedDeregistrationRetried(t *testing.T) {
	ctx := context.Background()
	reg := newGateRegistry()
	m, metrics := testManager(t, reg, "a")
	now := time.Unix(1_700_000_000, 0)
	m.now = func() time.Time { return now }
	if err := addPod(ctx, m, "a"); err != nil {
		t.Fatal(err)
	}
	reg.mu.Lock()
	reg.failDeregs = 2
	reg.listErr = errors.New("list deadline exceeded")
	reg.mu.Unlock()
	if _, err := m.RemovePod(ctx, "ns", "a", "sb-a", nil); err != nil {
		t.Fatal(err)
	}
	const pending = "aether_agent_registry_pending_deregistrations"
	for _, step := range []struct {
		advance     time.Duration
		wantDeregs  int
		wantPending float64
		wantKeys    []string
	}{
		{0, 1, 1, []string{"sb-a"}},           // the first attempt failed; backoff 1s
		{time.Second, 2, 1, []string{"sb-a"}}, // retried, failed again; backoff 2s
		{time.Second, 2, 1, []string{"sb-a"}}, // not due yet
		{time.Second, 3, 0, nil},              // retried and done
		{time.Hour, 3, 0, nil},                // nothing left to retry
	} {
		now = now.Add(step.advance)
		m.LivenessTick(ctx)
		if got := reg.deregCalls(); got != step.wantDeregs {
			t.Errorf("+%s: %d Deregister calls, want %d", step.advance, got, step.wantDeregs)
		}
		if got := metric(t, metrics.Registry, pending); got != step.wantPending {
			t.Errorf("+%s: %s = %v, want %v", step.advance, pending, got, step.wantPending)
		}
		if got := keys(t, reg.Registry); !slices.Equal(got, step.wantKeys) {
			t.Errorf("+%s: registered keys = %v, want %v", step.advance, got, step.wantKeys)
		}
	}
}

// TestGhostSweepOverEtcd: the liveness loop deletes this node's keys in
// etcd that no live record owns (a key whose deregistration was lost, a
// late write of a terminating pod), registers again a live record whose
// key vanished, leaves other nodes' keys alone, and counts both repairs.
func TestGhostSweepOverEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	ctx := context.Background()
	open := func(node string) *etcdreg.Registry {
		r, err := etcdreg.New(etcdreg.Options{Endpoints: []string{e.Endpoint()}, Node: node, Prefix: "/test/eps/", Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Close() })
		return r
	}
	reg, other := open("n"), open("n2")
	m, metrics := testManager(t, reg, "a", "b", "t")
	for _, p := range []string{"a", "b", "t"} {
		if err := addPod(ctx, m, p); err != nil {
			t.Fatal(err)
		}
	}
	m.MarkTerminating(ctx, "ns", "t", "uid-t", "deletion_timestamp")
	ep := func(key, node string) registry.Endpoint {
		return registry.Endpoint{Key: key, Node: node, Namespace: "ns", Name: key, IPs: []netip.Addr{netip.MustParseAddr("10.9.9.9")}, Healthy: true}
	}
	// A key whose record is gone (its deregistration was lost), a late
	// write of the terminating pod, a vanished key of a live pod, and
	// another node's key.
	for _, w := range []registry.Endpoint{ep("sb-ghost", "n"), ep("sb-t", "n")} {
		if err := reg.Register(ctx, w); err != nil {
			t.Fatal(err)
		}
	}
	if err := reg.Deregister(ctx, "sb-a"); err != nil {
		t.Fatal(err)
	}
	if err := other.Register(ctx, ep("sb-remote", "n2")); err != nil {
		t.Fatal(err)
	}

	m.LivenessTick(ctx)

	if got := keys(t, reg); !slices.Equal(got, []string{"sb-a", "sb-b", "sb-remote"}) {
		t.Errorf("keys in etcd after the sweep = %v, want [sb-a sb-b sb-remote]", got)
	}
	for name, want := range map[string]float64{
		"aether_agent_registry_ghosts_deleted_total": 2,
		"aether_agent_registry_reregistered_total":   1,
	} {
		if got := metric(t, metrics.Registry, name); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	// A second tick finds nothing to repair.
	m.LivenessTick(ctx)
	if got := metric(t, metrics.Registry, "aether_agent_registry_ghosts_deleted_total"); got != 2 {
		t.Errorf("second tick deleted more ghosts: %v", got)
	}
}

// deadlineRegistry records the deadline of every Register and, unless
// hang is false, blocks it until its context ends (etcd away).
type deadlineRegistry struct {
	*local.Registry
	hang      atomic.Bool
	mu        sync.Mutex
	deadlines []time.Time
}

func (d *deadlineRegistry) Register(ctx context.Context, ep registry.Endpoint) error {
	if !d.hang.Load() {
		return d.Registry.Register(ctx, ep)
	}
	dl, _ := ctx.Deadline()
	d.mu.Lock()
	d.deadlines = append(d.deadlines, dl)
	d.mu.Unlock()
	<-ctx.Done()
	return ctx.Err()
}

// TestReplayRegistersUnderOneDeadline: a restart while the registry hangs
// waits one write timeout for all its pods together, not one per pod (the
// CNI socket opens after Replay); the records are loaded all the same.
func TestReplayRegistersUnderOneDeadline(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := store.Open(dir, store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	const n = 3 * replayParallel
	for i := range n {
		if err := st.Put(ctx, &store.Record{Node: "n", Pod: &cniv1.CNIPod{
			ContainerId: fmt.Sprintf("sb-%d", i), Namespace: "ns", Name: fmt.Sprintf("p%d", i), Ips: []string{"10.0.0.1"},
		}}); err != nil {
			t.Fatal(err)
		}
	}
	reg := &deadlineRegistry{Registry: local.New()}
	reg.hang.Store(true)
	healthy := true
	m := New(Config{Node: "n"}, st, reg, newFakeSource(), alwaysHealthy{&healthy}, nil, nil)
	got, err := m.Replay(ctx)
	if err != nil || got != n {
		t.Fatalf("Replay = %d, %v; want %d records", got, err, n)
	}
	if len(m.List()) != n {
		t.Errorf("%d records loaded, want %d", len(m.List()), n)
	}
	// The first replayParallel writes hang until the shared deadline; the
	// rest start after it and fail at once: every write has that deadline.
	if len(reg.deadlines) != n {
		t.Fatalf("%d Register calls, want %d", len(reg.deadlines), n)
	}
	for i, dl := range reg.deadlines {
		if dl.IsZero() || !dl.Equal(reg.deadlines[0]) {
			t.Fatalf("Register %d had deadline %v, want the shared %v", i, dl, reg.deadlines[0])
		}
	}
}

// TestReplaySetsPodGauges: after a restart, aether_agent_pods shows the
// replayed records as soon as Replay returns, before any liveness tick
// (with the API server down the agent serves them long before its first
// sync; the Kubernetes lane checks the same on a real kubelet).
func TestReplaySetsPodGauges(t *testing.T) {
	for _, tc := range []struct {
		name                                      string
		live, terminating                         int
		hang                                      bool
		wantStored, wantRegistered, wantTerminate float64
	}{
		{name: "empty store"},
		{name: "live and terminating", live: 2, terminating: 1, wantStored: 3, wantRegistered: 2, wantTerminate: 1},
		{name: "registry hangs", live: 2, hang: true, wantStored: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			st := openStore(t)
			for i := range tc.live + tc.terminating {
				if err := st.Put(ctx, &store.Record{Node: "n", Pod: &cniv1.CNIPod{
					ContainerId: fmt.Sprintf("sb-%d", i), Namespace: "ns", Name: fmt.Sprintf("p%d", i), Uid: fmt.Sprintf("uid-%d", i),
					Ips: []string{"10.0.0.1"}, Terminating: i >= tc.live,
				}}); err != nil {
					t.Fatal(err)
				}
			}
			reg := &deadlineRegistry{Registry: local.New()}
			reg.hang.Store(tc.hang)
			healthy := true
			metrics := telemetry.NewMetrics()
			m := New(Config{Node: "n"}, st, reg, newFakeSource(), alwaysHealthy{&healthy}, metrics, nil)
			if _, err := m.Replay(ctx); err != nil {
				t.Fatal(err)
			}
			for state, want := range map[string]float64{"stored": tc.wantStored, "registered": tc.wantRegistered, "terminating": tc.wantTerminate, "uncaptured": 0} {
				var got dto.Metric
				if err := metrics.Pods.WithLabelValues(state).Write(&got); err != nil || got.GetGauge().GetValue() != want {
					t.Errorf("aether_agent_pods{state=%q} after Replay = %v (%v), want %v", state, got.GetGauge().GetValue(), err, want)
				}
			}
		})
	}
}

// TestAddPodWithinItsDeadline: with the registry hanging, AddPod answers
// within the CNI call's deadline (its Register is cut before it), the pod
// is stored, and the liveness loop registers it once the registry is back.
func TestAddPodWithinItsDeadline(t *testing.T) {
	reg := &deadlineRegistry{Registry: local.New()}
	reg.hang.Store(true)
	m, _ := testManager(t, reg, "a")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	reqDeadline, _ := ctx.Deadline()
	if err := addPod(ctx, m, "a"); err != nil {
		t.Fatalf("AddPod with the registry hanging = %v, want success", err)
	}
	if len(reg.deadlines) != 1 || !reg.deadlines[0].Before(reqDeadline) {
		t.Fatalf("Register deadlines %v, want one before the request's %v", reg.deadlines, reqDeadline)
	}
	if s, ok := m.Get("sb-a"); !ok || s.Registered {
		t.Fatalf("after AddPod: stored %v, registered %v; want stored, not registered", ok, s.Registered)
	}
	reg.hang.Store(false)
	m.LivenessTick(context.Background())
	if got := keys(t, reg.Registry); !slices.Equal(got, []string{"sb-a"}) {
		t.Errorf("registered keys after the registry came back = %v, want [sb-a]", got)
	}
}

// TestRemovePodDoesNotWaitBehindKeyWrite: while a background write of a
// pod's key hangs (the liveness loop re-registering it during an etcd
// brownout), RemovePod of that pod answers within its own deadline instead
// of waiting for the key's write lock, and the key's deregistration joins
// the retry set (regression: DEL outlived aether-cni's deadline in
// test/multinode no_quorum). Once the write returns, the key ends deleted.
func TestRemovePodDoesNotWaitBehindKeyWrite(t *testing.T) {
	ctx := context.Background()
	reg := newGateRegistry()
	m, _ := testManager(t, reg, "a")
	now := time.Unix(1_700_000_000, 0)
	m.now = func() time.Time { return now }
	if err := addPod(ctx, m, "a"); err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	reg.mu.Lock()
	reg.gates["sb-a"] = gate
	reg.mu.Unlock()
	m.mu.Lock()
	e := m.entries["sb-a"]
	m.mu.Unlock()
	bg := make(chan struct{})
	go func() { defer close(bg); m.register(ctx, e, false) }() // a health change, written in the background
	<-reg.entered

	within(t, "RemovePod with a write of its key in flight", func() error {
		dctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		_, err := m.RemovePod(dctx, "ns", "a", "sb-a", nil)
		return err
	})
	m.mu.Lock()
	_, pending := m.retries["sb-a"]
	m.mu.Unlock()
	if !pending {
		t.Error("the deregistration RemovePod could not run is not in the retry set")
	}
	close(gate)
	<-bg
	now = now.Add(time.Minute)
	m.LivenessTick(ctx)
	if got := keys(t, reg.Registry); len(got) != 0 {
		t.Errorf("registered keys after the write returned and a liveness tick = %v, want none", got)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.retries) != 0 {
		t.Errorf("retry set %v after the key was deleted, want empty", m.retries)
	}
}

// TestTerminatingAfterFailedReRegister: a registered pod whose
// re-registration fails (a health change during an etcd brownout) still
// has its key in the registry; when it turns terminating, the key is
// deleted (regression: the failed Register marked it unregistered, so no
// Deregister ran and the etcd backend wrote the key back after its next
// lease loss: found by test/multinode TestEtcdFaultsRandomized, seed
// 1796068602677676051).
func TestTerminatingAfterFailedReRegister(t *testing.T) {
	ctx := context.Background()
	reg := &deadlineRegistry{Registry: local.New()}
	m, _ := testManager(t, reg, "a")
	if err := addPod(ctx, m, "a"); err != nil {
		t.Fatal(err)
	}
	reg.hang.Store(true)
	m.mu.Lock()
	e := m.entries["sb-a"]
	m.mu.Unlock()
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	if m.registerWith(wctx, e, false) {
		t.Fatal("a Register with the registry hanging succeeded")
	}
	cancel()
	reg.hang.Store(false)
	m.MarkTerminating(ctx, "ns", "a", "uid-a", "deletion_timestamp")
	if got := keys(t, reg.Registry); len(got) != 0 {
		t.Errorf("registered keys after the pod turned terminating = %v, want none", got)
	}
}
