package e2e

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/registry/etcd/etcdtest"
	"aether.io/node/test/harness"
	"aether.io/node/xds/workload"
	"aether.io/node/xds/workload/client"
)

// xdsEvent is one change a workload discovery client saw.
type xdsEvent struct {
	uid     string
	removed bool
}

// xdsWatch follows one agent's workload discovery (delta, wildcard) and
// keeps every change it saw, in order.
type xdsWatch struct {
	mu     sync.Mutex
	first  map[string]bool // the first response's workloads
	held   map[string]bool
	events []xdsEvent
	err    error
}

func watchAgentXDS(t *testing.T, socket string) *xdsWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c, err := client.Dial(ctx, client.Options{Socket: socket, NodeID: "checker"})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	w := &xdsWatch{held: map[string]bool{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			up, err := c.Recv()
			w.mu.Lock()
			if err != nil {
				w.err = err
				w.mu.Unlock()
				return
			}
			for _, wl := range up.Updated {
				w.held[wl.GetUid()] = true
				w.events = append(w.events, xdsEvent{uid: wl.GetUid()})
			}
			for _, r := range up.Removed {
				delete(w.held, r)
				w.events = append(w.events, xdsEvent{uid: r, removed: true})
			}
			if w.first == nil {
				w.first = maps.Clone(w.held)
			}
			w.mu.Unlock()
		}
	}()
	t.Cleanup(func() { cancel(); _ = c.Close(); <-done })
	return w
}

// serves reports whether every uid is held.
func (w *xdsWatch) serves(uids ...string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, u := range uids {
		if !w.held[u] {
			return false
		}
	}
	return true
}

// lacks reports whether no uid is held.
func (w *xdsWatch) lacks(uids ...string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, u := range uids {
		if w.held[u] {
			return false
		}
	}
	return true
}

// removals returns the uids among uids this client ever saw removed.
func (w *xdsWatch) removals(uids ...string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
	for _, ev := range w.events {
		if ev.removed && slices.Contains(uids, ev.uid) && !slices.Contains(out, ev.uid) {
			out = append(out, ev.uid)
		}
	}
	return out
}

// cameBack reports whether uid was put again after this client saw it
// removed.
func (w *xdsWatch) cameBack(uid string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	gone := false
	for _, ev := range w.events {
		switch {
		case ev.uid != uid:
		case ev.removed:
			gone = true
		case gone:
			return true
		}
	}
	return false
}

// multiNode is one node of TestMultiNodeAgentRestart and its agent process.
type multiNode struct {
	name, dir, manifests string
	agent                *agent
}

// TestMultiNodeAgentRestart runs three aether-agent processes, one per node,
// on one etcd (--registry=etcd), each serving workload discovery. A checker
// follows every agent's xDS and asserts:
//   - every live managed pod, added through each node's CNI socket, is
//     served by every agent;
//   - a removed pod is gone from every agent and never comes back;
//   - kill -9 of one agent and its restart: its own pods are in its first
//     xDS response after the restart and never leave it while its follower
//     syncs the other nodes (regression: the first sync removed them), and
//     the other agents never drop them (the lease outlives the restart).
func TestMultiNodeAgentRestart(t *testing.T) {
	harness.RequireRoot(t)
	e := etcdtest.Start(t)
	netns := filepath.Join(t.TempDir(), "netns") // the prober's "netns exists"
	if err := os.WriteFile(netns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	uid := func(name string) string { return workload.UID("Kubernetes", "shop", name) }
	start := func(n *multiNode) {
		n.agent = startAgent(t, n.dir, "--node-name", n.name, "--pod-manifests", n.manifests, "--log-level", "info",
			"--registry", "etcd", "--etcd-endpoints", e.Endpoint(), "--etcd-insecure", "--etcd-lease-ttl", "60s",
			"--liveness-interval", "200ms")
		n.agent.waitReady(t)
	}
	addPod := func(n *multiNode, name, ip string) {
		t.Helper()
		pod := cniPod("shop", name, "cid-"+name, ip)
		pod.NetworkNamespace = netns
		r, err := n.agent.client(t).AddPod(ctxT(t, 20*time.Second), &cniv1.AddPodRequest{Pod: pod})
		if err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
			t.Fatalf("AddPod %s on %s = %v, %v", name, n.name, r.GetResult(), err)
		}
	}
	var nodes []*multiNode
	var live []string // uids of the live pods, added through the CNI sockets
	for i, name := range []string{"node-a", "node-b", "node-c"} {
		n := &multiNode{name: name, dir: newAgentDirs(t)}
		n.manifests = filepath.Join(n.dir, "manifests")
		if err := os.Mkdir(n.manifests, 0o755); err != nil {
			t.Fatal(err)
		}
		var docs []string
		for j := range 3 { // pod 2 of each node is added later, after the restart
			pod := fmt.Sprintf("%s-web-%d", name, j)
			docs = append(docs, strings.Replace(podYAML("shop", pod, "uid-"+pod, true, "", ""), "nodeName: node-a", "nodeName: "+name, 1))
		}
		writeManifest(t, n.manifests, "pods.yaml", strings.Join(docs, "---\n"))
		start(n)
		for j := range 2 {
			pod := fmt.Sprintf("%s-web-%d", name, j)
			addPod(n, pod, fmt.Sprintf("10.%d.0.%d", i+1, j+1))
			live = append(live, uid(pod))
		}
		nodes = append(nodes, n)
	}
	a, b, c := nodes[0], nodes[1], nodes[2]
	aPods := []string{uid("node-a-web-0"), uid("node-a-web-1")}
	watches := map[string]*xdsWatch{}
	for _, n := range nodes {
		watches[n.name] = watchAgentXDS(t, filepath.Join(n.dir, "run", "xds.sock"))
	}
	for _, n := range nodes {
		eventually(t, "every live pod served by "+n.name, func() bool { return watches[n.name].serves(live...) })
	}

	// A removed pod is gone everywhere (and, checked at the end, never
	// comes back).
	gone := uid("node-b-web-1")
	if r, err := b.agent.client(t).RemovePod(ctxT(t, 20*time.Second), &cniv1.RemovePodRequest{
		Namespace: "shop", Name: "node-b-web-1", ContainerId: "cid-node-b-web-1",
	}); err != nil || r.GetResult() != cniv1.RemovePodResponse_RESULT_SUCCESS {
		t.Fatalf("RemovePod = %v, %v", r.GetResult(), err)
	}
	live = slices.DeleteFunc(live, func(u string) bool { return u == gone })
	for _, n := range nodes {
		eventually(t, "the removed pod gone from "+n.name, func() bool { return watches[n.name].lacks(gone) })
	}

	// kill -9 node-a's agent and start it again on the same state.
	a.agent.kill9()
	start(a)
	wa := watchAgentXDS(t, filepath.Join(a.dir, "run", "xds.sock"))
	t.Cleanup(func() {
		if t.Failed() {
			for name, w := range map[string]*xdsWatch{"node-a (restarted)": wa, "node-b": watches["node-b"], "node-c": watches["node-c"]} {
				w.mu.Lock()
				t.Logf("%s: holds %v; events %v", name, slices.Sorted(maps.Keys(w.held)), w.events)
				w.mu.Unlock()
			}
		}
	})
	// A pod added on node-c now reaches node-a through the follower's
	// watch: once it is served, the follower's first sync is over.
	addPod(c, "node-c-web-2", "10.3.0.3")
	eventually(t, "node-c's new pod served by the restarted node-a", func() bool { return wa.serves(uid("node-c-web-2")) })
	addPod(a, "node-a-web-2", "10.1.0.3")
	live = append(live, uid("node-c-web-2"), uid("node-a-web-2"))
	for _, n := range nodes {
		w := watches[n.name]
		if n == a {
			w = wa
		}
		eventually(t, "every live pod served by "+n.name+" after the restart", func() bool {
			return w.serves(live...)
		})
	}

	wa.mu.Lock()
	for _, p := range aPods {
		if !wa.first[p] {
			t.Errorf("node-a's own pod %s missing from its first xDS response after the restart", p)
		}
	}
	wa.mu.Unlock()
	if r := wa.removals(aPods...); len(r) > 0 {
		t.Errorf("the restarted node-a removed its own pods %v from its xDS", r)
	}
	for _, n := range []*multiNode{b, c} {
		if r := watches[n.name].removals(aPods...); len(r) > 0 {
			t.Errorf("%s dropped node-a's pods %v while node-a restarted", n.name, r)
		}
	}
	for name, w := range map[string]*xdsWatch{"node-a (restarted)": wa, "node-b": watches["node-b"], "node-c": watches["node-c"]} {
		if !w.lacks(gone) || w.cameBack(gone) {
			t.Errorf("the removed pod came back on %s", name)
		}
	}
}
