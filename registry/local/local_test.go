package local

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"aether.io/node/registry"
)

func TestWatchSeesSnapshotThenChanges(t *testing.T) {
	r := New()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ep := registry.Endpoint{
		Key: "a", Namespace: "ns", Name: "p", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
		Labels: map[string]string{"x": "1"}, Owner: &registry.Owner{Kind: "Job", Name: "j"}, Healthy: true,
	}
	if err := r.Register(ctx, ep); err != nil {
		t.Fatal(err)
	}
	ch, err := r.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := func() registry.Event {
		select {
		case ev := <-ch:
			return ev
		case <-time.After(10 * time.Second):
			t.Fatal("no event")
		}
		return registry.Event{}
	}
	if ev := next(); ev.Type != registry.EventPut || ev.Key != "a" || ev.Endpoint.Owner.Name != "j" || ev.Endpoint.IPs[0] != ep.IPs[0] {
		t.Fatalf("first event = %+v", ev)
	}
	ep.Labels["x"] = "mutated after register" // the registry holds a copy
	_ = r.Register(ctx, registry.Endpoint{Key: "b"})
	_ = r.Deregister(ctx, "a")
	_ = r.Deregister(ctx, "unknown") // no event
	if ev := next(); ev.Type != registry.EventPut || ev.Key != "b" {
		t.Fatalf("second event = %+v", ev)
	}
	if ev := next(); ev.Type != registry.EventDelete || ev.Key != "a" {
		t.Fatalf("third event = %+v", ev)
	}
	eps, _ := r.List(ctx)
	if len(eps) != 1 || eps[0].Key != "b" {
		t.Fatalf("List = %+v", eps)
	}
	cancel()
	for range ch {
	}
}
