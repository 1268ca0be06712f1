package etcd

import (
	"context"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"aether.io/node/registry/etcd/etcdtest"
)

// stored reports whether etcd holds endpoint key of r's node.
func stored(t *testing.T, r *Registry, key string) bool {
	t.Helper()
	resp, err := r.cli.Get(context.Background(), r.key(key))
	if err != nil {
		t.Fatal(err)
	}
	return len(resp.Kvs) == 1
}

// TestWithdrawnKeyNotWrittenBackByRegrant: a key withdrawn (its pod turned
// terminating, its Deregister not yet run) is not put back when the lease
// is lost and re-granted; the node's other endpoints are (regression: a
// terminating pod came back on the other nodes after its agent's lease
// expired, found by test/multinode compaction_during_watch_outage).
func TestWithdrawnKeyNotWrittenBackByRegrant(t *testing.T) {
	e := etcdtest.Start(t)
	r := newReg(t, e, "node-a", 0)
	ctx := context.Background()
	gone, kept := ep("node-a", 1), ep("node-a", 2)
	if err := r.Register(ctx, gone); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(ctx, kept); err != nil {
		t.Fatal(err)
	}
	r.Withdraw(gone.Key)

	// Another client revokes the lease: both keys go, the keepalive ends,
	// and the registry grants a new lease and registers again.
	old := r.currentLease()
	admin, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint()}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	if _, err := admin.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(90 * time.Second)
	for lease := r.currentLease(); lease == 0 || lease == old || !stored(t, r, kept.Key); lease = r.currentLease() {
		if time.Now().After(deadline) {
			t.Fatalf("endpoint %s not registered again with a new lease within 90s", kept.Key)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if stored(t, r, gone.Key) {
		t.Errorf("the lease re-grant wrote back withdrawn endpoint %s", gone.Key)
	}
}

// TestWithdrawStopsRegisterInFlight: a Register waiting for the lease
// grant when its key is withdrawn writes nothing once the grant is done
// and says so.
func TestWithdrawStopsRegisterInFlight(t *testing.T) {
	e := etcdtest.Start(t)
	r := newReg(t, e, "node-a", 0)
	ctx := context.Background()
	if err := r.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	// The lease is gone as far as the registry knows, and a grant is in
	// flight (the test holds the grant lock): the next Register waits.
	r.leaseLost(r.currentLease())
	if err := r.lockGrant(ctx); err != nil {
		t.Fatal(err)
	}
	held := true
	defer func() {
		if held {
			r.unlockGrant()
		}
	}()
	inFlight := ep("node-a", 2)
	done := make(chan error, 1)
	go func() { done <- r.Register(ctx, inFlight) }()
	deadline := time.Now().Add(90 * time.Second)
	for {
		r.mu.Lock()
		_, entered := r.local[inFlight.Key]
		r.mu.Unlock()
		if entered {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("Register never reached its write")
		}
		time.Sleep(time.Millisecond)
	}
	r.Withdraw(inFlight.Key)
	r.unlockGrant()
	held = false
	select {
	case err := <-done:
		if !errors.Is(err, errWithdrawn) {
			t.Errorf("Register of a key withdrawn in flight = %v, want errWithdrawn", err)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("Register did not return after the grant")
	}
	if stored(t, r, inFlight.Key) {
		t.Errorf("endpoint %s withdrawn while its Register waited for the lease was written", inFlight.Key)
	}
}
