package node_test

import (
	"context"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/meshcni/e2e/agentproc"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/test/harness"
	"aether.io/node/xds/listener"
	"aether.io/node/xds/resource"
	workloadclient "aether.io/node/xds/workload/client"
)

func TestMain(m *testing.M) { harness.Main(m) }

// eventually polls cond until it holds or a generous bound passes; the bound
// only stops a hung test, it asserts nothing about speed.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// writePod writes a Pod manifest into the agent's pod source; a non-empty
// deletionTimestamp marks it terminating; annotations may be nil.
func writePod(t *testing.T, a *agentproc.Agent, ns, name, uid, deletionTimestamp string, annotations map[string]string) {
	t.Helper()
	meta := map[string]any{
		// A Deployment's pod as the ReplicaSet controller makes it: a
		// generated name and the pod-template-hash label.
		"name": name, "namespace": ns, "uid": uid, "generateName": "web-7d9f8c6b5-",
		"labels": map[string]string{
			"aether.io/managed": "true", "app.kubernetes.io/name": "web", "app.kubernetes.io/version": "v2", "pod-template-hash": "7d9f8c6b5",
		},
		"ownerReferences": []map[string]any{{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8c6b5", "uid": "rs-1", "controller": true}},
	}
	if deletionTimestamp != "" {
		meta["deletionTimestamp"] = deletionTimestamp
	}
	if annotations != nil {
		meta["annotations"] = annotations
	}
	doc := map[string]any{
		"apiVersion": "v1", "kind": "Pod", "metadata": meta,
		"spec": map[string]any{
			"nodeName": agentproc.NodeName, "serviceAccountName": "web-sa",
			"containers": []map[string]any{{"name": "app", "image": "app:1"}},
		},
	}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(a.PodsDir, ns+"_"+name+".json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// ldsWatch follows the agent's listener discovery with a raw delta stream.
type ldsWatch struct {
	mu        sync.Mutex
	listeners map[string]*listenerv3.Listener
}

func watchLDS(t *testing.T, sock string) *ldsWatch {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = conn.Close() })
	stream, err := discovery.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ListenerType, ResourceNamesSubscribe: []string{"*"}}); err != nil {
		t.Fatal(err)
	}
	w := &ldsWatch{listeners: map[string]*listenerv3.Listener{}}
	go func() {
		for {
			resp, err := stream.Recv()
			if err != nil {
				return
			}
			w.mu.Lock()
			for _, r := range resp.GetResources() {
				l := &listenerv3.Listener{}
				if err := proto.Unmarshal(r.GetResource().GetValue(), l); err == nil {
					w.listeners[r.GetName()] = l
				}
			}
			for _, n := range resp.GetRemovedResources() {
				delete(w.listeners, n)
			}
			w.mu.Unlock()
			_ = stream.Send(&discovery.DeltaDiscoveryRequest{TypeUrl: resource.ListenerType, ResponseNonce: resp.GetNonce()})
		}
	}()
	return w
}

func (w *ldsWatch) forPod(containerID string) []*listenerv3.Listener {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*listenerv3.Listener
	for name, l := range w.listeners {
		if strings.HasPrefix(name, "aether/"+containerID+"/") {
			out = append(out, l)
		}
	}
	return out
}

// watchWDS follows the agent's workload discovery with xds/workload/client.
func watchWDS(t *testing.T, sock string) *workloadclient.Client {
	t.Helper()
	c, err := workloadclient.Dial(context.Background(), workloadclient.Options{Socket: sock, NodeID: "node-test"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	go func() {
		for {
			if _, err := c.Recv(); err != nil {
				return
			}
		}
	}()
	return c
}

func find(c *workloadclient.Client, uid string) *workloadpb.Workload {
	for _, w := range c.Workloads() {
		if w.GetUid() == uid {
			return w
		}
	}
	return nil
}

// TestManagedPodOverXDS adds a managed pod through the CNI chain (bridge +
// host-local → aether-cni, driven by libcni) against the real agent and
// follows it over the agent's xDS: the workload appears with raw IP bytes and
// the pod's listeners carry its pinned netns; when the pod starts
// terminating the workload turns UNHEALTHY but stays; CNI DEL removes both.
func TestManagedPodOverXDS(t *testing.T) {
	harness.RequireRoot(t)
	ctx := context.Background()
	node := harness.NewNS(t, "node")
	agent := agentproc.Start(t, node)
	pinDir := filepath.Join(t.TempDir(), "pins")
	t.Cleanup(func() {
		names, _ := os.ReadDir(pinDir)
		for _, n := range names {
			_ = syscall.Unmount(filepath.Join(pinDir, n.Name()), syscall.MNT_DETACH)
		}
	})
	ipam, _ := harness.HostLocalIPAM(t, "10.252.0.0/24")
	ipam["routes"] = []map[string]string{{"dst": "0.0.0.0/0"}}
	conf := harness.ConfList(t, "nodenet", "1.0.0",
		map[string]any{"type": "bridge", "bridge": "aetbr0", "isGateway": true, "ipam": ipam},
		map[string]any{
			"type": "aether-cni", "agent_socket": agent.Sock, "netns_pin_dir": pinDir,
			"netns_unpin_delay_seconds": 0, "cri_socket": "", "readiness_probe_disabled": true,
			"log_file": filepath.Join(agent.Dir, "cni.log"),
		})
	rt := harness.NewRuntime(t, node, []string{harness.BuildOwn(t, "aether-cni", "aether-agent"), harness.ReferencePlugins(t)}, conf)

	wds := watchWDS(t, agent.XDSSocket)
	ldsw := watchLDS(t, agent.LDSSocket)

	podNS := harness.NewNS(t, "pod")
	writePod(t, agent, "shop", "web-7d9f8c6b5-abcde", "uid-web", "", nil)
	p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: podNS.Path(), Name: "web-7d9f8c6b5-abcde", Namespace: "shop", UID: "uid-web"}
	res, err := rt.Add(ctx, p)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	r, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	ip, ok := netip.AddrFromSlice(r.IPs[0].Address.IP.To4())
	if !ok {
		t.Fatalf("no IPv4 in %v", r.IPs)
	}
	uid := "Kubernetes//Pod/shop/web-7d9f8c6b5-abcde"

	eventually(t, "workload served over xDS", func() bool { return find(wds, uid) != nil })
	w := find(wds, uid)
	if len(w.GetAddresses()) != 1 || !slices.Equal(w.GetAddresses()[0], ip.AsSlice()) || len(w.GetAddresses()[0]) != 4 {
		t.Fatalf("addresses %v, want the raw 4 bytes of %s", w.GetAddresses(), ip)
	}
	if w.GetStatus() != workloadpb.WorkloadStatus_HEALTHY || w.GetWorkloadType() != workloadpb.WorkloadType_DEPLOYMENT ||
		w.GetWorkloadName() != "web" || w.GetCanonicalName() != "web" || w.GetCanonicalRevision() != "v2" ||
		w.GetServiceAccount() != "web-sa" || w.GetNode() != agentproc.NodeName || w.GetNamespace() != "shop" {
		t.Fatalf("unexpected workload: %v", w)
	}

	eventually(t, "pod listeners served", func() bool { return len(ldsw.forPod(p.ContainerID)) == len(listener.Roles) })
	pin := filepath.Join(pinDir, p.ContainerID)
	for _, l := range ldsw.forPod(p.ContainerID) {
		if got := l.GetAddress().GetSocketAddress().GetNetworkNamespaceFilepath(); got != pin {
			t.Fatalf("listener %s binds in %q, want the pin %q", l.GetName(), got, pin)
		}
	}

	// The inbound policy follows the pod's annotation (the agent's default
	// is permissive; an invalid value is served strict).
	policies := func() map[string]bool {
		out := map[string]bool{}
		for _, l := range ldsw.forPod(p.ContainerID) {
			s, err := listener.Parse(l)
			if err != nil {
				t.Fatal(err)
			}
			out[s.InboundPolicy] = true
		}
		return out
	}
	for _, step := range []struct{ annotation, want string }{
		{"", meshcontract.InboundPolicyPermissive},
		{meshcontract.InboundPolicyStrict, meshcontract.InboundPolicyStrict},
		{meshcontract.InboundPolicyPermissive, meshcontract.InboundPolicyPermissive},
		{"bogus", meshcontract.InboundPolicyStrict},
	} {
		var ann map[string]string
		if step.annotation != "" {
			ann = map[string]string{meshcontract.InboundPolicyAnnotation: step.annotation}
			writePod(t, agent, "shop", "web-7d9f8c6b5-abcde", "uid-web", "", ann)
		}
		eventually(t, "listeners with inbound policy "+step.want+" after annotation "+step.annotation, func() bool {
			got := policies()
			return len(got) == 1 && got[step.want] && len(ldsw.forPod(p.ContainerID)) == len(listener.Roles)
		})
	}

	// deletionTimestamp: deregistered, but served UNHEALTHY until DEL.
	writePod(t, agent, "shop", "web-7d9f8c6b5-abcde", "uid-web", time.Now().UTC().Format(time.RFC3339), nil)
	eventually(t, "terminating workload UNHEALTHY", func() bool {
		w := find(wds, uid)
		return w != nil && w.GetStatus() == workloadpb.WorkloadStatus_UNHEALTHY
	})
	if len(ldsw.forPod(p.ContainerID)) != len(listener.Roles) {
		t.Fatal("listeners of a terminating pod must stay until DEL")
	}

	if err := rt.Del(ctx, p); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	eventually(t, "workload removed at DEL", func() bool { return find(wds, uid) == nil })
	eventually(t, "listeners removed at DEL", func() bool { return len(ldsw.forPod(p.ContainerID)) == 0 })
}
