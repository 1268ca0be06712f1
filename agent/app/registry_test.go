package app

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	"aether.io/node/registry/etcd/etcdtest"
	"aether.io/node/registry/local"
)

// recorder is a registry that records which listing the view used and
// whether its context had a deadline.
type recorder struct {
	registry.Registry
	called   string
	deadline time.Duration // time left at the call; 0 = none
}

func (r *recorder) note(ctx context.Context, what string) {
	r.called = what
	if d, ok := ctx.Deadline(); ok {
		r.deadline = time.Until(d)
	}
}

func (r *recorder) List(ctx context.Context) ([]registry.Endpoint, error) {
	r.note(ctx, "List")
	return nil, nil
}

// nodeRecorder can list one node.
type nodeRecorder struct{ recorder }

func (r *nodeRecorder) ListNode(ctx context.Context) ([]registry.Endpoint, error) {
	r.note(ctx, "ListNode")
	return nil, nil
}

func TestLivenessViewListsThisNodeWithADeadline(t *testing.T) {
	for _, tc := range []struct {
		name         string
		interval     time.Duration
		node         bool
		wantCall     string
		wantDeadline time.Duration
	}{
		{"node lister", 5 * time.Second, true, "ListNode", 5 * time.Second},
		{"plain backend", 5 * time.Second, false, "List", 5 * time.Second},
		{"short interval gets the floor", 10 * time.Millisecond, true, "ListNode", minLivenessListTimeout},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rec *recorder
			var backend registry.Registry
			if tc.node {
				n := &nodeRecorder{}
				rec, backend = &n.recorder, n
			} else {
				rec = &recorder{}
				backend = rec
			}
			if _, err := livenessView(backend, tc.interval).List(context.Background()); err != nil {
				t.Fatal(err)
			}
			if rec.called != tc.wantCall {
				t.Errorf("List went to %q, want %q", rec.called, tc.wantCall)
			}
			if rec.deadline <= 0 || rec.deadline > tc.wantDeadline {
				t.Errorf("List context had %v left, want a deadline within %v", rec.deadline, tc.wantDeadline)
			}
		})
	}
}

func TestLivenessViewKeepsRegisterAndDeregister(t *testing.T) {
	reg := local.New()
	v := livenessView(reg, time.Second)
	ctx := context.Background()
	ep := registry.Endpoint{Key: "sb-1", Node: "n1", Name: "p", IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}
	if err := v.Register(ctx, ep); err != nil {
		t.Fatal(err)
	}
	if got, err := v.List(ctx); err != nil || len(got) != 1 || got[0].Key != "sb-1" {
		t.Fatalf("List after Register = %+v, %v", got, err)
	}
	if err := v.Deregister(ctx, "sb-1"); err != nil {
		t.Fatal(err)
	}
	if got, err := reg.List(ctx); err != nil || len(got) != 0 {
		t.Fatalf("backend after Deregister = %+v, %v", got, err)
	}
}

// TestLivenessViewOverEtcd: liveness reads this node's endpoints only, and
// gives up at its deadline when etcd is away instead of waiting for it.
func TestLivenessViewOverEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	regs := map[string]*etcdreg.Registry{}
	ctx := context.Background()
	for i, node := range []string{"node-a", "node-b"} {
		r, err := etcdreg.New(etcdreg.Options{Endpoints: []string{e.Endpoint()}, Node: node, Prefix: "/test/eps/", Insecure: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Close() })
		regs[node] = r
		ep := registry.Endpoint{Key: node + "-sb", Node: node, Name: "p", IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)})}}
		if err := r.Register(ctx, ep); err != nil {
			t.Fatal(err)
		}
	}
	v := livenessView(regs["node-a"], time.Second)
	got, err := v.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Key != "node-a-sb" {
		t.Errorf("liveness List = %+v, want node-a's endpoint only", got)
	}

	e.Stop()
	done := make(chan error, 1)
	go func() {
		_, err := v.List(ctx)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("liveness List with etcd away = %v, want the deadline exceeded", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("liveness List with etcd away did not return within 60s: no deadline")
	}
}
