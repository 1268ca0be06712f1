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
