package kubernetes_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

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
		l, err := netlinksafe.LinkByName("eth0")
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

// kubeProxyArgs are kube-proxy's flags besides the per-node ones:
// nftables mode (no iptables on these machines), and no conntrack setting
// written (the limit is global to the machine; the timeouts 0 leave the
// node netns' own values).
var kubeProxyArgs = []string{
	"--proxy-mode=nftables", "--cluster-cidr=" + clusterCIDR,
	"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
	"--conntrack-udp-timeout=0", "--conntrack-udp-timeout-stream=0", "--v=1",
}

// startKubeProxy runs kube-proxy in every node's netns and waits until
// each reports healthy (its first sync done) and the kubernetes Service's
// VIP answers from every node (node B's reaches the apiserver over the
// fabric). The host's conntrack settings must not change.
func startKubeProxy(t *testing.T, tn *twoNodes) {
	t.Helper()
	before := hostSettings(t)
	for _, n := range tn.nodes {
		health := kubetest.FreePort(t)
		dir := filepath.Join(n.base, "kube-proxy")
		mkdir(t, dir)
		args := append([]string{
			filepath.Join(n.bins, kubetest.KubeProxy),
			"--kubeconfig=" + n.kubeconfig, "--hostname-override=" + n.name, "--bind-address=" + n.ip,
			fmt.Sprintf("--healthz-bind-address=127.0.0.1:%d", health),
			fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", kubetest.FreePort(t)),
		}, kubeProxyArgs...)
		n.kubeProxy = tn.cluster.RunIn(t, n.ns, dir, args...)
		t.Cleanup(n.kubeProxy.Stop)
		hc := nodeHTTP(n)
		kubetest.WaitFor(t, "kube-proxy on "+n.name+" healthy", 60*time.Second, n.kubeProxy, func() bool {
			resp, err := hc.Get(fmt.Sprintf("http://127.0.0.1:%d/healthz", health))
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK
		})
	}
	svc, err := tn.cluster.Client.CoreV1().Services("default").Get(context.Background(), "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := net.JoinHostPort(svc.Spec.ClusterIP, "443")
	for _, n := range tn.nodes {
		kubetest.WaitFor(t, "the kubernetes Service "+vip+" from "+n.name, 30*time.Second, n.kubeProxy, func() bool {
			c, err := nodeDial(n, vip)
			if err == nil {
				c.Close()
			}
			return err == nil
		})
	}
	if after := hostSettings(t); !maps.Equal(before, after) {
		t.Errorf("kube-proxy changed the host's conntrack settings: %v -> %v", before, after)
	}
}

// hostSettings reads the host's optional (conntrack) kernel settings.
func hostSettings(t *testing.T) map[string]string {
	t.Helper()
	got := map[string]string{}
	for _, k := range kernelSettings {
		if !optionalKernelSetting(k) {
			continue
		}
		if b, err := os.ReadFile(filepath.Join("/proc/sys", k)); err == nil {
			got[k] = strings.TrimSpace(string(b))
		}
	}
	return got
}

// nodeDial opens a TCP connection to addr from n's netns.
func nodeDial(n *node, addr string) (net.Conn, error) {
	var c net.Conn
	err := n.ns.Do(func() error {
		var err error
		c, err = (&net.Dialer{Timeout: 3 * time.Second}).Dial("tcp", addr)
		return err
	})
	return c, err
}

// nodeHTTP is an HTTP client dialing from n's netns.
func nodeHTTP(n *node) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var c net.Conn
			err := n.ns.Do(func() error {
				var err error
				c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return c, err
		},
	}}
}

// installTwoNodes renders the chart with its defaults (registry.mode kube
// among them) except the image, the host paths, identities (the embedded
// CA, so managed pods speak HBONE), Istio's CRDs and inbound capture (so
// plaintext reaching a managed backend meets its PeerAuthentication), and
// creates its objects unchanged: the pods reach the API server through the
// kubernetes Service, which kube-proxy serves on each node.
func installTwoNodes(t *testing.T, tn *twoNodes, tag string) []runtime.Object {
	t.Helper()
	values := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(values, []byte(laneValues(tag, tn.hostPath("run/aether"), tn.hostPath("var/lib/aether"), tn.hostPath("cni-bin"),
		tn.hostPath("cni-conf"), tn.hostPath("kubelet"))+`logLevel: debug
cni:
  inboundCapture: true
identity:
  enabled: true
  generateCA: true
policy:
  installCRDs: auto
`), 0o600); err != nil {
		t.Fatal(err)
	}
	return createChart(t, tn.cluster, values, nil)
}

// waitInstalled waits until the DaemonSet runs on both nodes, each agent
// removed its Node's not-ready taint and each installer chained aether-cni
// after bridge in its node's conflist.
func waitInstalled(t *testing.T, tn *twoNodes) {
	t.Helper()
	waitDaemonSetPods(t, tn.cluster, tn.nodes[1].kubelet, int32(len(tn.nodes)), 180*time.Second)
	for _, n := range tn.nodes {
		var b []byte
		kubetest.WaitFor(t, "aether-cni chained and the taint removed on "+n.name, 30*time.Second, n.kubelet, func() bool {
			no, err := tn.cluster.Client.CoreV1().Nodes().Get(context.Background(), n.name, metav1.GetOptions{})
			if err != nil || hasTaint(no.Spec.Taints, notReadyTaint) {
				return false
			}
			b, _ = os.ReadFile(n.view + n.conflist)
			var cl struct {
				Plugins []map[string]any `json:"plugins"`
			}
			return json.Unmarshal(b, &cl) == nil && len(cl.Plugins) == 2 && cl.Plugins[0]["type"] == "bridge" && cl.Plugins[1]["type"] == "aether-cni"
		})
	}
}

// TestKubernetesTwoNodes runs aether-node on a real two-node Kubernetes
// with kube-proxy and the chart's default registry, and walks the
// cross-node Service scenarios (see doc.go).
func TestKubernetesTwoNodes(t *testing.T) {
	start := time.Now()
	tn := startTwoNodes(t)
	startKubeProxy(t, tn)
	t.Logf("kube-proxy serving on both nodes %s after the start", time.Since(start).Round(time.Millisecond))
	buildImage(t, tn.nodes, "v1")
	for _, n := range tn.nodes {
		n.runtime.ImportBinary(t, "./test/kubernetes/echo", echoImage)
	}
	installTwoNodes(t, tn, "v1")
	if !t.Run("DaemonSetReady", func(t *testing.T) {
		ready := time.Now()
		waitInstalled(t, tn)
		t.Logf("DaemonSet Ready, chained and untainted on both nodes %s after the install", time.Since(ready).Round(time.Millisecond))
	}) {
		return // later scenarios build on this one
	}
	apps := deployTwoNodeApps(t, tn)
	for _, sc := range []struct {
		name string
		run  func(*testing.T, *twoNodes, *laneApps)
	}{
		{"CrossNodeService", testCrossNodeService},
		{"PodIPHBONE", testPodIPHBONE},
		{"UnmanagedBackends", testUnmanagedBackends},
		{"NoEndpoints", testNoEndpoints},
		{"TerminatingBackend", testTerminatingBackend},
		{"Scale", testScale},
	} {
		scStart := time.Now()
		if !t.Run(sc.name, func(t *testing.T) { sc.run(t, tn, apps) }) {
			return // later scenarios build on this one
		}
		t.Logf("%s took %s", sc.name, time.Since(scStart).Round(time.Millisecond))
	}
	t.Logf("lane took %s", time.Since(start).Round(time.Millisecond))
}
