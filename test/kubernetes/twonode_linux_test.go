package kubernetes_test

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"aether.io/node/test/containerd"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
)

// The two-node lane's fabric: one bridge in a fabric netns, each node's
// eth0 on it with its address; each node routes the other's pod subnet to
// the other's address.
const (
	fabricBridge = "k8sfab0"
	clusterCIDR  = "10.244.0.0/16"
)

// laneNodes are the two nodes: names, addresses, pod subnets.
var laneNodes = []struct{ name, ip, subnet, fabricLink string }{
	{"aether-a", "192.0.2.11", "10.244.1.0/24", "fab-a"},
	{"aether-b", "192.0.2.12", "10.244.2.0/24", "fab-b"},
}

// twoNodes is one control plane (in node A's netns) and two kubelet nodes.
type twoNodes struct {
	fabric  *harness.NS
	cluster *kubetest.Cluster
	nodes   []*node
	// host is where the chart's host paths live on every node: node A's
	// directory in the machine's mount namespace, node B's bind-mounted
	// over the same path in B's own mount namespace (one DaemonSet, one
	// set of host paths, two nodes' worth of files).
	host string
}

// hostPath is a host path of the DaemonSet (the same on every node).
func (tn *twoNodes) hostPath(p string) string { return filepath.Join(tn.host, p) }

// hostDirs are the chart's host paths below twoNodes.host.
var hostDirs = []string{"run/aether", "var/lib/aether", "cni-bin", "cni-conf", "kubelet"}

// startTwoNodes builds the fabric, starts the control plane and both
// nodes (containerd, kubelet) and waits until both Nodes are Ready.
func startTwoNodes(t *testing.T) *twoNodes {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the Kubernetes lane needs root (network and mount namespaces, cgroups, kubelet): run `make test` as root, as CI does")
	}
	containerd.Need(t, "containerd", "runc", "ctr", "nsenter", "unshare", "nft")
	recordKernelSettings(t)
	start := time.Now()
	tn := &twoNodes{fabric: harness.NewNS(t, "k8sfab")}
	harness.Bridge(t, tn.fabric, fabricBridge)
	var fresh []string
	for _, d := range hostLeftovers {
		if _, err := os.Lstat(d); os.IsNotExist(err) {
			fresh = append(fresh, d)
		}
	}
	for i, ln := range laneNodes {
		base, err := os.MkdirTemp("", "aet-k8"+string(rune('a'+i))+"-")
		if err != nil {
			t.Fatal(err)
		}
		leftovers := fresh
		if i > 0 {
			leftovers = nil // node A's cleanup runs last and removes them
		}
		t.Cleanup(func() { removeLeftovers(t, base, leftovers) })
		n := &node{name: ln.name, ip: ln.ip, base: base, subnet: ln.subnet, ns: harness.NewNS(t, "k8s"+string(rune('a'+i)))}
		if i == 0 {
			tn.host = filepath.Join(base, "host")
		}
		for _, d := range hostDirs {
			mkdir(t, filepath.Join(base, "host", d))
		}
		fabricLink(t, tn, n, ln.fabricLink)
		tn.nodes = append(tn.nodes, n)
	}
	a, b := tn.nodes[0], tn.nodes[1]
	routePods(t, a, b)
	routePods(t, b, a)
	// B's mount namespace first, before any mount of A's that it would copy.
	ownMountNS(t, tn, b)
	sharedMount(t, tn.hostPath("run/aether"))

	bins := kubetest.BinDir(t, kubetest.ControllerManager, kubetest.Scheduler, kubetest.Kubelet, kubetest.KubeProxy)
	t.Logf("binaries ready after %s", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	tn.cluster = kubetest.StartWith(t, kubetest.Options{
		NetNS: a.ns,
		// Reachable from node B over the fabric (and from the pods through
		// the kubernetes Service, with kube-proxy).
		APIServerArgs: []string{"--advertise-address=" + a.ip, "--bind-address=0.0.0.0"},
		Binaries:      []string{kubetest.ControllerManager, kubetest.Scheduler, kubetest.Kubelet, kubetest.KubeProxy},
	})
	startControllers(t, tn.cluster, bins, a.base)
	kc, err := os.ReadFile(tn.cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	remote := filepath.Join(a.base, "kubeconfig-node")
	kc = []byte(strings.Replace(string(kc), "https://127.0.0.1:", "https://"+a.ip+":", 1))
	if err := os.WriteFile(remote, kc, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, n := range tn.nodes {
		n.cluster, n.bins, n.kubeconfig = tn.cluster, bins, remote
		startLaneNode(t, tn, n)
	}
	for _, n := range tn.nodes {
		waitNodeReady(t, n)
	}
	t.Logf("both Nodes Ready %s after the control plane started", time.Since(start).Round(time.Millisecond))
	return tn
}

// fabricLink plugs node n into the fabric: a veth pair (link in the fabric
// netns on its bridge, eth0 in the node's) with the node's address, and a
// default route on eth0 (kubelet and the apiserver look for one).
func fabricLink(t *testing.T, tn *twoNodes, n *node, link string) {
	t.Helper()
	harness.Veth(t, tn.fabric, link, n.ns, "eth0")
	harness.Enslave(t, tn.fabric, link, fabricBridge)
	harness.AddAddr(t, n.ns, "eth0", n.ip+"/24")
	n.ns.MustDo(t, func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Scope: netlink.SCOPE_LINK, Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}})
	})
}

// routePods routes peer's pod subnet to peer's address in from's netns.
func routePods(t *testing.T, from, peer *node) {
	t.Helper()
	_, dst, err := net.ParseCIDR(peer.subnet)
	if err != nil {
		t.Fatal(err)
	}
	from.ns.MustDo(t, func() error {
		if err := netlink.RouteAdd(&netlink.Route{Dst: dst, Gw: net.ParseIP(peer.ip)}); err != nil {
			return fmt.Errorf("failed to route %s via %s: %w", peer.subnet, peer.ip, err)
		}
		return nil
	})
}

// ownMountNS gives node n its own mount namespace, held by a sleeping
// process (ended by PID in t.Cleanup, after n's containerd and kubelet
// stopped: its mounts go with the namespace): n's host directory is
// bind-mounted over tn.host there, and the run dir made a shared mount
// (the containers' HostToContainer mounts see aether-cni's netns pins).
// n's containerd and kubelet enter it with nsenter; the test reads its
// files through /proc/<pid>/root.
func ownMountNS(t *testing.T, tn *twoNodes, n *node) {
	t.Helper()
	run := tn.hostPath("run/aether")
	script := fmt.Sprintf("mount --bind %q %q && mount --bind %q %q && mount --make-shared %q && echo ready && exec sleep 2147483647",
		filepath.Join(n.base, "host"), tn.host, run, run, run)
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("failed to start node %s's mount namespace: %v", n.name, err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "ready" {
		t.Fatalf("node %s's mount namespace: %q, %v\n%s", n.name, line, err, stderr.String())
	}
	n.wrap = []string{"nsenter", fmt.Sprintf("--mount=/proc/%d/ns/mnt", cmd.Process.Pid), "--"}
	n.view = fmt.Sprintf("/proc/%d/root", cmd.Process.Pid)
}

// startLaneNode starts n's containerd (bridge + host-local on n's subnet,
// the chart's CNI dirs) and kubelet (root dir the chart's kubeletDir).
func startLaneNode(t *testing.T, tn *twoNodes, n *node) {
	t.Helper()
	n.cniBin = tn.hostPath("cni-bin")
	bin := n.view + n.cniBin
	ref := harness.ReferencePlugins(t)
	for _, p := range []string{"bridge", "host-local"} {
		if err := os.Symlink(filepath.Join(ref, p), filepath.Join(bin, p)); err != nil {
			t.Fatal(err)
		}
	}
	containerd.GoBuild(t, bin+"/", "github.com/containernetworking/plugins/plugins/main/loopback")
	n.runtime = containerd.StartWith(t, n.ns, n.cniBin, bridgeConflist(n.subnet, filepath.Join(n.base, "ipam")),
		containerd.Options{Wrap: n.wrap, ConfDir: tn.hostPath("cni-conf"), View: n.view})
	n.runtime.ImportPause(t)
	n.conflist = filepath.Join(n.runtime.ConfDir(), "10-mesh.conflist")
	var err error
	if n.original, err = os.ReadFile(n.view + n.conflist); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.WriteFile(n.view+n.conflist, n.original, 0o600) })
	n.kubeletRoot = tn.hostPath("kubelet")
	n.kubelet = startKubelet(t, n)
	t.Cleanup(n.kubelet.Stop)
}

// TestKubernetesTwoNodes runs aether-node on a real two-node Kubernetes
// with kube-proxy and the chart's default registry, and walks the
// cross-node Service scenarios (see doc.go).
func TestKubernetesTwoNodes(t *testing.T) {
	start := time.Now()
	tn := startTwoNodes(t)
	_ = tn
	t.Logf("lane took %s", time.Since(start).Round(time.Millisecond))
}
