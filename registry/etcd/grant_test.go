package etcd

import (
	"context"
	"errors"
	"testing"
	"time"

	"aether.io/node/registry/etcd/etcdtest"
)

// TestLeaseGrantDoesNotBlockDeregister: with etcd away, a Register that
// must grant the node's lease waits in Grant until its deadline; meanwhile
// a Deregister gives up at its own, shorter deadline instead of waiting
// behind the grant for the backend's lock.
func TestLeaseGrantDoesNotBlockDeregister(t *testing.T) {
	e := etcdtest.Start(t)
	r := newReg(t, e, "node-a", 0)
	e.Stop()
	regCtx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	regDone := make(chan error, 1)
	go func() { regDone <- r.Register(regCtx, ep("node-a", 1)) }()
	// Register goes to Grant without another etcd round trip; give the
	// goroutine time to get there.
	time.Sleep(300 * time.Millisecond)

	ctx, cancelDereg := context.WithTimeout(context.Background(), time.Second)
	defer cancelDereg()
	done := make(chan error, 1)
	go func() { done <- r.Deregister(ctx, ep("node-a", 2).Key) }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("Deregister with etcd away succeeded")
		}
	case err := <-regDone:
		t.Fatalf("Register returned (%v) before Deregister: the grant was not in flight", err)
	case <-time.After(30 * time.Second):
		t.Fatal("Deregister blocked behind the lease grant in flight")
	}
	select {
	case err := <-regDone:
		t.Fatalf("Register returned (%v) while etcd is away, before its deadline", err)
	default:
	}
}

// TestRegisterDoesNotWaitBehindGrant: with etcd away, a lease grant in
// flight (the keepalive's re-grant after the client gave the lease up, on
// its own long deadline) holds the grant lock; a Register that needs the
// lease gives up at its own, shorter deadline instead of waiting behind
// that grant (regression: AddPod outlived aether-cni's deadline while etcd
// was down for longer than the lease TTL, found by test/multinode all_down).
func TestRegisterDoesNotWaitBehindGrant(t *testing.T) {
	e := etcdtest.Start(t)
	r := newReg(t, e, "node-a", 0)
	e.Stop()
	grantCtx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	grantDone := make(chan error, 1)
	go func() { _, err := r.ensureLease(grantCtx); grantDone <- err }()
	// Give the goroutine time to take the grant lock and reach Grant.
	time.Sleep(300 * time.Millisecond)

	ctx, cancelReg := context.WithTimeout(context.Background(), time.Second)
	defer cancelReg()
	done := make(chan error, 1)
	go func() { done <- r.Register(ctx, ep("node-a", 1)) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Register with etcd away = %v, want its deadline exceeded", err)
		}
	case err := <-grantDone:
		t.Fatalf("the grant returned (%v) before Register: it was not in flight", err)
	case <-time.After(30 * time.Second):
		t.Fatal("Register blocked behind the lease grant in flight")
	}
	select {
	case err := <-grantDone:
		t.Fatalf("the grant returned (%v) while etcd is away, before its deadline", err)
	default:
	}
	if _, ok := r.local[ep("node-a", 1).Key]; ok {
		t.Error("a failed Register left its endpoint for a re-grant to write")
	}
}
