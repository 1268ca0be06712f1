package etcd

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"aether.io/node/registry"
	"aether.io/node/registry/etcd/etcdtest"
)

func ep(node string, i int) registry.Endpoint {
	return registry.Endpoint{
		Key: fmt.Sprintf("%s-sandbox-%d", node, i), Node: node, Namespace: "shop", Name: fmt.Sprintf("%s-pod-%d", node, i),
		IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 0, 0, byte(i)})}, Healthy: true,
	}
}

func newReg(t *testing.T, e *etcdtest.Etcd, node string, ttl time.Duration) *Registry {
	t.Helper()
	r, err := New(Options{Endpoints: []string{e.Endpoint()}, Node: node, LeaseTTL: ttl, Prefix: "/test/eps/", Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// view follows a registry's Watch into a map, like a follower does.
type view struct {
	t    *testing.T
	ch   <-chan registry.Event
	eps  map[string]registry.Endpoint
	seen []registry.Event
}

func watchView(t *testing.T, r *Registry) *view {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := r.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &view{t: t, ch: ch, eps: map[string]registry.Endpoint{}}
}

// until applies events until cond holds, bounded generously (never a
// timing assertion).
func (v *view) until(what string, cond func(map[string]registry.Endpoint) bool) {
	v.t.Helper()
	deadline := time.After(90 * time.Second)
	for !cond(v.eps) {
		select {
		case ev, ok := <-v.ch:
			if !ok {
				v.t.Fatalf("watch closed while waiting for %s", what)
			}
			v.seen = append(v.seen, ev)
			switch ev.Type {
			case registry.EventPut:
				if ev.Key != ev.Endpoint.Key {
					v.t.Fatalf("put event key %q != endpoint key %q", ev.Key, ev.Endpoint.Key)
				}
				v.eps[ev.Key] = ev.Endpoint
			case registry.EventDelete:
				delete(v.eps, ev.Key)
			}
		case <-deadline:
			v.t.Fatalf("no %s within 90s; view has %d endpoints", what, len(v.eps))
		}
	}
}

func has(keys ...string) func(map[string]registry.Endpoint) bool {
	return func(m map[string]registry.Endpoint) bool {
		for _, k := range keys {
			if _, ok := m[k]; !ok {
				return false
			}
		}
		return true
	}
}

func hasNot(keys ...string) func(map[string]registry.Endpoint) bool {
	return func(m map[string]registry.Endpoint) bool {
		for _, k := range keys {
			if _, ok := m[k]; ok {
				return false
			}
		}
		return true
	}
}

func TestRegisterWatchDeregister(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 0)
	b := newReg(t, e, "node-b", 0)
	ctx := context.Background()
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	vb := watchView(t, b) // initial Puts
	vb.until("initial put of a/1", has("node-a-sandbox-1"))
	if got := vb.eps["node-a-sandbox-1"]; got.Name != "node-a-pod-1" || got.IPs[0] != netip.MustParseAddr("10.0.0.1") || !got.Healthy {
		t.Errorf("endpoint round trip = %+v", got)
	}
	if err := b.Register(ctx, ep("node-b", 2)); err != nil {
		t.Fatal(err)
	}
	vb.until("put of b/2", has("node-b-sandbox-2"))
	list, err := a.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 {
		t.Errorf("List = %d endpoints, want 2", len(list))
	}
	// Re-registering with a change is a Put; deregistering is a Delete at once.
	changed := ep("node-a", 1)
	changed.Healthy = false
	if err := a.Register(ctx, changed); err != nil {
		t.Fatal(err)
	}
	vb.until("unhealthy update", func(m map[string]registry.Endpoint) bool { return !m["node-a-sandbox-1"].Healthy })
	if err := a.Deregister(ctx, "node-a-sandbox-1"); err != nil {
		t.Fatal(err)
	}
	vb.until("delete of a/1", hasNot("node-a-sandbox-1"))
	if err := a.Deregister(ctx, "never-registered"); err != nil {
		t.Errorf("Deregister of an unknown key: %v", err)
	}
}

func TestDeadNodeLosesEndpointsWhenLeaseExpires(t *testing.T) {
	e := etcdtest.Start(t)
	// Agent A's client is closed without revoking its lease: a crash.
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint()}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := NewWithClient(cli, Options{Node: "node-a", LeaseTTL: 2 * time.Second, Prefix: "/test/eps/"})
	if err != nil {
		t.Fatal(err)
	}
	b := newReg(t, e, "node-b", 0)
	ctx := context.Background()
	for i := range 3 {
		if err := a.Register(ctx, ep("node-a", i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Register(ctx, ep("node-b", 9)); err != nil {
		t.Fatal(err)
	}
	vb := watchView(t, b)
	vb.until("a's endpoints", has("node-a-sandbox-0", "node-a-sandbox-1", "node-a-sandbox-2", "node-b-sandbox-9"))
	if err := cli.Close(); err != nil {
		t.Fatal(err)
	}
	vb.until("a's endpoints to expire", hasNot("node-a-sandbox-0", "node-a-sandbox-1", "node-a-sandbox-2"))
	if _, ok := vb.eps["node-b-sandbox-9"]; !ok {
		t.Error("live node b lost its endpoint")
	}
	_ = a.Close()
}

func TestRevokeDeletesAtOnce(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 0) // 10 s TTL: only Revoke can remove it soon
	b := newReg(t, e, "node-b", 0)
	ctx := context.Background()
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	vb := watchView(t, b)
	vb.until("a/1", has("node-a-sandbox-1"))
	if err := a.Revoke(ctx); err != nil {
		t.Fatal(err)
	}
	vb.until("revoked a/1", hasNot("node-a-sandbox-1"))
}

func TestEtcdRestartLosesNothing(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 3*time.Second)
	b := newReg(t, e, "node-b", 3*time.Second)
	ctx := context.Background()
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	vb := watchView(t, b)
	vb.until("a/1", has("node-a-sandbox-1"))

	e.Stop()
	// A registration made while etcd is away completes once it is back.
	done := make(chan error, 1)
	go func() {
		rctx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		done <- a.Register(rctx, ep("node-a", 2))
	}()
	time.Sleep(4 * time.Second) // longer than the TTL: the lease must survive or be renewed
	e.Start()
	if err := <-done; err != nil {
		t.Fatalf("register across the restart: %v", err)
	}
	if err := a.Register(ctx, ep("node-a", 3)); err != nil {
		t.Fatal(err)
	}
	vb.until("all of a's endpoints after the restart", has("node-a-sandbox-1", "node-a-sandbox-2", "node-a-sandbox-3"))
	// They stay: after a few TTLs the keepalive (or re-registration) holds them.
	time.Sleep(7 * time.Second)
	list, err := b.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 3 {
		t.Fatalf("after the restart etcd holds %d endpoints, want 3: %+v", len(list), list)
	}
}

func TestWatchResumesAfterCompaction(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 0)
	ctx := context.Background()
	for i := range 3 {
		if err := a.Register(ctx, ep("node-a", i)); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := a.cli.Get(ctx, a.prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	// A watcher that delivered this state, then was away while 0 was
	// deleted, 1 changed, 3 added and the history compacted.
	out := make(chan registry.Event, 16)
	w := &watchState{r: a, out: out, known: map[string]int64{}}
	if !w.apply(ctx, resp) {
		t.Fatal("apply failed")
	}
	for range 3 {
		<-out
	}
	if err := a.Deregister(ctx, "node-a-sandbox-0"); err != nil {
		t.Fatal(err)
	}
	changed := ep("node-a", 1)
	changed.Healthy = false
	if err := a.Register(ctx, changed); err != nil {
		t.Fatal(err)
	}
	if err := a.Register(ctx, ep("node-a", 3)); err != nil {
		t.Fatal(err)
	}
	cur, err := a.cli.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.cli.Compact(ctx, cur.Header.Revision); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go a.watchLoop(wctx, w)
	got := map[string]registry.Event{}
	for len(got) < 3 {
		select {
		case ev := <-out:
			if _, dup := got[ev.Key]; dup {
				t.Fatalf("event for %s twice", ev.Key)
			}
			got[ev.Key] = ev
		case <-time.After(60 * time.Second):
			t.Fatalf("after compaction got only %v", got)
		}
	}
	if ev := got["node-a-sandbox-0"]; ev.Type != registry.EventDelete {
		t.Errorf("deleted endpoint: %+v", ev)
	}
	if ev := got["node-a-sandbox-1"]; ev.Type != registry.EventPut || ev.Endpoint.Healthy {
		t.Errorf("changed endpoint: %+v", ev)
	}
	if ev := got["node-a-sandbox-3"]; ev.Type != registry.EventPut {
		t.Errorf("added endpoint: %+v", ev)
	}
	if _, ok := got["node-a-sandbox-2"]; ok {
		t.Error("unchanged endpoint sent again")
	}
	// And the watch goes on from the listed revision.
	if err := a.Register(ctx, ep("node-a", 4)); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-out:
		if ev.Key != "node-a-sandbox-4" || ev.Type != registry.EventPut {
			t.Errorf("next event %+v", ev)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("no event after the relist")
	}
}

func TestOptionsValidation(t *testing.T) {
	for _, o := range []Options{
		{Endpoints: []string{"http://127.0.0.1:1"}},
		{Endpoints: []string{"http://127.0.0.1:1"}, Node: "a/b"},
		{Endpoints: []string{"http://127.0.0.1:1"}, Node: "a", Prefix: "/no-slash"},
		{Endpoints: []string{"http://127.0.0.1:1"}, Node: "a", LeaseTTL: -time.Second},
		{Node: "a"},
		{Endpoints: []string{"http://127.0.0.1:1"}, Node: "a", CAFile: "/nonexistent/ca.pem"},
	} {
		if r, err := New(o); err == nil {
			_ = r.Close()
			t.Errorf("New(%+v) accepted", o)
		}
	}
}
