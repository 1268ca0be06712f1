package pods

import (
	"context"
	"testing"
	"time"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
	"aether.io/node/registry/local"
)

// TestLocalityWithoutTheAPIServer: the node's locality is stored with each
// record, so an agent restarted without its Node (the API server down:
// LocalityUnknown) registers and observes the replayed pods with the
// locality they had, not none; SetLocality (the Node read once the API
// server is back) publishes and stores the new one; a record written
// before records carried it gets the node's known locality at the next
// replay that knows it.
func TestLocalityWithoutTheAPIServer(t *testing.T) {
	ctx := context.Background()
	zoneA := registry.Locality{Region: "r1", Zone: "a", Subzone: "rack1"}
	zoneB := registry.Locality{Region: "r1", Zone: "b"}
	st, src := webPodStore(t)
	live := true

	// start runs an agent on the store: a new registry and observer, the
	// manager replayed.
	start := func(cfg Config) (*Manager, *local.Registry, *lastEndpoint) {
		t.Helper()
		obs := &lastEndpoint{eps: map[string]registry.Endpoint{}}
		reg := local.New()
		cfg.Node, cfg.PodWait, cfg.Observer = "n", 200*time.Millisecond, obs
		m := New(cfg, st, reg, src, alwaysHealthy{healthy: &live}, nil, nil)
		if _, err := m.Replay(ctx); err != nil {
			t.Fatal(err)
		}
		return m, reg, obs
	}
	// check asserts what the store, the registry and the observer hold
	// for the pod's sandbox c1.
	check := func(step string, reg *local.Registry, obs *lastEndpoint, want registry.Locality) {
		t.Helper()
		rec, err := st.Get("c1")
		if err != nil || rec == nil {
			t.Fatalf("%s: stored record of c1: %v, %v", step, rec, err)
		}
		eps, err := reg.List(ctx)
		if err != nil || len(eps) != 1 {
			t.Fatalf("%s: registry holds %v, %v; want the pod's endpoint", step, eps, err)
		}
		obs.mu.Lock()
		observed := obs.eps["c1"].Locality
		obs.mu.Unlock()
		if rec.Locality != want || eps[0].Locality != want || observed != want {
			t.Fatalf("%s: locality stored %+v, registered %+v, observed %+v; want %+v everywhere", step, rec.Locality, eps[0].Locality, observed, want)
		}
	}

	m, reg, obs := start(Config{Locality: zoneA})
	pod := &cniv1.CNIPod{Namespace: "ns", Name: "web", ContainerId: "c1", NetworkNamespace: "/x", Ips: []string{"10.0.0.1"}}
	if _, err := m.AddPod(ctx, pod, nil); err != nil {
		t.Fatal(err)
	}
	check("after AddPod", reg, obs, zoneA)

	m, reg, obs = start(Config{LocalityUnknown: true})
	check("restarted without the Node", reg, obs, zoneA)
	// A re-ADD while it is still unknown keeps the last known one.
	if _, err := m.AddPod(ctx, pod, nil); err != nil {
		t.Fatal(err)
	}
	check("re-added without the Node", reg, obs, zoneA)

	m.SetLocality(ctx, zoneB)
	check("after SetLocality", reg, obs, zoneB)
	m.SetLocality(ctx, zoneB)
	check("after SetLocality again", reg, obs, zoneB)

	// A record from an agent that predates the field: replay with a known
	// locality stores it, so a later restart without the Node keeps it.
	rec, err := st.Get("c1")
	if err != nil {
		t.Fatal(err)
	}
	rec.Locality = registry.Locality{}
	if err := st.Put(ctx, rec); err != nil {
		t.Fatal(err)
	}
	_, reg, obs = start(Config{Locality: zoneA})
	check("replayed an old record knowing the Node", reg, obs, zoneA)
	_, reg, obs = start(Config{LocalityUnknown: true})
	check("then restarted without the Node", reg, obs, zoneA)
}
