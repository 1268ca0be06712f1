package pods

import (
	"context"
	"sync"
	"testing"
	"time"

	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
	"aether.io/node/registry/local"
)

// lastEndpoint keeps the last endpoint the observer was told of, per key.
type lastEndpoint struct {
	mu  sync.Mutex
	eps map[string]registry.Endpoint
}

func (o *lastEndpoint) RecordStored(_ *store.Record, ep registry.Endpoint) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.eps[ep.Key] = ep
}

func (o *lastEndpoint) RecordRemoved(string) {}

func (o *lastEndpoint) healthy(key string) (bool, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ep, ok := o.eps[key]
	return ep.Healthy, ok
}

// TestUncapturedServedUnhealthy follows a pod whose divert failed: the
// local xDS and the registry serve it UNHEALTHY from ReportAddResult on,
// the liveness loop keeps it so (no re-registration churn), and a later
// ADD that captures it serves it HEALTHY again.
func TestUncapturedServedUnhealthy(t *testing.T) {
	ctx := context.Background()
	st, src := webPodStore(t)
	live := true
	obs := &lastEndpoint{eps: map[string]registry.Endpoint{}}
	reg := local.New()
	m := New(Config{Node: "n", PodWait: 200 * time.Millisecond, Observer: obs}, st, reg, src, alwaysHealthy{healthy: &live}, nil, nil)
	pod := &cniv1.CNIPod{Namespace: "ns", Name: "web", ContainerId: "c1", NetworkNamespace: "/x", Ips: []string{"10.0.0.1"}}
	report := func(divertErr string) {
		t.Helper()
		if _, err := m.ReportAddResult(ctx, &cniv1.ReportAddResultRequest{
			ContainerId: "c1", Namespace: "ns", Name: "web",
			Timings: &cniv1.PluginTimings{CaptureDivertError: divertErr},
		}); err != nil {
			t.Fatal(err)
		}
	}
	check := func(step string, want bool) {
		t.Helper()
		if got, ok := obs.healthy("c1"); !ok || got != want {
			t.Errorf("%s: local xDS healthy = %v (known %v), want %v", step, got, ok, want)
		}
		eps, err := reg.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(eps) != 1 || eps[0].Healthy != want {
			t.Errorf("%s: registry = %+v, want one endpoint with healthy %v", step, eps, want)
		}
		if s, _ := m.Get("c1"); !s.Registered {
			t.Errorf("%s: pod not registered", step)
		}
	}

	if _, err := m.AddPod(ctx, pod, nil); err != nil {
		t.Fatal(err)
	}
	m.LivenessTick(ctx)
	check("after ADD", true)

	report("nft: no such table")
	check("after an UNCAPTURED report", false)
	m.LivenessTick(ctx)
	check("after a liveness tick", false)

	if _, err := m.AddPod(ctx, pod, nil); err != nil {
		t.Fatal(err)
	}
	check("after a retried ADD (still UNCAPTURED until its report)", false)
	report("")
	check("after a captured report", true)
	m.LivenessTick(ctx)
	check("after a second liveness tick", true)
}
