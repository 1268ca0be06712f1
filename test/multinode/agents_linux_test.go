package multinode

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/test/harness"
	"aether.io/node/xds/workload"
)

// Agent settings of the lane; the checker's bounds derive from them.
const (
	// leaseTTL is each agent's etcd lease TTL (--etcd-lease-ttl).
	leaseTTL = 5 * time.Second
	// livenessInterval is each agent's liveness loop period.
	livenessInterval = 500 * time.Millisecond
	// agentTimeout is aether-cni's one AddPod attempt (agent_timeout_ms,
	// add_attempts 1): a successful ADD means AddPod returned within it.
	agentTimeout = 2 * time.Second
	// nodeIPBase is the fabric address of node 0 (192.0.2.20, ...).
	nodeIPBase = 20
	// proxyPortBase is the first port of node 0's etcd proxy; node i
	// listens on proxyPortBase+10*i+member.
	proxyPortBase = 24000
)

// node is one simulated node: a namespace on the fabric bridge, an
// aether-agent process in it (--registry=etcd through its etcd proxy, a
// directory of Pod manifests as pod source), and the CNI chain bridge +
// host-local → aether-cni driven through libcni.
type node struct {
	name  string
	idx   int
	ns    *harness.NS
	dir   string // run/, state/, pods/, pins/, uds/
	proxy *etcdProxy
	rt    *harness.Runtime
	bin   string

	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	stderr *bytes.Buffer
}

// pod is one pod sandbox added through a node's CNI chain.
type pod struct {
	uid   string // the workload uid served over xDS
	name  string
	node  *node
	netns *harness.NS
	sbx   harness.Pod
}

func (n *node) xdsSocket() string { return filepath.Join(n.dir, "proxy", "xds.sock") }
func (n *node) cniSocket() string { return filepath.Join(n.dir, "run", "cni.sock") }

// newNode makes node i's namespace (veth on the fabric bridge), its etcd
// proxy, its CNI chain, and starts its agent.
func newNode(t *testing.T, c *cluster, i int) *node {
	t.Helper()
	bins := harness.BuildOwn(t, "aether-cni", "aether-agent")
	// A short path: unix socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "aet-mn-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	n := &node{name: fmt.Sprintf("node-%c", 'a'+i), idx: i, ns: harness.NewNS(t, "node"), dir: dir, bin: filepath.Join(bins, "aether-agent")}
	for _, d := range []string{"run", "state", "pods", "pins", "uds"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		pins, _ := os.ReadDir(filepath.Join(dir, "pins"))
		for _, p := range pins {
			_ = syscall.Unmount(filepath.Join(dir, "pins", p.Name()), syscall.MNT_DETACH)
		}
	})
	veth := fmt.Sprintf("vn%d", i)
	harness.Veth(t, c.fabric, veth, n.ns, "eth0")
	harness.Enslave(t, c.fabric, veth, bridgeName)
	harness.AddAddr(t, n.ns, "eth0", fmt.Sprintf("192.0.2.%d/24", nodeIPBase+i))
	n.proxy = newEtcdProxy(t, c, proxyPortBase+10*i)

	ipam, _ := harness.HostLocalIPAM(t, fmt.Sprintf("10.%d.0.0/24", 10+i))
	conf := harness.ConfList(t, "nodenet", "1.0.0",
		map[string]any{"type": "bridge", "bridge": "aetbr0", "isGateway": true, "ipam": ipam},
		map[string]any{
			"type": "aether-cni", "agent_socket": n.cniSocket(), "netns_pin_dir": filepath.Join(dir, "pins"),
			"netns_unpin_delay_seconds": 0, "cri_socket": "", "readiness_probe_disabled": true,
			"agent_timeout_ms": int(agentTimeout / time.Millisecond), "add_attempts": 1,
			"log_file": filepath.Join(dir, "cni.log"),
		})
	n.rt = harness.NewRuntime(t, n.ns, []string{bins, harness.ReferencePlugins(t)}, conf)
	n.start(t)
	t.Cleanup(func() { n.stop(syscall.SIGKILL) })
	return n
}

// start starts the agent inside the node's namespace and waits until its
// CNI socket answers Ready.
func (n *node) start(t *testing.T) {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd != nil {
		t.Fatalf("agent of %s already running", n.name)
	}
	n.stderr = &bytes.Buffer{}
	cmd := exec.Command(n.bin,
		"--cni-socket", n.cniSocket(), "--admin-socket", "", "--state-dir", filepath.Join(n.dir, "state"),
		"--xds-socket", n.xdsSocket(), "--lds-socket", filepath.Join(n.dir, "proxy", "lds.sock"),
		"--pod-manifests", filepath.Join(n.dir, "pods"), "--pod-manifests-interval", "100ms", "--node-name", n.name,
		"--uds-csi-root", filepath.Join(n.dir, "uds"), "--http-addr", "127.0.0.1:0", "--log-level", "info",
		"--registry", "etcd", "--etcd-endpoints", strings.Join(n.proxy.endpoints(), ","), "--etcd-insecure",
		"--etcd-lease-ttl", leaseTTL.String(), "--liveness-interval", livenessInterval.String())
	cmd.Stdout, cmd.Stderr = n.stderr, n.stderr
	// Started from a thread inside the node's namespace: the agent's
	// connections to etcd leave through its eth0 on the fabric bridge.
	n.ns.MustDo(t, cmd.Start)
	n.cmd, n.done = cmd, make(chan struct{})
	done := n.done
	go func() { _ = cmd.Wait(); close(done) }()
	c, err := agentclient.New(n.cniSocket(), agentclient.Options{Timeout: time.Second, Attempts: 1, ReportTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	deadline := time.Now().Add(recovery)
	for c.Ready(context.Background()) != nil {
		select {
		case <-done:
			t.Fatalf("agent of %s exited at start:\n%s", n.name, n.stderr)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent of %s not ready within %v:\n%s", n.name, recovery, n.stderr)
		}
	}
}

// stop signals the agent and waits for it to exit (SIGKILL after 30 s);
// stopping a stopped agent does nothing.
func (n *node) stop(sig syscall.Signal) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return
	}
	stopProcess(n.cmd, n.done, sig, 30*time.Second)
	n.cmd = nil
}

// running reports whether the agent process is up.
func (n *node) running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cmd != nil
}

// logs returns the current agent process's output.
func (n *node) logs() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stderr == nil {
		return ""
	}
	return n.stderr.String()
}

// writePod puts the pod's manifest into the node's pod source; a non-empty
// deletionTimestamp marks it terminating.
func (n *node) writePod(t *testing.T, name, uid, deletionTimestamp string) {
	t.Helper()
	meta := map[string]any{
		"name": name, "namespace": "shop", "uid": uid,
		"labels": map[string]string{"aether.io/managed": "true", "app": "web"},
	}
	if deletionTimestamp != "" {
		meta["deletionTimestamp"] = deletionTimestamp
	}
	b, err := json.Marshal(map[string]any{
		"apiVersion": "v1", "kind": "Pod", "metadata": meta,
		"spec": map[string]any{"nodeName": n.name, "serviceAccountName": "web", "containers": []map[string]any{{"name": "app", "image": "app:1"}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(n.dir, "pods", "."+name+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(n.dir, "pods", name+".json")); err != nil {
		t.Fatal(err)
	}
}

// removePod deletes the pod's manifest (the pod object is gone).
func (n *node) removePod(t *testing.T, name string) {
	t.Helper()
	if err := os.Remove(filepath.Join(n.dir, "pods", name+".json")); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
}

// newPod makes a pod sandbox of n and writes its manifest.
func (n *node) newPod(t *testing.T, name string) *pod {
	t.Helper()
	p := &pod{uid: workload.UID("Kubernetes", "shop", name), name: name, node: n, netns: harness.NewNS(t, "pod")}
	p.sbx = harness.Pod{ContainerID: harness.ContainerID(), NetNS: p.netns.Path(), Name: name, Namespace: "shop", UID: "uid-" + name}
	n.writePod(t, name, p.sbx.UID, "")
	return p
}

// add runs CNI ADD of p through n's chain and returns how long it took.
func (n *node) add(p *pod) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), recovery)
	defer cancel()
	start := time.Now()
	_, err := n.rt.Add(ctx, p.sbx)
	return time.Since(start), err
}

// del runs CNI DEL of p and removes its manifest (its namespace goes at
// t.Cleanup).
func (n *node) del(t *testing.T, p *pod) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), recovery)
	defer cancel()
	if err := n.rt.Del(ctx, p.sbx); err != nil {
		return err
	}
	n.removePod(t, p.name)
	return nil
}
