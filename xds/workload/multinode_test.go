package workload

import (
	"context"
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/pkg/unixsock"
	"aether.io/node/registry"
	etcdreg "aether.io/node/registry/etcd"
	"aether.io/node/registry/etcd/etcdtest"
	"aether.io/node/xds/workload/client"
)

// agentNode is one node's share of the stack: its etcd registry client,
// follower, index and xDS server on its own unix socket.
type agentNode struct {
	name   string
	cli    *clientv3.Client
	reg    *etcdreg.Registry
	socket string
}

func startAgentNode(t *testing.T, e *etcdtest.Etcd, name string, ttl time.Duration) *agentNode {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint()}, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	reg, err := etcdreg.NewWithClient(cli, etcdreg.Options{Node: name, LeaseTTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	x := NewIndex()
	srv, err := NewServer(x, ServerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := NewFollower(reg, testConfig, x, nil)
	go func() { _ = f.Run(ctx) }()
	socket := filepath.Join(t.TempDir(), "run", "xds.sock")
	lis, err := unixsock.Listen(socket)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(ServerGRPCOptions(0)...)
	srv.Register(g)
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(func() {
		g.Stop()
		cancel()
		_ = reg.Close()
		_ = cli.Close()
	})
	return &agentNode{name: name, cli: cli, reg: reg, socket: socket}
}

// podOn is the endpoint of pod i on node.
func podOn(node string, i int) registry.Endpoint {
	return registry.Endpoint{
		Key: fmt.Sprintf("%s-sb-%d", node, i), Node: node, Namespace: "shop", Name: fmt.Sprintf("%s-web-%d", node, i),
		IPs:     []netip.Addr{netip.MustParseAddr(fmt.Sprintf("10.%d.0.%d", len(node), i)), netip.MustParseAddr(fmt.Sprintf("fd00::%d:%d", len(node), i))},
		Owner:   &registry.Owner{Kind: "ReplicaSet", Name: "web-5c6d7f8b9"},
		Labels:  map[string]string{"pod-template-hash": "5c6d7f8b9"},
		Healthy: true, ServiceAccount: "web",
	}
}

// xdsView is a delta xDS client (ours) following a node's server.
type xdsView struct {
	t *testing.T
	c *client.Client
}

func watchXDS(t *testing.T, socket string) *xdsView {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c, err := client.Dial(ctx, client.Options{Socket: socket, NodeID: "test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = c.Close() })
	if _, err := c.Recv(); err != nil {
		t.Fatal(err)
	}
	return &xdsView{t: t, c: c}
}

// until receives responses until cond holds; bounded generously, never a
// timing assertion.
func (v *xdsView) until(what string, cond func(map[string]*workloadpb.Workload) bool) {
	v.t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		m := map[string]*workloadpb.Workload{}
		for _, w := range v.c.Workloads() {
			m[w.GetUid()] = w
		}
		if cond(m) {
			return
		}
		if time.Now().After(deadline) {
			v.t.Fatalf("no %s within 90s; client holds %d workloads", what, len(m))
		}
		done := make(chan error, 1)
		go func() { _, err := v.c.Recv(); done <- err }()
		select {
		case err := <-done:
			if err != nil {
				v.t.Fatal(err)
			}
		case <-time.After(time.Until(deadline)):
			v.t.Fatalf("no %s within 90s", what)
		}
	}
}

func uidOf(ep registry.Endpoint) string { return UID(testConfig.ClusterID, ep.Namespace, ep.Name) }

func present(eps ...registry.Endpoint) func(map[string]*workloadpb.Workload) bool {
	return func(m map[string]*workloadpb.Workload) bool {
		for _, ep := range eps {
			if _, ok := m[uidOf(ep)]; !ok {
				return false
			}
		}
		return true
	}
}

func absent(eps ...registry.Endpoint) func(map[string]*workloadpb.Workload) bool {
	return func(m map[string]*workloadpb.Workload) bool {
		for _, ep := range eps {
			if _, ok := m[uidOf(ep)]; ok {
				return false
			}
		}
		return true
	}
}

func TestMultiNodeOverEtcd(t *testing.T) {
	e := etcdtest.Start(t)
	a := startAgentNode(t, e, "node-a", 2*time.Second)
	b := startAgentNode(t, e, "node-b", 2*time.Second)
	c := startAgentNode(t, e, "node-c", 2*time.Second)
	ctx := context.Background()
	vb := watchXDS(t, b.socket)
	vc := watchXDS(t, c.socket)

	// A pod registered on A appears in B's and C's xDS, addresses as raw bytes.
	pa := podOn("node-a", 1)
	if err := a.reg.Register(ctx, pa); err != nil {
		t.Fatal(err)
	}
	vb.until("A's pod on B", present(pa))
	w := vb.c.Workloads()[0]
	if w.GetNode() != "node-a" || w.GetWorkloadType() != workloadpb.WorkloadType_DEPLOYMENT || w.GetWorkloadName() != "web" {
		t.Errorf("B serves %v", w)
	}
	for i, addr := range w.GetAddresses() {
		if got, _ := netip.AddrFromSlice(addr); got != pa.IPs[i] {
			t.Errorf("address %d = %x, want raw %v", i, addr, pa.IPs[i])
		}
	}
	vc.until("A's pod on C", present(pa))

	// Terminating on A → UNHEALTHY on B, then removed at deregistration.
	term := pa
	term.Healthy = false
	if err := a.reg.Register(ctx, term); err != nil {
		t.Fatal(err)
	}
	vb.until("UNHEALTHY on B", func(m map[string]*workloadpb.Workload) bool {
		return m[uidOf(pa)].GetStatus() == workloadpb.WorkloadStatus_UNHEALTHY
	})
	if err := a.reg.Deregister(ctx, pa.Key); err != nil {
		t.Fatal(err)
	}
	vb.until("removal on B", absent(pa))

	// Restart etcd mid-test: nothing registered is lost, and changes made
	// after it returns flow again.
	pb := podOn("node-b", 2)
	pa3 := podOn("node-a", 3)
	if err := b.reg.Register(ctx, pb); err != nil {
		t.Fatal(err)
	}
	if err := a.reg.Register(ctx, pa3); err != nil {
		t.Fatal(err)
	}
	vc.until("B's and A's pods on C", present(pb, pa3))
	e.Stop()
	e.Start()
	pc := podOn("node-c", 4)
	if err := c.reg.Register(ctx, pc); err != nil {
		t.Fatal(err)
	}
	vb.until("all pods on B after the restart", present(pb, pa3, pc))
	vc.until("all pods on C after the restart", present(pb, pa3, pc))

	// Kill A without a clean shutdown: its client goes away, its lease is
	// not revoked; its workloads disappear when the lease expires.
	_ = a.cli.Close()
	vb.until("A's pods to expire on B", absent(pa3))
	vc.until("A's pods to expire on C", absent(pa3))
	vb.until("B's and C's pods to stay", present(pb, pc))
}
