package etcd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"aether.io/node/registry"
	"aether.io/node/registry/etcd/etcdtest"
)

func TestTransportPolicy(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    Options
		want error // nil: accepted
	}{
		{"http without insecure", Options{Endpoints: []string{"http://10.0.0.1:2379"}}, ErrPlaintext},
		{"http with ca", Options{Endpoints: []string{"http://10.0.0.1:2379"}, CAFile: "/etc/ca.pem"}, ErrTLSOverHTTP},
		{"http with ca and insecure", Options{Endpoints: []string{"http://10.0.0.1:2379"}, CAFile: "/etc/ca.pem", Insecure: true}, ErrTLSOverHTTP},
		{"HTTP with client cert", Options{Endpoints: []string{"HTTP://10.0.0.1:2379"}, CertFile: "c.pem", KeyFile: "k.pem", Insecure: true}, ErrTLSOverHTTP},
		{"second endpoint http with ca", Options{Endpoints: []string{"https://10.0.0.1:2379", "http://10.0.0.2:2379"}, CAFile: "/etc/ca.pem"}, ErrTLSOverHTTP},
		{"https without tls material", Options{Endpoints: []string{"https://10.0.0.1:2379"}}, ErrPlaintext},
		{"unix without tls material", Options{Endpoints: []string{"unix:///run/etcd.sock"}}, ErrPlaintext},
		{"bare host without tls material", Options{Endpoints: []string{"10.0.0.1:2379"}}, ErrPlaintext},
		{"http with insecure", Options{Endpoints: []string{"http://10.0.0.1:2379"}, Insecure: true}, nil},
		{"unix with insecure", Options{Endpoints: []string{"unix:///run/etcd.sock"}, Insecure: true}, nil},
		{"https with ca", Options{Endpoints: []string{"https://10.0.0.1:2379"}, CAFile: "/etc/ca.pem"}, nil},
		{"https with client cert", Options{Endpoints: []string{"https://10.0.0.1:2379"}, CertFile: "c.pem", KeyFile: "k.pem"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.o.CheckTransport()
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Fatalf("CheckTransport() = %v, want %v", err, tc.want)
			}
			if err == nil {
				return
			}
			if !strings.Contains(err.Error(), "10.0.0.") && !strings.Contains(err.Error(), "etcd.sock") {
				t.Errorf("error %q does not name the endpoint", err)
			}
			// New refuses the same options, before reading any file.
			o := tc.o
			o.Node = "node-a"
			r, nerr := New(o)
			if nerr == nil {
				_ = r.Close()
				t.Fatalf("New(%+v) accepted", o)
			}
			if !errors.Is(nerr, tc.want) {
				t.Errorf("New error %v, want %v", nerr, tc.want)
			}
		})
	}
}

// put writes a raw value under the registry's prefix, as another (possibly
// hostile) writer would.
func put(t *testing.T, r *Registry, etcdKey string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.cli.Put(context.Background(), r.prefix+etcdKey, string(b)); err != nil {
		t.Fatal(err)
	}
}

func TestKeyAndNodeComeFromTheEtcdKey(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 0)
	b := newReg(t, e, "node-b", 0)
	ctx := context.Background()
	if err := a.Register(ctx, ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	vb := watchView(t, b)
	vb.until("a/1", has("node-a-sandbox-1"))

	// Node b's writer claims a's endpoint key and node from its own path.
	spoof := ep("node-a", 1)
	spoof.IPs = ep("node-b", 66).IPs
	put(t, b, "node-b/evil", spoof)
	// A value without key and node takes both from the path.
	bare := ep("node-b", 2)
	bare.Key, bare.Node = "", ""
	put(t, b, "node-b/node-b-sandbox-2", bare)
	vb.until("b/2", has("node-b-sandbox-2"))
	if got := vb.eps["node-b-sandbox-2"]; got.Node != "node-b" || got.Key != "node-b-sandbox-2" {
		t.Errorf("bare value = key %q node %q, want both from the etcd key", got.Key, got.Node)
	}
	if got := vb.eps["node-a-sandbox-1"]; got.IPs[0] != ep("node-a", 1).IPs[0] {
		t.Errorf("spoofed value took over a/1: %+v", got)
	}
	if _, ok := vb.eps["evil"]; ok {
		t.Error("spoofed value delivered under its path key")
	}
	for _, ev := range vb.seen {
		if ev.Type == registry.EventPut && ev.Endpoint.IPs[0] == spoof.IPs[0] {
			t.Errorf("spoofed value delivered: %+v", ev)
		}
	}
	list, err := b.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, got := range list {
		if got.IPs[0] == spoof.IPs[0] {
			t.Errorf("List returned the spoofed value: %+v", got)
		}
	}
	if len(list) != 2 {
		t.Errorf("List = %d endpoints, want 2: %+v", len(list), list)
	}

	// A delivered endpoint overwritten with a value naming another node is
	// deleted, not left stale.
	moved := ep("node-b", 2)
	moved.Node = "node-a"
	put(t, b, "node-b/node-b-sandbox-2", moved)
	vb.until("b/2 deleted after a mismatching overwrite", hasNot("node-b-sandbox-2"))
	if _, ok := vb.eps["node-a-sandbox-1"]; !ok {
		t.Error("a/1 lost")
	}
}

func TestRejectedValuesCountedAndLoggedOncePerKey(t *testing.T) {
	e := etcdtest.Start(t)
	// Only this goroutine logs here: no watch runs, and the keepalive loop
	// logs only when a lease is lost.
	var logs bytes.Buffer
	r, err := New(Options{
		Endpoints: []string{e.Endpoint()}, Node: "node-a", Prefix: "/test/eps/", Insecure: true,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	ctx := context.Background()
	put(t, r, "node-b/evil", ep("node-a", 1))                // key and node mismatch
	put(t, r, "node-b/node-b-sandbox-3", ep("node-c", 3))    // key and node mismatch
	put(t, r, "no-node-segment", ep("node-b", 4))            // outside the layout
	if err := r.Register(ctx, ep("node-a", 5)); err != nil { // the only valid one
		t.Fatal(err)
	}
	for range 3 {
		list, err := r.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(list) != 1 || list[0].Key != "node-a-sandbox-5" {
			t.Fatalf("List = %+v, want only node-a-sandbox-5", list)
		}
	}
	if got := r.Rejected(); got != 9 {
		t.Errorf("Rejected() = %d after 3 lists of 3 rejected values, want 9", got)
	}
	out := logs.String()
	for _, k := range []string{"/test/eps/node-b/evil", "/test/eps/node-b/node-b-sandbox-3", "/test/eps/no-node-segment"} {
		if n := strings.Count(out, "etcd_key="+k+" "); n != 1 {
			t.Errorf("%s logged %d times, want once:\n%s", k, n, out)
		}
	}
	if n := strings.Count(out, "level=WARN"); n != 3 {
		t.Errorf("%d WARN records, want 3:\n%s", n, out)
	}
}

func TestListNodeReadsOnlyThisNode(t *testing.T) {
	e := etcdtest.Start(t)
	a := newReg(t, e, "node-a", 0)
	b := newReg(t, e, "node-b", 0)
	// A node whose name is a prefix of another's must not see it.
	ab := newReg(t, e, "node-a-b", 0)
	ctx := context.Background()
	for i, r := range []*Registry{a, b, ab} {
		if err := r.Register(ctx, ep(r.node, i)); err != nil {
			t.Fatal(err)
		}
	}
	got, err := a.ListNode(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].Key != "node-a-sandbox-0" || got[0].Node != "node-a" {
		t.Errorf("ListNode = %+v, want only node-a-sandbox-0", got)
	}
}

// etcdKeys returns the endpoint keys etcd holds for r's node.
func etcdKeys(t *testing.T, r *Registry) map[string]registry.Endpoint {
	t.Helper()
	eps, err := r.ListNode(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]registry.Endpoint{}
	for _, e := range eps {
		m[e.Key] = e
	}
	return m
}

// regrant revokes r's lease behind its back and runs what the keepalive
// loop runs when it sees the lease gone: a new lease and every local
// endpoint written again.
func regrant(t *testing.T, r *Registry) {
	t.Helper()
	r.mu.Lock()
	lease := r.lease
	r.mu.Unlock()
	if _, err := r.cli.Revoke(context.Background(), lease); err != nil {
		t.Fatal(err)
	}
	r.leaseLost(lease)
	if err := r.reRegister(); err != nil {
		t.Fatal(err)
	}
}

// registeredWithFailingCtx returns node-a's registry holding a/1, and a
// context every etcd call fails with.
func registeredWithFailingCtx(t *testing.T) (*Registry, context.Context) {
	t.Helper()
	a := newReg(t, etcdtest.Start(t), "node-a", 0)
	if err := a.Register(context.Background(), ep("node-a", 1)); err != nil {
		t.Fatal(err)
	}
	failed, cancel := context.WithCancel(context.Background())
	cancel()
	return a, failed
}

func TestFailedRegisterIsNotWrittenBackByARegrant(t *testing.T) {
	a, failed := registeredWithFailingCtx(t)
	// A new endpoint whose Register fails, and a change of a registered one
	// whose Register fails.
	if err := a.Register(failed, ep("node-a", 2)); err == nil {
		t.Fatal("Register with a cancelled context succeeded")
	}
	changed := ep("node-a", 1)
	changed.Healthy = false
	if err := a.Register(failed, changed); err == nil {
		t.Fatal("Register with a cancelled context succeeded")
	}
	regrant(t, a)
	got := etcdKeys(t, a)
	if _, ok := got["node-a-sandbox-2"]; ok {
		t.Error("the lease re-grant wrote an endpoint whose Register failed")
	}
	if e1, ok := got["node-a-sandbox-1"]; !ok || !e1.Healthy {
		t.Errorf("after the re-grant a/1 = %+v (present %v), want the last registered value (healthy)", e1, ok)
	}
}

func TestDeregisterForgetsEvenIfTheDeleteFails(t *testing.T) {
	a, failed := registeredWithFailingCtx(t)
	if err := a.Deregister(failed, "node-a-sandbox-1"); err == nil {
		t.Fatal("Deregister with a cancelled context succeeded")
	}
	// The revoke deletes the value the failed delete left; the re-grant must
	// not write it back.
	regrant(t, a)
	if got := etcdKeys(t, a); len(got) != 0 {
		t.Errorf("after the re-grant etcd holds %v, want nothing", got)
	}
}
