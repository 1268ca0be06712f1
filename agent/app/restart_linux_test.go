package app

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"aether.io/node/agent/pods"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	"aether.io/node/registry/etcd/etcdtest"
	"aether.io/node/xds/workload"
	"aether.io/node/xds/workload/client"
)

// TestRestartKeepsLocalWorkloadsOverEtcd restarts an agent (--registry=etcd)
// whose store holds two live pods, on an etcd that holds other nodes' pods
// and this node's keys as the previous run left them. The pods replayed from
// the store are served from the first xDS response on, and the follower's
// first sync of the remote nodes never removes them: local and remote
// workloads cannot erase each other in the shared index.
func TestRestartKeepsLocalWorkloadsOverEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	ctx := context.Background()
	c := testConfig(t, "--registry", "etcd", "--etcd-endpoints", e.Endpoint(), "--etcd-insecure")
	manifests := filepath.Join(filepath.Dir(c.StateDir), "manifests")
	netns := filepath.Join(t.TempDir(), "netns")
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}

	// The previous run's records, and their keys in etcd (its lease is alive).
	st, err := store.Open(c.StateDir, store.Options{NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	prev, err := etcdreg.New(etcdreg.Options{Endpoints: []string{e.Endpoint()}, Node: c.NodeName, Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	var local []string
	for i := range 2 {
		name, uid := fmt.Sprintf("local-%d", i), fmt.Sprintf("uid-local-%d", i)
		ip := fmt.Sprintf("10.1.0.%d", i+1)
		rec := &store.Record{Node: c.NodeName, AddedAt: time.Now().UTC(), Pod: &cniv1.CNIPod{
			ContainerId: fmt.Sprintf("sb-local-%d", i), Namespace: "shop", Name: name, Uid: uid,
			NetworkNamespace: netns, Ips: []string{ip}, Labels: map[string]string{pods.ManagedLabel: "true"},
		}}
		if err := st.Put(ctx, rec); err != nil {
			t.Fatal(err)
		}
		writeManifestFile(t, manifests, name, uid, c.NodeName)
		if err := prev.Register(ctx, registry.Endpoint{
			Key: rec.Key(), Node: c.NodeName, Namespace: "shop", Name: name, UID: uid,
			IPs: []netip.Addr{netip.MustParseAddr(ip)}, Labels: rec.Pod.Labels, Healthy: true,
		}); err != nil {
			t.Fatal(err)
		}
		local = append(local, workload.UID(c.ClusterID, "shop", name))
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	_ = prev.Close() // the lease is left to expire, as a killed agent's

	// Another node's pods.
	remote, err := etcdreg.New(etcdreg.Options{Endpoints: []string{e.Endpoint()}, Node: "n2", Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = remote.Close() })
	remoteEP := func(i int) registry.Endpoint {
		return registry.Endpoint{
			Key: fmt.Sprintf("sb-remote-%d", i), Node: "n2", Namespace: "shop", Name: fmt.Sprintf("remote-%d", i),
			IPs: []netip.Addr{netip.AddrFrom4([4]byte{10, 2, 0, byte(i + 1)})}, Healthy: true,
		}
	}
	for i := range 3 {
		if err := remote.Register(ctx, remoteEP(i)); err != nil {
			t.Fatal(err)
		}
	}

	runCtx, done := runAgent(t, c)
	for !dialable(c.XDSSocket) {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("Run returned before serving xDS: %v", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	cctx, ccancel := context.WithCancel(runCtx)
	t.Cleanup(ccancel)
	xc, err := client.Dial(cctx, client.Options{Socket: c.XDSSocket, NodeID: "test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = xc.Close() })

	isLocal := map[string]bool{local[0]: true, local[1]: true}
	first := true
	// recvUntil reads responses until uid is served, failing at once if a
	// local workload is ever removed or missing from the first response.
	recvUntil := func(uid string) {
		t.Helper()
		for {
			up, err := recvWithin(xc, 90*time.Second)
			if err != nil {
				t.Fatalf("waiting for %s: %v", uid, err)
			}
			for _, r := range up.Removed {
				if isLocal[r] {
					t.Fatalf("local workload %s removed from this node's xDS", r)
				}
			}
			held := map[string]bool{}
			for _, w := range xc.Workloads() {
				held[w.GetUid()] = true
			}
			if first {
				first = false
				for _, l := range local {
					if !held[l] {
						t.Fatalf("first xDS response lacks the replayed local workload %s", l)
					}
				}
			}
			if held[uid] {
				return
			}
		}
	}
	recvUntil(workload.UID(c.ClusterID, "shop", "remote-2"))
	// A change registered now flows through the follower's watch, so the
	// first sync (its reconcile) is over once it is served.
	if err := remote.Register(ctx, remoteEP(9)); err != nil {
		t.Fatal(err)
	}
	recvUntil(workload.UID(c.ClusterID, "shop", "remote-9"))
	held := map[string]bool{}
	for _, w := range xc.Workloads() {
		held[w.GetUid()] = true
	}
	for _, l := range local {
		if !held[l] {
			t.Errorf("local workload %s not served after the follower's first sync", l)
		}
	}
}

// recvWithin is one Recv, bounded so that a missing response fails the
// test instead of hanging it (a liveness bound, not a timing assertion).
func recvWithin(c *client.Client, d time.Duration) (*client.Update, error) {
	type result struct {
		up  *client.Update
		err error
	}
	ch := make(chan result, 1)
	go func() {
		up, err := c.Recv()
		ch <- result{up, err}
	}()
	select {
	case r := <-ch:
		return r.up, r.err
	case <-time.After(d):
		return nil, fmt.Errorf("no xDS response within %s", d)
	}
}

// writeManifestFile writes a managed Pod manifest for the manifests source.
func writeManifestFile(t *testing.T, dir, name, uid, node string) {
	t.Helper()
	body := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: %s
  namespace: shop
  uid: %s
  labels:
    aether.io/managed: "true"
spec:
  nodeName: %s
  containers:
  - name: c
    image: pause
`, name, uid, node)
	if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
}

// dialable reports whether a unix socket answers.
func dialable(path string) bool {
	c, err := net.Dial("unix", path)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}
