package etcd

import (
	"context"
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
