package etcd

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"aether.io/node/registry"
	"aether.io/node/registry/etcd/etcdtest"
)

// lateKV is the registry's KV with a fault: a held write is not sent but
// fails as if its deadline passed, and is applied, exactly as the registry
// built it, when the test releases it. That is what etcd does with a
// request the client gave up on that a member still proposes later (a
// partition that heals, a proposal forwarded to a new leader).
type lateKV struct {
	clientv3.KV
	mu        sync.Mutex
	holdNext  bool
	stallNext bool
	held      []func() error
	interfere func() // run before every write is sent, when set
}

// hold makes the next write late.
func (l *lateKV) hold() {
	l.mu.Lock()
	l.holdNext = true
	l.mu.Unlock()
}

// stall makes the next transaction stalled: sent but not answered (a
// member cut off by a partition, its TCP connection not yet broken). It is
// applied, and answered if its caller still waits, when the test releases
// it; a caller whose context ends first gets the context's error.
func (l *lateKV) stall() {
	l.mu.Lock()
	l.stallNext = true
	l.mu.Unlock()
}

// stalled reports whether a write waits for release.
func (l *lateKV) stalled() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.held) > 0
}

// stallWrite holds commit if the next write is to stall, and then returns
// its result or ctx's error, whichever comes first; ok is false when the
// write does not stall.
func (l *lateKV) stallWrite(ctx context.Context, commit func(context.Context) (*clientv3.TxnResponse, error)) (resp *clientv3.TxnResponse, ok bool, err error) {
	type result struct {
		resp *clientv3.TxnResponse
		err  error
	}
	l.mu.Lock()
	if !l.stallNext {
		l.mu.Unlock()
		return nil, false, nil
	}
	l.stallNext = false
	res := make(chan result, 1)
	l.held = append(l.held, func() error {
		resp, err := commit(context.Background())
		res <- result{resp, err}
		return err
	})
	l.mu.Unlock()
	select {
	case r := <-res:
		return r.resp, true, r.err
	case <-ctx.Done():
		return nil, true, ctx.Err()
	}
}

// write sends apply now, or holds it.
func (l *lateKV) write(apply func(context.Context) error) error {
	l.mu.Lock()
	late, interfere := l.holdNext, l.interfere
	l.holdNext = false
	if late {
		l.held = append(l.held, func() error { return apply(context.Background()) })
	}
	l.mu.Unlock()
	if late {
		return context.DeadlineExceeded
	}
	if interfere != nil {
		interfere()
	}
	return nil
}

// release applies the held writes, in order.
func (l *lateKV) release(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	held := l.held
	l.held = nil
	l.mu.Unlock()
	if len(held) == 0 {
		t.Fatal("no write was held")
	}
	for _, apply := range held {
		if err := apply(); err != nil {
			t.Fatalf("applying a late write: %v", err)
		}
	}
}

func (l *lateKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	if err := l.write(func(ctx context.Context) error { _, err := l.KV.Put(ctx, key, val, opts...); return err }); err != nil {
		return nil, err
	}
	return l.KV.Put(ctx, key, val, opts...)
}

func (l *lateKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	if err := l.write(func(ctx context.Context) error { _, err := l.KV.Delete(ctx, key, opts...); return err }); err != nil {
		return nil, err
	}
	return l.KV.Delete(ctx, key, opts...)
}

func (l *lateKV) Txn(ctx context.Context) clientv3.Txn { return &lateTxn{l: l, ctx: ctx} }

// lateTxn records a transaction and commits it through lateKV.write.
type lateTxn struct {
	l                *lateKV
	ctx              context.Context
	cmps             []clientv3.Cmp
	thenOps, elseOps []clientv3.Op
}

func (t *lateTxn) If(cs ...clientv3.Cmp) clientv3.Txn {
	t.cmps = append(t.cmps, cs...)
	return t
}

func (t *lateTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.thenOps = append(t.thenOps, ops...)
	return t
}

func (t *lateTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.elseOps = append(t.elseOps, ops...)
	return t
}

func (t *lateTxn) commit(ctx context.Context) (*clientv3.TxnResponse, error) {
	return t.l.KV.Txn(ctx).If(t.cmps...).Then(t.thenOps...).Else(t.elseOps...).Commit()
}

func (t *lateTxn) Commit() (*clientv3.TxnResponse, error) {
	if len(t.thenOps) == 0 && len(t.elseOps) == 0 {
		return t.commit(t.ctx) // a read
	}
	if resp, ok, err := t.l.stallWrite(t.ctx, t.commit); ok {
		return resp, err
	}
	if err := t.l.write(func(ctx context.Context) error { _, err := t.commit(ctx); return err }); err != nil {
		return nil, err
	}
	return t.commit(t.ctx)
}

// withLateKV returns node-a's registry on e, its writes going through a
// lateKV, and a plain client on e to look at etcd with.
func withLateKV(t *testing.T, e *etcdtest.Etcd) (*Registry, *lateKV, *clientv3.Client) {
	t.Helper()
	a := newReg(t, e, "node-a", 0)
	l := &lateKV{KV: a.cli.KV}
	a.cli.KV = l
	raw, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = raw.Close() })
	return a, l, raw
}

// inEtcd returns node-a's endpoint key in etcd, read around the registry.
func inEtcd(t *testing.T, raw *clientv3.Client, key string) (registry.Endpoint, bool) {
	t.Helper()
	a := &Registry{prefix: "/test/eps/", node: "node-a", warned: map[string]struct{}{}, log: slog.New(slog.DiscardHandler)}
	resp, err := raw.Get(context.Background(), "/test/eps/node-a/"+key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return registry.Endpoint{}, false
	}
	got, ok := a.decode(resp.Kvs[0])
	if !ok {
		t.Fatalf("etcd holds an undecodable %s", resp.Kvs[0].Value)
	}
	return got, true
}

// TestLateRegisterCannotUndoTheDeregister is the race CI found in
// test/multinode: a Register that timed out on the client is applied by
// etcd after the Deregister that followed it. Without the fence the
// endpoint of a deleted pod comes back and is served until something
// deletes it again.
func TestLateRegisterCannotUndoTheDeregister(t *testing.T) {
	e := etcdtest.Start(t)
	a, l, raw := withLateKV(t, e)
	ctx := context.Background()
	l.hold()
	if err := a.Register(ctx, ep("node-a", 1)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("held Register = %v, want a deadline error", err)
	}
	if err := a.Deregister(ctx, "node-a-sandbox-1"); err != nil {
		t.Fatal(err)
	}
	l.release(t)
	if got, ok := inEtcd(t, raw, "node-a-sandbox-1"); ok {
		t.Fatalf("the late Register wrote the deregistered endpoint back: %+v", got)
	}
	// The same holds for an endpoint that was registered before.
	if err := a.Register(ctx, ep("node-a", 2)); err != nil {
		t.Fatal(err)
	}
	changed := ep("node-a", 2)
	changed.Healthy = false
	l.hold()
	if err := a.Register(ctx, changed); err == nil {
		t.Fatal("held Register succeeded")
	}
	if err := a.Deregister(ctx, "node-a-sandbox-2"); err != nil {
		t.Fatal(err)
	}
	l.release(t)
	if got, ok := inEtcd(t, raw, "node-a-sandbox-2"); ok {
		t.Fatalf("the late Register wrote the deregistered endpoint back: %+v", got)
	}
}

// TestLateRegisterCannotOverwriteALaterOne: a late Register of an older
// value does not replace the value registered after it.
func TestLateRegisterCannotOverwriteALaterOne(t *testing.T) {
	e := etcdtest.Start(t)
	a, l, raw := withLateKV(t, e)
	ctx := context.Background()
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	old := ep("node-a", 1)
	old.Healthy = false
	l.hold()
	if err := a.Register(ctx, old); err == nil {
		t.Fatal("held Register succeeded")
	}
	newer := ep("node-a", 1)
	newer.IPs = []netip.Addr{netip.MustParseAddr("10.0.9.9")}
	if err := a.Register(ctx, newer); err != nil {
		t.Fatal(err)
	}
	l.release(t)
	got, ok := inEtcd(t, raw, "node-a-sandbox-1")
	if !ok || !got.Healthy || got.IPs[0] != newer.IPs[0] {
		t.Fatalf("after the late write etcd holds %+v (present %v), want the later value %+v", got, ok, newer)
	}
}

// TestLateDeregisterCannotDeleteARegistrationAfterIt: a container re-added
// after a DEL whose Deregister timed out keeps its endpoint when etcd
// applies that Deregister late.
func TestLateDeregisterCannotDeleteARegistrationAfterIt(t *testing.T) {
	e := etcdtest.Start(t)
	a, l, raw := withLateKV(t, e)
	ctx := context.Background()
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	l.hold()
	if err := a.Deregister(ctx, "node-a-sandbox-1"); err == nil {
		t.Fatal("held Deregister succeeded")
	}
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	l.release(t)
	if _, ok := inEtcd(t, raw, "node-a-sandbox-1"); !ok {
		t.Fatal("the late Deregister deleted the endpoint registered after it")
	}
}

// TestTombstones: a Deregister leaves a tombstone beside the endpoints (no
// watcher sees it, nothing rejects it); a registration after it, also by a
// restarted agent that does not know the tombstone, removes it; the sweep
// deletes it after the TTL.
func TestTombstones(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 0)
	b := newReg(t, e, "node-b", 0)
	ctx := context.Background()
	v := watchView(t, b)
	v.until("empty initial state", func(map[string]registry.Endpoint) bool { return true })
	tombs := func() map[string]bool {
		t.Helper()
		resp, err := a.cli.Get(ctx, "/test/eps.tombstones/", clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]bool{}
		for _, kv := range resp.Kvs {
			m[string(kv.Key)] = true
		}
		return m
	}
	for i := 1; i <= 2; i++ {
		if err := a.Register(ctx, ep("node-a", i)); err != nil {
			t.Fatal(err)
		}
		if err := a.Deregister(ctx, ep("node-a", i).Key); err != nil {
			t.Fatal(err)
		}
	}
	if got := tombs(); len(got) != 2 || !got["/test/eps.tombstones/node-a/node-a-sandbox-1"] {
		t.Fatalf("tombstones = %v, want node-a-sandbox-1 and -2", got)
	}
	// A restarted agent (no fence known) registers the key again.
	a2 := newReg(t, e, "node-a", 0)
	if err := a2.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatalf("registering a deregistered key again: %v", err)
	}
	if got := tombs(); got["/test/eps.tombstones/node-a/node-a-sandbox-1"] {
		t.Error("the registration did not remove the key's tombstone")
	}
	v.until("a/1 again", has("node-a-sandbox-1"))
	for _, ev := range v.seen {
		if strings.Contains(ev.Key, "tombstones") || ev.Key == "" {
			t.Errorf("the watcher saw %+v", ev)
		}
	}
	if a.Rejected()+b.Rejected() != 0 {
		t.Errorf("rejected %d values", a.Rejected()+b.Rejected())
	}
	// The sweep keeps young tombstones and deletes old ones.
	if n, err := a.sweepOnce(ctx, time.Now()); err != nil || n != 0 {
		t.Fatalf("sweep of young tombstones = %d, %v; want 0", n, err)
	}
	if n, err := a.sweepOnce(ctx, time.Now().Add(DefaultTombstoneTTL+time.Minute)); err != nil || n != 1 {
		t.Fatalf("sweep after the TTL = %d, %v; want 1", n, err)
	}
	if got := tombs(); len(got) != 0 {
		t.Errorf("tombstones after the sweep = %v", got)
	}
	a.mu.Lock()
	_, known := a.fences["node-a-sandbox-2"]
	a.mu.Unlock()
	if known {
		t.Error("the sweep kept the fence of the key whose tombstone it deleted")
	}
	if err := a.Register(ctx, ep("node-a", 2)); err != nil {
		t.Fatalf("registering a swept key again: %v", err)
	}
}

// TestFenceContended: a key that changes under every attempt (another
// agent with the same node name) fails with an error that says so.
func TestFenceContended(t *testing.T) {
	e := etcdtest.Start(t)
	a, l, raw := withLateKV(t, e)
	l.interfere = func() {
		if _, err := raw.Put(context.Background(), "/test/eps/node-a/node-a-sandbox-1", `{}`); err != nil {
			t.Error(err)
		}
	}
	err := a.Register(context.Background(), ep("node-a", 1))
	if !errors.Is(err, errFenceContended) || !strings.Contains(err.Error(), `node name "node-a"`) {
		t.Fatalf("Register under contention = %v, want errFenceContended naming the node", err)
	}
}

// TestTombstoneAlwaysLeased: a Deregister from a node that has no lease
// (it lost it, or restarted and registered nothing yet) grants one for the
// tombstone, so a node that never comes back leaves no tombstone behind.
func TestTombstoneAlwaysLeased(t *testing.T) {
	e := etcdtest.Start(t)
	ctx := context.Background()
	tombLease := func(r *Registry, key string) clientv3.LeaseID {
		t.Helper()
		resp, err := r.cli.Get(ctx, r.tombKey(key))
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) != 1 {
			t.Fatalf("no tombstone for %s", key)
		}
		return clientv3.LeaseID(resp.Kvs[0].Lease)
	}
	a := newReg(t, e, "node-a", 0)
	k1, k2 := ep("node-a", 1).Key, ep("node-a", 2).Key
	for i := 1; i <= 2; i++ {
		if err := a.Register(ctx, ep("node-a", i)); err != nil {
			t.Fatal(err)
		}
	}
	// The lease expires behind the registry's back.
	old := a.currentLease()
	if _, err := a.cli.Revoke(ctx, old); err != nil {
		t.Fatal(err)
	}
	if err := a.Deregister(ctx, k1); err != nil {
		t.Fatalf("deregistering after the lease expired: %v", err)
	}
	if l := tombLease(a, k1); l == 0 || l == old {
		t.Errorf("tombstone lease = %x, want a new lease (old %x)", int64(l), int64(old))
	}
	// A restarted agent deregisters before registering anything.
	a2 := newReg(t, e, "node-a", 0)
	if a2.currentLease() != 0 {
		t.Fatal("a new registry already has a lease")
	}
	if err := a2.Deregister(ctx, k2); err != nil {
		t.Fatal(err)
	}
	l := tombLease(a2, k2)
	if l == 0 || l != a2.currentLease() {
		t.Fatalf("tombstone lease = %x, want the node's lease %x", int64(l), int64(a2.currentLease()))
	}
	// The node never comes back: its tombstones go with its lease.
	if _, err := a2.cli.Revoke(ctx, l); err != nil {
		t.Fatal(err)
	}
	resp, err := a2.cli.Get(ctx, a2.tombKey(k2))
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("tombstone after its lease ended: %v, %v", resp.Kvs, err)
	}
}

// TestDeregisterDoesNotWaitOutAStalledPut is the race test/multinode
// partition_leader found: the lease was lost, and the re-registration's
// put went to the partitioned leader, where it stalled (sent, not
// answered) holding the key's write mark; the pod turned terminating, and
// its Deregister waited behind that mark until its deadline and sent
// nothing; the partition healed, the stalled put was applied (HEALTHY)
// and every other agent served the terminating pod again until the retry
// of the Deregister deleted it. Withdraw now cancels the stalled put: the
// Deregister sends its fenced delete at once, and the put, applied later,
// finds the fence changed and does nothing. The same holds for a
// Register in flight (the agent's own registration of the pod).
func TestDeregisterDoesNotWaitOutAStalledPut(t *testing.T) {
	for _, tc := range []struct {
		name string
		put  func(r *Registry, key string) error
	}{
		{"re-registration after a lease loss", func(r *Registry, key string) error {
			return r.reRegisterKey(context.Background(), key, r.currentLease())
		}},
		{"Register", func(r *Registry, key string) error {
			return r.Register(context.Background(), ep("node-a", 1))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := etcdtest.Start(t)
			a, l, raw := withLateKV(t, e)
			ctx := context.Background()
			key := ep("node-a", 1).Key
			if err := a.Register(ctx, ep("node-a", 1)); err != nil {
				t.Fatal(err)
			}
			l.stall()
			putDone := make(chan error, 1)
			go func() { putDone <- tc.put(a, key) }()
			for !l.stalled() {
				time.Sleep(time.Millisecond)
			}
			// The pod turns terminating (agent/pods MarkTerminating:
			// Withdraw, then Deregister with its write budget). The
			// budget only bounds a wait that must not happen: with
			// the put stalled for good, a Deregister that waits for
			// it fails at this deadline.
			a.Withdraw(key)
			dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			err := a.Deregister(dctx, key)
			cancel()
			if err != nil {
				t.Errorf("Deregister behind the stalled put: %v", err)
			}
			if got, ok := inEtcd(t, raw, key); ok {
				t.Errorf("after the Deregister etcd holds %+v", got)
			}
			// The partition heals: etcd applies the stalled put.
			l.release(t)
			<-putDone
			if got, ok := inEtcd(t, raw, key); ok {
				t.Fatalf("the stalled put landed after the Deregister: etcd holds %+v", got)
			}
			a.mu.Lock()
			_, local := a.local[key]
			a.mu.Unlock()
			if local {
				t.Error("the withdrawn key is back among the endpoints a lease re-grant writes")
			}
		})
	}
}
