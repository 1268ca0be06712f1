package pods

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
	"aether.io/node/registry/local"
)

// TestDeclaredPortsRecorded: AddPod records the ports the pod source
// reports (set and empty both survive a restart of the store: empty means
// "declares none", not "unknown"); a record written before the field
// existed loads without it (unknown), and the pod watch fills it in.
func TestDeclaredPortsRecorded(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	st, err := store.Open(dir, store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	managed := map[string]string{ManagedLabel: "true"}
	src := newFakeSource()
	src.set(&podsource.Pod{Namespace: "ns", Name: "web", UID: "u1", NodeName: "n", Labels: managed, DeclaredTCPPorts: []uint32{80, 8080}})
	src.set(&podsource.Pod{Namespace: "ns", Name: "bare", UID: "u2", NodeName: "n", Labels: managed})
	healthy := true
	m := New(Config{Node: "n", PodWait: 200 * time.Millisecond}, st, local.New(), src, alwaysHealthy{&healthy}, nil, nil)
	for _, p := range []*cniv1.CNIPod{
		{Namespace: "ns", Name: "web", ContainerId: "c1", NetworkNamespace: "/x", Ips: []string{"10.0.0.1"}},
		{Namespace: "ns", Name: "bare", ContainerId: "c2", NetworkNamespace: "/x", Ips: []string{"10.0.0.2"}},
	} {
		if res, err := m.AddPod(ctx, p, nil); err != nil || res != cniv1.AddPodResponse_RESULT_SUCCESS {
			t.Fatalf("AddPod %s = %v, %v", p.GetName(), res, err)
		}
	}
	// A record of an agent that predates the field.
	if err := st.Put(ctx, &store.Record{Node: "n", Pod: &cniv1.CNIPod{
		Namespace: "ns", Name: "old", Uid: "u3", ContainerId: "c3", NetworkNamespace: "/x", Ips: []string{"10.0.0.3"}, Labels: managed,
	}}); err != nil {
		t.Fatal(err)
	}
	st.Close()

	st, err = store.Open(dir, store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	get := func(key string) *cniv1.DeclaredPorts {
		t.Helper()
		r, err := st.Get(key)
		if err != nil {
			t.Fatal(err)
		}
		return r.Pod.GetDeclaredPorts()
	}
	if dp := get("c1"); dp == nil || !slices.Equal(dp.GetTcp(), []uint32{80, 8080}) {
		t.Errorf("c1 declared ports after reopen = %v, want tcp [80 8080]", dp)
	}
	if dp := get("c2"); dp == nil || len(dp.GetTcp()) != 0 {
		t.Errorf("c2 declared ports after reopen = %v, want present and empty", dp)
	}
	if dp := get("c3"); dp != nil {
		t.Errorf("old record's declared ports = %v, want unset (unknown)", dp)
	}

	obs := &portsObserver{}
	m = New(Config{Node: "n", PodWait: 200 * time.Millisecond, Observer: obs}, st, local.New(), src, alwaysHealthy{&healthy}, nil, nil)
	if n, err := m.Replay(ctx); err != nil || n != 3 {
		t.Fatalf("Replay = %d, %v; want 3 records", n, err)
	}
	m.Handler(ctx).OnPod(&podsource.Pod{Namespace: "ns", Name: "old", UID: "u3", NodeName: "n", Labels: managed, DeclaredTCPPorts: []uint32{9090}})
	if dp := get("c3"); dp == nil || !slices.Equal(dp.GetTcp(), []uint32{9090}) {
		t.Errorf("old record's declared ports after the watch saw the pod = %v, want tcp [9090]", dp)
	}
	// The observer (the listener sync) got the filled record.
	if dp := obs.last("c3"); dp == nil || !slices.Equal(dp.GetTcp(), []uint32{9090}) {
		t.Errorf("observer's last c3 record has declared ports %v, want tcp [9090]", dp)
	}
}

// portsObserver keeps the declared ports of the last stored record per key.
type portsObserver struct {
	mu    sync.Mutex
	ports map[string]*cniv1.DeclaredPorts
}

func (o *portsObserver) RecordStored(rec *store.Record, _ registry.Endpoint) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ports == nil {
		o.ports = map[string]*cniv1.DeclaredPorts{}
	}
	o.ports[rec.Key()] = rec.Pod.GetDeclaredPorts()
}

func (o *portsObserver) RecordRemoved(string) {}

func (o *portsObserver) last(key string) *cniv1.DeclaredPorts {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.ports[key]
}
