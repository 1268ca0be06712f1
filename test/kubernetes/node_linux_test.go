package kubernetes_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/test/containerd"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
)

const (
	// nodeName is the kubelet's --hostname-override and the Node's name.
	nodeName = "aether-lane"
	// nodeIP is the node's address, on one end of a veth pair inside the
	// node netns (these kernels have no dummy links).
	nodeIP = "192.0.2.2"
	// notReadyTaint is what the kubelet registers the Node with and what
	// the agent removes (agent/nodegate.TaintKey).
	notReadyTaint = "aether.io/agent-not-ready"
	// nodeRegion, nodeZone and nodeSubzone are the Node's topology labels
	// (kubelet's --node-labels): the locality the agent reads from its
	// Node and WDS serves on every workload.
	nodeRegion  = "lane-region"
	nodeZone    = "lane-zone-a"
	nodeSubzone = "lane-rack-1"
)

// kernelSettings are the host-wide sysctls kubelet rewrites at start
// (kernel.panic=10, kernel.panic_on_oops=1, vm.overcommit_memory=1,
// vm.panic_on_oom=0, kernel.keys.root_maxkeys and root_maxbytes) and the
// host's net.ipv4.ip_forward (the bridge plugin sets it, but only in the
// node netns: recorded to prove it). Restored at teardown, also on failure.
var kernelSettings = []string{
	"kernel/panic",
	"kernel/panic_on_oops",
	"vm/overcommit_memory",
	"vm/panic_on_oom",
	"kernel/keys/root_maxkeys",
	"kernel/keys/root_maxbytes",
	"net/ipv4/ip_forward",
	// kube-proxy's conntrack settings (two-node lane): its flags ask for
	// none, and these prove it; the limit is global to the machine.
	"net/netfilter/nf_conntrack_max",
	"net/netfilter/nf_conntrack_tcp_timeout_established",
	"net/netfilter/nf_conntrack_tcp_timeout_close_wait",
}

// optionalKernelSetting reports whether k exists only with a module loaded.
func optionalKernelSetting(k string) bool { return strings.HasPrefix(k, "net/netfilter/") }

// node is one Kubernetes node: control plane, containerd and kubelet, all
// in one network namespace (the node's "host network").
type node struct {
	// name and ip are the Node's name and address (kubelet's
	// --hostname-override and --node-ip).
	name, ip string
	// kubeconfig is what this node's kubelet (and kube-proxy) use.
	kubeconfig string
	// wrap prefixes the command lines of this node's containerd and
	// kubelet (nsenter into its mount namespace); view is the prefix under
	// which the test sees that namespace's files (/proc/<pid>/root). Both
	// are empty for a node in the machine's mount namespace.
	wrap    []string
	view    string
	ns      *harness.NS
	cluster *kubetest.Cluster
	runtime *containerd.Runtime
	kubelet *kubetest.Proc
	// kubeProxy runs in the two-node lane only.
	kubeProxy *kubetest.Proc
	bins      string
	base      string // short per-lane dir: kubelet, host paths of the DaemonSet
	cniBin    string
	// kubeletRoot is kubelet's --root-dir (the chart's hostPaths.kubeletDir).
	kubeletRoot string
	conflist    string // the primary conflist containerd reads
	original    []byte // its bytes before the installer ran
	subnet      string
}

// hostPath is a host path of the DaemonSet inside the lane's directory.
func (n *node) hostPath(p string) string { return filepath.Join(n.base, "host", p) }

// recordKernelSettings reads every setting in kernelSettings now and
// restores the ones that changed in tb.Cleanup; changes are logged. A lane
// killed before its cleanup (SIGKILL, a go test timeout) cannot restore
// them, and the next lane would record kubelet's values as the host's: so
// the originals are also written to kernelSettingsFile before kubelet
// starts, a leftover file (a killed lane) is restored from first, and the
// file is removed once the settings are back.
func recordKernelSettings(tb testing.TB) {
	tb.Helper()
	file := kernelSettingsFile()
	if b, err := os.ReadFile(file); err == nil {
		var left map[string]string
		if err := json.Unmarshal(b, &left); err != nil {
			tb.Fatalf("failed to read the kernel settings a killed lane left in %q: %v (fix: restore them by hand and remove the file)", file, err)
		}
		tb.Logf("a previous lane was killed before restoring the kernel settings: restoring them from %s", file)
		restoreKernelSettings(tb, left)
	} else if !errors.Is(err, fs.ErrNotExist) {
		tb.Fatalf("failed to read %q: %v", file, err)
	}
	before := map[string]string{}
	for _, k := range kernelSettings {
		b, err := os.ReadFile(filepath.Join("/proc/sys", k))
		if errors.Is(err, fs.ErrNotExist) && optionalKernelSetting(k) {
			continue // nf_conntrack not loaded: nothing to restore
		}
		if err != nil {
			tb.Fatalf("failed to read kernel setting %q: %v", k, err)
		}
		before[k] = strings.TrimSpace(string(b))
	}
	b, err := json.Marshal(before)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(file), 0o700); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(file, b, 0o600); err != nil {
		tb.Fatalf("failed to record the kernel settings in %q: %v", file, err)
	}
	tb.Cleanup(func() {
		if restoreKernelSettings(tb, before) {
			_ = os.Remove(file)
		}
	})
}

// kernelSettingsFile holds the host's kernel settings while a lane runs.
func kernelSettingsFile() string {
	return filepath.Join(harness.CacheDir(), "kubernetes-lane-kernel-settings.json")
}

// restoreKernelSettings writes back every setting of want that differs now
// and reports whether all of them are as wanted afterwards.
func restoreKernelSettings(tb testing.TB, want map[string]string) bool {
	ok := true
	for _, k := range kernelSettings {
		w, known := want[k]
		if !known {
			continue
		}
		p := filepath.Join("/proc/sys", k)
		b, err := os.ReadFile(p)
		if err != nil {
			tb.Errorf("failed to read kernel setting %q: %v", k, err)
			ok = false
			continue
		}
		if now := strings.TrimSpace(string(b)); now != w {
			tb.Logf("restoring %s: %s (changed during the lane) -> %s", strings.ReplaceAll(k, "/", "."), now, w)
			if err := os.WriteFile(p, []byte(w), 0o644); err != nil {
				tb.Errorf("failed to restore kernel setting %q to %q: %v", k, w, err)
				ok = false
			}
		}
	}
	return ok
}

// startNode starts the whole node and waits until the Node is Ready.
func startNode(t *testing.T) *node {
	t.Helper()
	// Never a skip: a CI machine that cannot run the lane fails it.
	if os.Geteuid() != 0 {
		t.Fatal("the Kubernetes lane needs root (network namespaces, mounts, cgroups, kubelet): run `make test` as root, as CI does")
	}
	containerd.Need(t, "containerd", "runc", "ctr")
	recordKernelSettings(t)
	start := time.Now()
	n := &node{name: nodeName, ip: nodeIP}

	base, err := os.MkdirTemp("", "aet-k8s-")
	if err != nil {
		t.Fatal(err)
	}
	n.base = base
	// Registered early, so it runs late: after kubelet and containerd
	// stopped (kubelet bind-mounts its root dir onto itself).
	var fresh []string
	for _, d := range hostLeftovers {
		if _, err := os.Lstat(d); os.IsNotExist(err) {
			fresh = append(fresh, d)
		}
	}
	t.Cleanup(func() { removeLeftovers(t, base, fresh) })

	n.ns = harness.NewNS(t, "k8snode")
	n.ns.MustDo(t, func() error {
		d := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "node0"}, PeerName: "node0peer"}
		if err := netlink.LinkAdd(d); err != nil {
			return fmt.Errorf("failed to add link %q: %w", "node0", err)
		}
		addr, _ := netlink.ParseAddr(nodeIP + "/24")
		if err := netlink.AddrAdd(d, addr); err != nil {
			return fmt.Errorf("failed to add address %q: %w", nodeIP, err)
		}
		for _, name := range []string{"node0", "node0peer"} {
			l, err := netlinksafe.LinkByName(name)
			if err == nil {
				err = netlink.LinkSetUp(l)
			}
			if err != nil {
				return fmt.Errorf("failed to set link %q up: %w", name, err)
			}
		}
		// kubelet and the apiserver look for a default route.
		return netlink.RouteAdd(&netlink.Route{LinkIndex: d.Attrs().Index, Scope: netlink.SCOPE_LINK, Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}})
	})

	n.bins = kubetest.BinDir(t, kubetest.ControllerManager, kubetest.Scheduler, kubetest.Kubelet)
	t.Logf("binaries ready after %s", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	n.cluster = kubetest.StartWith(t, kubetest.Options{
		NetNS:         n.ns,
		APIServerArgs: []string{"--advertise-address=" + nodeIP},
		Binaries:      []string{kubetest.ControllerManager, kubetest.Scheduler, kubetest.Kubelet},
	})
	startControllers(t, n.cluster, n.bins, base)
	n.kubeconfig = n.cluster.Kubeconfig

	// CNI: bridge + host-local as the primary network, loopback for the
	// runtime; the installer adds aether-cni to this directory.
	n.cniBin = filepath.Join(base, "cni-bin")
	mkdir(t, n.cniBin)
	ref := harness.ReferencePlugins(t)
	for _, p := range []string{"bridge", "host-local"} {
		if err := os.Symlink(filepath.Join(ref, p), filepath.Join(n.cniBin, p)); err != nil {
			t.Fatal(err)
		}
	}
	containerd.GoBuild(t, n.cniBin+"/", "github.com/containernetworking/plugins/plugins/main/loopback")
	n.subnet = fmt.Sprintf("10.%d.%d.0/24", 200+int(containerd.RandHex(1)[0])%50, int(containerd.RandHex(1)[1])%250)
	n.runtime = containerd.Start(t, n.ns, n.cniBin, bridgeConflist(n.subnet, filepath.Join(base, "ipam")))
	n.runtime.ImportPause(t)
	n.conflist = filepath.Join(n.runtime.ConfDir(), "10-mesh.conflist")
	if n.original, err = os.ReadFile(n.conflist); err != nil {
		t.Fatal(err)
	}
	// Runs before containerd stops: when a failed test left aether-cni
	// chained, the sandboxes' DEL would wait for an agent that is gone
	// (code 11) and leave them behind.
	t.Cleanup(func() { _ = os.WriteFile(n.conflist, n.original, 0o600) })
	n.kubelet = startKubelet(t, n)
	t.Cleanup(n.kubelet.Stop)
	waitNodeReady(t, n)
	t.Logf("node Ready %s after the control plane started", time.Since(start).Round(time.Millisecond))
	return n
}

// startControllers runs kube-controller-manager and kube-scheduler next to
// the cluster's apiserver, with base holding their files.
func startControllers(t *testing.T, c *kubetest.Cluster, bins, base string) {
	t.Helper()
	port := func() string { return strconv.Itoa(kubetest.FreePort(t)) }
	cmDir := filepath.Join(base, "controller-manager")
	mkdir(t, cmDir)
	c.Run(t, cmDir, filepath.Join(bins, kubetest.ControllerManager),
		"--kubeconfig="+c.Kubeconfig, "--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", "--secure-port="+port(), "--leader-elect=false",
		"--service-account-private-key-file="+filepath.Join(c.Dir, "sa.key"),
		"--root-ca-file="+filepath.Join(c.Dir, "certs", "apiserver.crt"),
		"--use-service-account-credentials=false", "--controllers=*",
		"--cert-dir="+filepath.Join(cmDir, "certs"), "--flex-volume-plugin-dir="+filepath.Join(cmDir, "flex"))
	c.Run(t, base, filepath.Join(bins, kubetest.Scheduler),
		"--kubeconfig="+c.Kubeconfig, "--authentication-kubeconfig="+c.Kubeconfig, "--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1", "--secure-port="+port(), "--leader-elect=false")
}

// bridgeConflist is the primary network: bridge + host-local on subnet,
// the allocations in ipamDir.
func bridgeConflist(subnet, ipamDir string) func(string) string {
	return func(string) string {
		b, _ := json.MarshalIndent(map[string]any{
			"cniVersion": "1.0.0", "name": "lane",
			"plugins": []map[string]any{
				{"type": "bridge", "bridge": "aetk8s0", "isGateway": true, "ipMasq": false, "ipam": map[string]any{
					"type": "host-local", "ranges": [][]map[string]string{{{"subnet": subnet}}},
					"routes": []map[string]string{{"dst": "0.0.0.0/0"}}, "dataDir": ipamDir,
				}},
			},
		}, "", "  ")
		return string(b) + "\n"
	}
}

func mkdir(tb testing.TB, dirs ...string) {
	tb.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			tb.Fatal(err)
		}
	}
}

// cgroupRoot is the lane's own cgroup parent for kubelet's kubepods tree
// (named after base), so the lane never touches the machine's /kubepods.
func cgroupRoot(base string) string { return "/" + filepath.Base(base) }

func startKubelet(t *testing.T, n *node) *kubetest.Proc {
	t.Helper()
	// kubelet requires its cgroup root to exist in every hierarchy;
	// removeLeftovers removes the tree.
	ctrls, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, ctrl := range ctrls {
		if ctrl.IsDir() {
			if err := os.Mkdir(filepath.Join("/sys/fs/cgroup", ctrl.Name(), cgroupRoot(n.base)), 0o755); err != nil {
				t.Fatalf("failed to create the lane's cgroup root: %v", err)
			}
		}
	}
	dir := filepath.Join(n.base, "kubelet")
	if n.kubeletRoot == "" {
		n.kubeletRoot = filepath.Join(dir, "root")
	}
	manifests := filepath.Join(dir, "manifests")
	mkdir(t, manifests)
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: %q
failSwapOn: false
staticPodPath: %q
resolvConf: /etc/resolv.conf
containerRuntimeEndpoint: unix://%s
port: %d
healthzBindAddress: 127.0.0.1
healthzPort: %d
readOnlyPort: 0
podLogsDir: %q
volumePluginDir: %q
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "1%%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerWithTaints:
- key: %s
  effect: NoSchedule
`, cgroupRoot(n.base), manifests, n.runtime.Sock, kubetest.FreePort(t), kubetest.FreePort(t), filepath.Join(dir, "pod-logs"), filepath.Join(dir, "volume-plugins"), notReadyTaint)
	cfgPath := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, n.wrap...), filepath.Join(n.bins, kubetest.Kubelet),
		"--config="+cfgPath, "--kubeconfig="+n.kubeconfig,
		"--root-dir="+n.kubeletRoot, "--cert-dir="+filepath.Join(dir, "certs"),
		"--hostname-override="+n.name, "--node-ip="+n.ip, "--v=1",
		"--node-labels="+corev1.LabelTopologyRegion+"="+nodeRegion+","+corev1.LabelTopologyZone+"="+nodeZone+",topology.istio.io/subzone="+nodeSubzone)
	return n.cluster.RunIn(t, n.ns, dir, args...)
}

func waitNodeReady(t *testing.T, n *node) {
	t.Helper()
	kubetest.WaitFor(t, "Node "+n.name+" Ready", 120*time.Second, n.kubelet, func() bool {
		no, err := n.cluster.Client.CoreV1().Nodes().Get(context.Background(), n.name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range no.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	})
}

// hostLeftovers are the directories kubelet creates whatever its flags say
// (recipe point 5), outermost last.
var hostLeftovers = []string{"/var/lib/kubelet/device-plugins", "/var/lib/kubelet", "/var/log/containers", "/var/log/pods"}

// removeLeftovers removes what kubelet leaves outside its directories
// (recipe point 5): its mounts under base (the bind mount of its root dir,
// pod volumes), the lane's cgroup root, the hostLeftovers this lane created
// (fresh; only empty directories, dangling links and kubelet's socket are
// removed), then base.
func removeLeftovers(tb testing.TB, base string, fresh []string) {
	containerd.UnmountUnder(base)
	ctrls, _ := os.ReadDir("/sys/fs/cgroup")
	for _, ctrl := range ctrls {
		removeCgroupTree(filepath.Join("/sys/fs/cgroup", ctrl.Name(), cgroupRoot(base)))
	}
	if err := os.RemoveAll(base); err != nil {
		tb.Errorf("failed to remove %s: %v", base, err)
	}
	for _, d := range fresh {
		removeEmptyTree(d, base)
	}
}

// removeCgroupTree removes a cgroup directory and its children, deepest
// first (cgroup directories are removed with rmdir, never unlink).
func removeCgroupTree(dir string) {
	subs, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, s := range subs {
		if s.IsDir() {
			removeCgroupTree(filepath.Join(dir, s.Name()))
		}
	}
	_ = syscall.Rmdir(dir)
}

// removeEmptyTree removes dir when it holds only empty directories,
// symlinks into base (kubelet's links to the pod logs) and kubelet's own
// socket (never a file someone else wrote).
func removeEmptyTree(dir, base string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		switch {
		case e.IsDir():
			removeEmptyTree(p, base)
		case e.Type()&os.ModeSymlink != 0:
			if to, err := os.Readlink(p); err == nil && strings.HasPrefix(to, base+"/") {
				_ = os.Remove(p)
			}
		case e.Type()&os.ModeSocket != 0 && e.Name() == "kubelet.sock":
			_ = os.Remove(p)
		}
	}
	_ = syscall.Rmdir(dir)
}
