package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"aether.io/node/agent/identity/identitytest"
	"aether.io/node/enivlan"
	"aether.io/node/enivlan/enivlantest"
	"aether.io/node/pkg/capture"
	"aether.io/node/proxy/hbone"
	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// DemoEnv set to 1 runs TestNodeDemo natively (make demo on a kernel with
// 802.1Q). Inside the VM lane (AETHER_VM=1) it always runs.
const DemoEnv = "AETHER_DEMO"

// InVMEnv is set to 1 by test/vm's /init in the guest.
const InVMEnv = "AETHER_VM"

// Report lines the VM lane and scripts/demo.sh look for.
const (
	ReportBanner = "==== aether-node whole-node demo ===="
	ResultPass   = "DEMO RESULT: PASS"
	ResultFail   = "DEMO RESULT: FAIL"
)

// Outcomes are the expected outcomes of the demo, in report order; each
// is printed as "[PASS] <name>" or "[FAIL] <name>".
var Outcomes = []string{
	"node up",
	"pods up",
	"proxy configured over xDS",
	"captured and proxied",
	"mTLS between pods",
	"routed by the fabric",
	"Service over the mesh",
	"authorization policy",
	"unmanaged untouched",
	"bad binding refused",
	"aetherctl pods",
	"aetherctl workloads",
	"teardown",
}

const (
	nodeName   = "demo-node"
	podNS      = "shop"
	serverPort = 8080
	// adminPort is a second port of the server the demo policy does not
	// allow.
	adminPort = 8081
	// proxyAdmin is aether-proxy's admin address inside the node netns.
	proxyAdmin = "127.0.0.1:18090"
	// trustDomain is the SPIFFE trust domain of the demo's identities.
	trustDomain = "cluster.local"
	// hboneport is where the destination pod's proxy serves HBONE.
	hboneport = hbone.DefaultPort
)

// report prints the demo's readable report and turns failed outcomes into
// test errors.
type report struct {
	t      *testing.T
	w      io.Writer
	start  time.Time
	mu     sync.Mutex
	failed []string
	done   map[string]bool
}

func (r *report) printf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fmt.Fprintf(r.w, format+"\n", args...)
}

// check runs one expected outcome and prints its verdict; fn returns a
// one-line detail or the reason it did not happen.
func (r *report) check(name string, fn func() (string, error)) bool {
	r.t.Helper()
	if !slices.Contains(Outcomes, name) {
		r.t.Fatalf("demo bug: outcome %q is not in Outcomes", name)
	}
	r.done[name] = true
	start := time.Now()
	detail, err := fn()
	d := time.Since(start).Round(time.Millisecond)
	if err != nil {
		r.printf("[FAIL] %s (%v): %v", name, d, err)
		r.failed = append(r.failed, name)
		return false
	}
	r.printf("[PASS] %s (%v): %s", name, d, detail)
	return true
}

// skip marks an outcome that could not be tried because an earlier one
// failed; it counts as failed.
func (r *report) skip(name, why string) {
	r.t.Helper()
	r.done[name] = true
	r.printf("[FAIL] %s: not tried: %s", name, why)
	r.failed = append(r.failed, name)
}

func (r *report) finish() {
	for _, o := range Outcomes {
		if !r.done[o] {
			r.failed = append(r.failed, o)
			r.printf("[FAIL] %s: not reached", o)
		}
	}
	d := time.Since(r.start).Round(100 * time.Millisecond)
	if len(r.failed) == 0 {
		r.printf("%s (%d/%d outcomes, %v)", ResultPass, len(Outcomes), len(Outcomes), d)
		return
	}
	r.printf("%s (%d of %d outcomes failed: %s; %v)", ResultFail, len(r.failed), len(Outcomes), strings.Join(r.failed, ", "), d)
	r.t.Errorf("%d of %d expected outcomes did not happen: %s (reasons in the [FAIL] lines above)", len(r.failed), len(Outcomes), strings.Join(r.failed, ", "))
}

// demoPod is one pod of the scenario.
type demoPod struct {
	name    string
	managed bool
	vlan    int
	mac     string
	live    bool // the cloud binding is pushed to the fabric
	ns      *harness.NS
	pod     harness.Pod
	logFile string

	ip        netip.Addr
	prefix    netip.Prefix
	addErr    error
	addTime   time.Duration
	preflight string
	up        bool
	deleted   bool
}

func (p *demoPod) key() string { return podNS + "/" + p.name }

// requireVLAN returns nil when this kernel can create an 802.1Q link (tried
// in a scratch namespace).
func requireVLAN() error {
	n, err := harness.CreateFdNS()
	if err != nil {
		return err
	}
	defer n.Close()
	return n.Do(func() error {
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "dq0"}, PeerName: "dq1"}); err != nil {
			return err
		}
		p, err := netlinksafe.LinkByName("dq0")
		if err != nil {
			return err
		}
		return netlink.LinkAdd(&netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: "dq0.5", ParentIndex: p.Attrs().Index}, VlanId: 5})
	})
}

// optionalBin returns the path of one of this module's commands that may not
// exist yet (built when its package exists; in the VM, from the bin dir).
func optionalBin(t *testing.T, name string) (string, error) {
	if d := os.Getenv(harness.BinDirEnv); d != "" {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s is not in %s (cmd/%s was not built): %w", name, d, name, err)
		}
		return p, nil
	}
	if _, err := os.Stat(filepath.Join(harness.ModuleRoot(), "cmd", name)); err != nil {
		return "", fmt.Errorf("cmd/%s does not exist in this checkout yet", name)
	}
	return filepath.Join(harness.BuildOwn(t, name), name), nil
}

// hasFlag reports whether a command's --help names flag.
func hasFlag(bin, flag string) bool {
	out, _ := exec.Command(bin, "--help").CombinedOutput()
	return strings.Contains(string(out), "-"+flag+" ")
}

// TestNodeDemo is the whole-node demo (issue 7): see the package doc and
// README.md. Every expected outcome is asserted; the report is printed on
// stdout.
func TestNodeDemo(t *testing.T) {
	if os.Getenv(DemoEnv) != "1" && os.Getenv(InVMEnv) != "1" {
		t.Skipf("the whole-node demo runs natively only with %s=1 (make demo) on a kernel with 802.1Q; `go test ./test/demo` runs the same scenario in the qemu VM lane (TestNodeDemoInVM)", DemoEnv)
	}
	harness.RequireRoot(t)
	if err := requireVLAN(); err != nil {
		t.Fatalf("this kernel cannot create 802.1Q VLAN links (%v): run the demo in the VM lane instead (go test -run '^TestNodeDemoInVM$' ./test/demo, or make demo)", err)
	}
	ctx, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()

	r := &report{t: t, w: os.Stdout, start: time.Now(), done: map[string]bool{}}
	where := "natively"
	if os.Getenv(InVMEnv) == "1" {
		where = "inside the qemu VM lane (Debian kernel, 802.1Q)"
	}
	r.printf("%s", ReportBanner)
	r.printf("running %s; CNI chain eni-vlan -> aether-cni driven by libcni", where)
	defer r.finish()
	interrupted := func() {
		if ctx.Err() != nil {
			r.printf("interrupted: tearing everything down")
			t.Fatal("interrupted")
		}
	}

	// ---- the node ----
	var (
		cloud   *enivlantest.Cloud
		agent   *proc
		proxy   *proc
		bins    string
		dir     string
		sock    string
		admin   string
		xdsSock string
		ldsSock string
		hasXDS  bool
		// hbone: the agent issues SPIFFE identities (a CA made at node
		// up) and the proxy tunnels managed-to-managed traffic over HBONE.
		hbone  bool
		pinDir string
		flows  *flowCounters
	)
	ok := r.check("node up", func() (string, error) {
		bins = harness.BuildOwn(t, "eni-vlan", "aether-cni", "aether-agent", "aether-proxy")
		cloud = enivlantest.NewCloud(t, enivlantest.CloudOptions{RealVLAN: true, Network: "demo-eni"})
		// The fabric routes between the VLANs of its subnet, as a VPC
		// gateway does: it forwards, answers ARP for addresses it routes
		// elsewhere (proxy ARP, at once), and gets a host route per pod on
		// that pod's VLAN sub-interface (below). Its anti-spoofing rules
		// are untouched: only bound (IP, MAC, VLAN) senders are answered.
		if err := setSysctls(cloud.Fabric, map[string]string{
			"net.ipv4.ip_forward":             "1",
			"net.ipv4.conf.all.proxy_arp":     "1",
			"net.ipv4.conf.all.rp_filter":     "0",
			"net.ipv4.conf.default.rp_filter": "0",
		}); err != nil {
			return "", err
		}
		var err error
		if flows, err = newFlowCounters(cloud.Fabric); err != nil {
			return "", err
		}
		dir, err = os.MkdirTemp("", "aether-demo-")
		if err != nil {
			return "", err
		}
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
		for _, d := range []string{"run", "pods", "state", "uds", "pins", "logs", "ca"} {
			if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
				return "", err
			}
		}
		pinDir = filepath.Join(dir, "pins")
		t.Cleanup(func() {
			for _, m := range mounts(pinDir) {
				_ = syscall.Unmount(m, syscall.MNT_DETACH)
			}
		})
		sock, admin = filepath.Join(dir, "run", "cni.sock"), filepath.Join(dir, "run", "admin.sock")
		// The proxy's sockets in a directory of their own, as on a node
		// (/run/aether/proxy beside the agent's private /run/aether/agent).
		xdsSock, ldsSock = filepath.Join(dir, "proxy", "xds.sock"), filepath.Join(dir, "proxy", "lds.sock")
		agentBin := filepath.Join(bins, "aether-agent")
		args := []string{
			"--cni-socket", sock, "--admin-socket", admin, "--state-dir", filepath.Join(dir, "state"),
			"--pod-manifests", filepath.Join(dir, "pods"), "--pod-manifests-interval", "200ms", "--node-name", nodeName,
			"--uds-csi-root", filepath.Join(dir, "uds"), "--http-addr", "127.0.0.1:0", "--log-level", "info",
		}
		// Workload discovery (--xds-socket) and the proxy's per-pod
		// listeners (--lds-socket) are served on sockets of their own.
		if hasXDS = hasFlag(agentBin, "xds-socket"); hasXDS {
			args = append(args, "--xds-socket", xdsSock)
		}
		if hasFlag(agentBin, "lds-socket") {
			args = append(args, "--lds-socket", ldsSock)
		} else {
			ldsSock = xdsSock
		}
		// Identities: a CA for the trust domain, so the agent serves each
		// managed pod's SVID over the SPIFFE Workload API and marks the
		// managed workloads HBONE; the proxy then tunnels between them.
		workloadSock := filepath.Join(dir, "proxy", "workload.sock")
		if hbone = hasFlag(agentBin, "ca-cert"); hbone {
			caCert, caKey := identitytest.Files(t, filepath.Join(dir, "ca"), identitytest.Valid(trustDomain))
			args = append(args, "--ca-cert", caCert, "--ca-key", caKey, "--trust-domain", trustDomain, "--workload-api-socket", workloadSock)
		}
		agent = startProc(t, cloud.Node, "aether-agent", agentBin, args...)
		wctx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		if err := waitAgent(wctx, agent, sock); err != nil {
			return "", err
		}
		proxyBin := filepath.Join(bins, "aether-proxy")
		pargs := []string{"--xds-address", "unix://" + xdsSock, "--node-id", nodeName, "--admin-address", proxyAdmin, "--log-level", "info"}
		if hasFlag(proxyBin, "lds-address") {
			pargs = append(pargs, "--lds-address", "unix://"+ldsSock)
		}
		if hbone {
			pargs = append(pargs, "-workload-api-socket", workloadSock)
		}
		proxy = startProc(t, cloud.Node, "aether-proxy", proxyBin, pargs...)
		for {
			code, _, err := httpIn(cloud.Node, proxyAdmin, "/healthz", time.Second)
			if err == nil && code == 200 {
				break
			}
			if proxy.exited() {
				return "", fmt.Errorf("aether-proxy exited at start (%s):\n%s", errString(proxy.err), proxy.tail(20))
			}
			select {
			case <-wctx.Done():
				return "", fmt.Errorf("aether-proxy /healthz on %s not 200 (%d, %s):\n%s", proxyAdmin, code, errString(err), proxy.tail(20))
			case <-time.After(50 * time.Millisecond):
			}
		}
		xds := fmt.Sprintf("agent serves workloads on %s and listeners on %s", xdsSock, ldsSock)
		if hbone {
			xds += fmt.Sprintf("; it issues SPIFFE identities of trust domain %s (CA made for the demo) on %s", trustDomain, workloadSock)
		}
		if !hasXDS {
			xds = "agent has NO --xds-socket flag (xDS not served yet)"
		}
		return fmt.Sprintf("fabric %s (gateway %s, VLAN sub-interfaces, anti-spoofing), master %s in %s, spiderpool-agent %s, aether-agent pid %d, aether-proxy pid %d; %s",
			cloud.Fabric.Name, cloud.Gateway4, cloud.Master, cloud.Node.Name, cloud.Agent.Socket, agent.cmd.Process.Pid, proxy.cmd.Process.Pid, xds), nil
	})
	if !ok {
		for _, o := range Outcomes[1:] {
			r.skip(o, "the node did not come up")
		}
		return
	}
	interrupted()

	// ---- the pods ----
	pods := []*demoPod{
		{name: "client", managed: true, vlan: 100, mac: "02:ae:00:00:00:64", live: true},
		{name: "server", managed: true, vlan: 200, mac: "02:ae:00:00:00:c8", live: true},
		{name: "legacy", managed: false, vlan: 300, mac: "02:ae:00:00:01:2c", live: true},
		{name: "ghost", managed: true, vlan: 400, mac: "02:ae:00:00:01:90", live: false},
	}
	client, server, legacy, ghost := pods[0], pods[1], pods[2], pods[3]
	conf := harness.ConfList(t, "demo-eni", "1.1.0",
		cloud.PluginConf(map[string]any{"validationRetries": 3, "validationTimeoutMs": 300, "endpointTimeoutMs": 3000}),
		map[string]any{
			"type": "aether-cni", "agent_socket": sock, "agent_timeout_ms": 3000,
			"netns_pin_dir": pinDir, "netns_unpin_delay_seconds": 0, "cri_socket": "",
			"readiness_probe_budget_ms": 3000,
			// Capture every outbound TCP/UDP connection of a managed pod
			// (replies of the pod's own inbound connections are left alone).
			"capture":  map[string]any{"redirect_all": true},
			"log_file": filepath.Join(dir, "logs", "aether-cni.log"), "log_level": "info",
		})
	rt := harness.NewRuntime(t, cloud.Node, []string{bins, harness.ReferencePlugins(t)}, conf)
	for _, p := range pods {
		p.ns = harness.NewNS(t, "pod")
		p.pod = harness.Pod{ContainerID: harness.ContainerID(), NetNS: p.ns.Path(), Name: p.name, Namespace: podNS, UID: "uid-" + p.name}
		p.logFile = filepath.Join(dir, "logs", "eni-vlan-"+p.name+".log")
		if err := writePodManifest(filepath.Join(dir, "pods"), nodeName, podNS, p.name, p.pod.UID, p.managed); err != nil {
			t.Fatal(err)
		}
		cloud.Bind(p.pod, enivlantest.Binding{VLAN: p.vlan, MAC: p.mac, NotEffective: !p.live})
		t.Cleanup(func() {
			if !p.deleted {
				if err := rt.Del(context.Background(), p.pod); err != nil {
					t.Errorf("cleanup DEL %s: %v", p.key(), err)
				}
			}
		})
	}

	r.check("pods up", func() (string, error) {
		for _, p := range pods {
			t.Setenv(enivlan.LogFileEnv, p.logFile)
			t.Setenv(enivlan.LogLevelEnv, "info")
			start := time.Now()
			res, err := rt.Add(ctx, p.pod)
			p.addTime = time.Since(start)
			p.addErr = err
			if err != nil {
				continue
			}
			cr, err := current.NewResultFromResult(res)
			if err != nil {
				p.addErr = err
				continue
			}
			for _, ipc := range cr.IPs {
				if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok && a.Unmap().Is4() {
					p.ip = a.Unmap()
					ones, _ := ipc.Address.Mask.Size()
					p.prefix = netip.PrefixFrom(p.ip, ones)
				}
			}
			p.preflight = preflightFromLog(p.logFile)
			p.up = true
			if p.ip.IsValid() {
				if err := routeHost(cloud.Fabric, p.ip, fabricVLANLink(p.vlan)); err != nil {
					p.addErr = err
				}
			}
		}
		r.printf("  %-12s %-8s %-14s %-5s %-18s %-8s %s", "POD", "MANAGED", "IP", "VLAN", "MAC", "ADD", "PRE-FLIGHT")
		var problems []string
		for _, p := range pods {
			vid, mac := vlanLink(p.ns, "eth0")
			ip, pre := "-", p.preflight
			if p.prefix.IsValid() {
				ip = p.prefix.String()
			}
			if p.addErr != nil {
				pre = "refused: " + p.addErr.Error()
			}
			vlanS, macS := fmt.Sprint(vid), mac
			if vid == 0 {
				vlanS, macS = fmt.Sprintf("(%d)", p.vlan), "("+p.mac+")"
			}
			r.printf("  %-12s %-8v %-14s %-5s %-18s %-8v %s", p.key(), p.managed, ip, vlanS, macS, p.addTime.Round(time.Millisecond), pre)
			if !p.live {
				continue
			}
			switch {
			case p.addErr != nil:
				problems = append(problems, fmt.Sprintf("%s: ADD failed: %v", p.key(), p.addErr))
			case !p.ip.IsValid() || !cloud.Gateway4.Contains(p.ip):
				problems = append(problems, fmt.Sprintf("%s: no IPv4 address in %s in the result", p.key(), cloud.Gateway4.Masked()))
			case vid != p.vlan || mac != p.mac:
				problems = append(problems, fmt.Sprintf("%s: eth0 is VLAN %d MAC %q, want a real 802.1Q link VLAN %d MAC %s", p.key(), vid, mac, p.vlan, p.mac))
			case !strings.Contains(p.preflight, "ok"):
				problems = append(problems, fmt.Sprintf("%s: the pre-flight did not report ok (%q)", p.key(), p.preflight))
			}
		}
		if len(problems) > 0 {
			return "", fmt.Errorf("%s", strings.Join(problems, "; "))
		}
		return "client, server and legacy up on real 802.1Q links with the cloud MACs, each pre-flight answered by the fabric gateway", nil
	})
	interrupted()

	// ---- the proxy's configuration ----
	proxied := r.check("proxy configured over xDS", func() (string, error) {
		if !hasXDS {
			return "", fmt.Errorf("aether-agent does not serve xDS yet (no --xds-socket flag), so aether-proxy got no Listener or Workload resources and binds nothing in the pods")
		}
		if !client.up || !server.up {
			return "", fmt.Errorf("the managed pods are not up")
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			c1, _, err1 := httpIn(client.ns, "127.0.0.1:18081", "/aether/readyz", time.Second)
			c2, _, err2 := httpIn(server.ns, "127.0.0.1:18081", "/aether/readyz", time.Second)
			if err1 == nil && err2 == nil && c1 == 200 && c2 == 200 {
				recs, err := adminPods(admin)
				if err != nil {
					return "", err
				}
				for _, p := range []*demoPod{client, server} {
					i := slices.IndexFunc(recs, func(a adminPod) bool { return a.Namespace == podNS && a.Name == p.name })
					if i < 0 {
						return "", fmt.Errorf("the agent has no record of %s", p.key())
					}
					if e := recs[i].LastTimings["readiness_probe_error"]; e != "" || recs[i].LastTimings["readiness_probe"] == "" {
						return "", fmt.Errorf("aether-cni's readiness probe of %s during ADD did not pass (%q): the proxy was not serving the pod in time", p.key(), e)
					}
				}
				return "the agent's listeners reached aether-proxy, which answered aether-cni's readiness probe during ADD and serves /aether/readyz (200) inside the client and server pods", nil
			}
			if time.Now().After(deadline) {
				return "", fmt.Errorf("readiness inside the pods: client %d %s, server %d %s; proxy log:\n%s", c1, errString(err1), c2, errString(err2), proxy.tail(15))
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	interrupted()

	// ---- the managed client's connection to the server ----
	var echo *echoServer
	if server.up {
		var err error
		if echo, err = startEcho(t, server.ns, serverPort); err != nil {
			t.Error(err)
		}
		if client.up {
			if err := flows.add("client->server", client.ip, server.ip, serverPort); err != nil {
				t.Error(err)
			}
			if err := flows.add("client->server:hbone", client.ip, server.ip, hboneport); err != nil {
				t.Error(err)
			}
		}
		if legacy.up {
			if err := flows.add("legacy->server", legacy.ip, server.ip, serverPort); err != nil {
				t.Error(err)
			}
		}
	}
	metrics := func() ([]Metric, error) {
		code, body, err := httpIn(cloud.Node, proxyAdmin, "/metrics", 2*time.Second)
		if err != nil || code != 200 {
			return nil, fmt.Errorf("aether-proxy /metrics: %d %s", code, errString(err))
		}
		return parseMetrics(body), nil
	}
	pair := map[string]string{
		"source_workload": "client", "source_workload_namespace": podNS,
		"destination_workload": "server", "destination_workload_namespace": podNS,
	}
	if client.up && server.up && echo != nil {
		r.check("captured and proxied", func() (string, error) {
			if !proxied {
				r.printf("  (the proxy is not configured: the divert sends the connection to a capture port nobody serves)")
			}
			dst := netip.AddrPortFrom(server.ip, serverPort)
			answer, talkErr := talk(client.ns, dst, "hello from shop/client")
			if talkErr == nil {
				r.printf("  shop/client -> %s: %s", dst, answer)
			}
			recs, err := adminPods(admin)
			if err != nil {
				return "", err
			}
			for _, p := range []*demoPod{client, server} {
				i := slices.IndexFunc(recs, func(a adminPod) bool { return a.Namespace == podNS && a.Name == p.name })
				switch {
				case i < 0:
					return "", fmt.Errorf("the agent has no record of %s", p.key())
				case recs[i].Uncaptured:
					return "", fmt.Errorf("aether-cni could not install the capture divert in %s (the agent records it UNCAPTURED: %s)", p.key(), recs[i].UncapturedError)
				}
			}
			for _, p := range []*demoPod{client, server} {
				present, err := (capture.Installer{}).Present(p.pod.NetNS)
				if err != nil {
					return "", fmt.Errorf("failed to read the nftables of %s: %w", p.key(), err)
				}
				if !present {
					return "", fmt.Errorf("no capture table inet %s in %s", capture.TableName, p.key())
				}
			}
			if talkErr != nil {
				return "", fmt.Errorf("shop/client -> %s: %w", dst, talkErr)
			}
			// Over HBONE the destination proxy delivers from inside the
			// server pod with the client's address as source (the
			// divert's deliver rule routes the app's replies back to it),
			// so the app sees the client, as without the mesh.
			if !slices.Contains(echo.seen(), client.ip) {
				return "", fmt.Errorf("the server saw peers %v, not the client's address %s", echo.seen(), client.ip)
			}
			var ms []Metric
			deadline := time.Now().Add(10 * time.Second)
			for {
				ms, err = metrics()
				if err == nil && sum(ms, "istio_tcp_connections_closed_total", pair) >= 1 {
					break
				}
				if time.Now().After(deadline) {
					return "", fmt.Errorf("the connection worked but aether-proxy did not count it as client -> server (so it was not captured): %s; istio_tcp_connections_* samples: %v", errString(err), tcpSamples(ms))
				}
				time.Sleep(100 * time.Millisecond)
			}
			r.printf("  aether-proxy /metrics {source_workload=%q,source_workload_namespace=%q,destination_workload=%q,destination_workload_namespace=%q}:",
				pair["source_workload"], pair["source_workload_namespace"], pair["destination_workload"], pair["destination_workload_namespace"])
			r.printf("    istio_tcp_connections_opened_total %g, istio_tcp_connections_closed_total %g, istio_tcp_received_bytes_total %g, istio_tcp_sent_bytes_total %g (both reporters: source and destination), aether_tcp_connection_duration_seconds_sum %.3f",
				sum(ms, "istio_tcp_connections_opened_total", pair), sum(ms, "istio_tcp_connections_closed_total", pair),
				sum(ms, "istio_tcp_received_bytes_total", pair), sum(ms, "istio_tcp_sent_bytes_total", pair),
				sum(ms, "aether_tcp_connection_duration_seconds_sum", nil))
			if sum(ms, "istio_tcp_received_bytes_total", pair) == 0 || sum(ms, "istio_tcp_sent_bytes_total", pair) == 0 {
				return "", fmt.Errorf("aether-proxy counted the connection but no bytes both ways")
			}
			via := "plain"
			if hbone {
				via = "HBONE"
				preserved := sum(ms, "aether_inbound_source_total", map[string]string{"outcome": "preserved"})
				fallback := sum(ms, "aether_inbound_source_total", map[string]string{"outcome": "fallback"})
				r.printf("    aether_inbound_source_total{outcome=\"preserved\"} %g, {outcome=\"fallback\"} %g", preserved, fallback)
				if preserved < 1 {
					return "", fmt.Errorf("the server saw the client's address but aether-proxy counted no preserved-source delivery (fallback %g)", fallback)
				}
			}
			r.printf("  shop/server's app saw the connection from %s (shop/client's own address, delivered over %s)", client.ip, via)
			return fmt.Sprintf("both managed pods hold the divert; the client's connection was diverted into aether-proxy in its netns, forwarded to the (captured) server over %s, counted with both workloads named, and the server saw the client's address %s (source preserved)", via, client.ip), nil
		})
		r.check("mTLS between pods", func() (string, error) {
			if !hbone {
				return "", errors.New("aether-agent has no --ca-cert flag: no identities, no HBONE")
			}
			clientID := "spiffe://" + trustDomain + "/ns/" + podNS + "/sa/" + client.name
			serverID := "spiffe://" + trustDomain + "/ns/" + podNS + "/sa/" + server.name
			ms, err := metrics()
			if err != nil {
				return "", err
			}
			// The client's side presented its SVID and verified the
			// server's; the server's side verified the client's.
			out := maps.Clone(pair)
			out["reporter"], out["source_principal"], out["destination_principal"] = "source", clientID, serverID
			out["connection_security_policy"] = "mutual_tls"
			in := maps.Clone(pair)
			in["reporter"], in["source_principal"], in["destination_principal"] = "destination", clientID, serverID
			in["connection_security_policy"] = "mutual_tls"
			if sum(ms, "istio_tcp_connections_opened_total", out) < 1 || sum(ms, "istio_tcp_connections_opened_total", in) < 1 {
				return "", fmt.Errorf("aether-proxy did not count the client -> server connection as HBONE with both identities (outbound %v, inbound %v); samples: %v",
					out, in, tcpSamples(ms))
			}
			r.printf("  outbound (client's proxy): source_principal=%q destination_principal=%q (verified), %g bytes sent",
				clientID, serverID, sum(ms, "istio_tcp_received_bytes_total", out))
			r.printf("  inbound (server's :%d): source_principal=%q (verified client SVID), delivered to the app on :%d", hboneport, clientID, serverPort)
			// On the wire between the pods: only :15008 (TLS) carried it.
			pk, err := flows.packets()
			if err != nil {
				return "", err
			}
			if pk["client->server:hbone"] == 0 || pk["client->server:hbone/reply"] == 0 {
				return "", fmt.Errorf("the fabric forwarded %d packets client -> server:%d and %d back, want both > 0", pk["client->server:hbone"], hboneport, pk["client->server:hbone/reply"])
			}
			if pk["client->server"] != 0 {
				return "", fmt.Errorf("the fabric forwarded %d plaintext packets client -> server:%d: the connection was not tunnelled", pk["client->server"], serverPort)
			}
			return fmt.Sprintf("client -> server:%d went over HBONE (HTTP/2 CONNECT in mutual TLS on :%d, %d packets across the fabric, none to :%d), each side verified the other's SPIFFE identity: %s -> %s",
				serverPort, hboneport, pk["client->server:hbone"], serverPort, clientID, serverID), nil
		})
		r.check("routed by the fabric", func() (string, error) {
			pk, err := flows.packets()
			if err != nil {
				return "", err
			}
			there, back, port := pk["client->server"], pk["client->server/reply"], uint16(serverPort)
			if hbone {
				there, back, port = pk["client->server:hbone"], pk["client->server:hbone/reply"], hboneport
			}
			if there == 0 || back == 0 {
				return "", fmt.Errorf("the fabric forwarded %d packets client -> server:%d and %d back, want both > 0", there, port, back)
			}
			return fmt.Sprintf("the fabric gateway routed VLAN %d -> VLAN %d: %d packets client -> server:%d, %d back",
				client.vlan, server.vlan, there, port, back), nil
		})
		r.check("Service over the mesh", func() (string, error) {
			if !hbone {
				return "", errors.New("aether-agent has no --ca-cert flag: no identities, no HBONE")
			}
			// A ClusterIP Service selecting the server, in the agent's
			// manifest directory; no kube-proxy runs here, so only the
			// proxy can make the VIP work.
			if err := writeServiceManifest(filepath.Join(dir, "pods"), podNS, "web", serviceVIP.Addr().String(), serviceVIP.Port(), serverPort, map[string]string{"app": server.name}); err != nil {
				return "", err
			}
			if err := flows.add("client->vip", client.ip, serviceVIP.Addr(), serviceVIP.Port()); err != nil {
				return "", err
			}
			pk0, err := flows.packets()
			if err != nil {
				return "", err
			}
			var answer string
			deadline := time.Now().Add(20 * time.Second)
			for {
				// The agent rescans its manifests every 200 ms and pushes
				// the Service; until the proxy has it, the VIP is unknown.
				if answer, err = talk(client.ns, serviceVIP, "hello web.shop.svc"); err == nil {
					break
				}
				if time.Now().After(deadline) {
					return "", fmt.Errorf("shop/client -> %s (Service web): %w; proxy log:\n%s", serviceVIP, err, proxy.tail(15))
				}
				time.Sleep(200 * time.Millisecond)
			}
			r.printf("  shop/client -> %s (web.%s.svc.cluster.local): %s", serviceVIP, podNS, answer)
			ms, err := metrics()
			if err != nil {
				return "", err
			}
			viaHBONE := sum(ms, "aether_outbound_connections_total", map[string]string{"path": "service_hbone"})
			if viaHBONE < 1 {
				return "", fmt.Errorf("the VIP answered but aether-proxy counted no service_hbone connection: %v", tcpSamples(ms))
			}
			pk, err := flows.packets()
			if err != nil {
				return "", err
			}
			if pk["client->vip"] != 0 {
				return "", fmt.Errorf("%d packets to the VIP %s crossed the fabric: the proxy did not resolve it", pk["client->vip"], serviceVIP)
			}
			tunnelled := pk["client->server:hbone"] - pk0["client->server:hbone"]
			if tunnelled == 0 {
				return "", fmt.Errorf("no HBONE packets client -> server:%d while the Service answered", hboneport)
			}
			r.printf("  aether_outbound_connections_total{path=\"service_hbone\"} %g; %d packets to :%d across the fabric, none to the VIP", viaHBONE, tunnelled, hboneport)
			// Istio's series name the Service on both sides: the source
			// (the client's proxy balanced through it) and the destination
			// (the server's workload serves the target port for it).
			svc := map[string]string{
				"source_workload": client.name, "destination_workload": server.name,
				"destination_service": "web." + podNS + ".svc.cluster.local", "destination_service_name": "web",
				"destination_service_namespace": podNS, "connection_security_policy": "mutual_tls",
			}
			for _, reporter := range []string{"source", "destination"} {
				svc["reporter"] = reporter
				n := sum(ms, "istio_tcp_connections_opened_total", svc)
				if n < 1 {
					return "", fmt.Errorf("aether-proxy counted no connection with %v: %v", svc, tcpSamples(ms))
				}
				r.printf("  istio_tcp_connections_opened_total{reporter=%q,destination_service=%q} %g", reporter, svc["destination_service"], n)
			}
			return fmt.Sprintf("the client dialled the ClusterIP %s; its proxy resolved the Service from workload discovery (istio.workload.Address), chose the endpoint %s/%s (%s:%d) and tunnelled over HBONE to %s:%d in mutual TLS (the VIP never reached the wire)",
				serviceVIP, podNS, server.name, server.ip, serverPort, server.ip, hboneport), nil
		})
		r.check("authorization policy", func() (string, error) {
			if !hbone {
				return "", errors.New("aether-agent has no --ca-cert flag: no identities, no policy by principal")
			}
			if _, err := startEcho(t, server.ns, adminPort); err != nil {
				return "", err
			}
			allowed, denied := netip.AddrPortFrom(server.ip, serverPort), netip.AddrPortFrom(server.ip, adminPort)
			if _, err := talk(client.ns, denied, "before the policy"); err != nil {
				return "", fmt.Errorf("shop/client -> %s before any policy: %w", denied, err)
			}
			// Istio's own YAML: only shop/client's service account, only :8080.
			path := filepath.Join(dir, "pods", "shop_policy.yaml")
			if err := os.WriteFile(path, []byte(demoPolicy), 0o600); err != nil {
				return "", err
			}
			deadline := time.Now().Add(20 * time.Second)
			for {
				// The agent rescans every 200 ms and pushes the policy.
				if _, err := talk(client.ns, denied, "after the policy"); err != nil {
					break
				}
				if time.Now().After(deadline) {
					return "", fmt.Errorf("shop/client -> %s still answered 20 s after the policy was written; proxy log:\n%s", denied, proxy.tail(15))
				}
				time.Sleep(200 * time.Millisecond)
			}
			answer, err := talk(client.ns, allowed, "allowed by shop/server-ingress")
			if err != nil {
				return "", fmt.Errorf("shop/client -> %s (allowed by the policy): %w", allowed, err)
			}
			ms, err := metrics()
			if err != nil {
				return "", err
			}
			refused := sum(ms, "aether_policy_denials_total", map[string]string{"reason": "no_allow_match"})
			if refused < 1 {
				return "", fmt.Errorf("the connection to %s was refused but aether_policy_denials_total{reason=\"no_allow_match\"} is %g", denied, refused)
			}
			// The policy goes: the port answers again.
			if err := os.Remove(path); err != nil {
				return "", err
			}
			for deadline = time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
				if _, err := talk(client.ns, denied, "the policy is gone"); err == nil {
					break
				}
				if time.Now().After(deadline) {
					return "", fmt.Errorf("shop/client -> %s still refused 20 s after the policy was removed", denied)
				}
			}
			r.printf("  AuthorizationPolicy shop/server-ingress: ALLOW from principals [%s/ns/shop/sa/client] to ports [%d]", trustDomain, serverPort)
			r.printf("  shop/client -> %s: %s (allowed)", allowed, answer)
			r.printf("  shop/client -> %s: refused by the server's proxy before its app saw a byte; aether_policy_denials_total{reason=\"no_allow_match\"} %g", denied, refused)
			return fmt.Sprintf("an Istio AuthorizationPolicy from the manifest directory reached the server's proxy as istio.security.Authorization: client -> server:%d allowed (its verified principal and the port match), client -> server:%d refused, and answering again once the policy was removed", serverPort, adminPort), nil
		})
	} else {
		r.skip("captured and proxied", "client or server is not up")
		r.skip("mTLS between pods", "client or server is not up")
		r.skip("routed by the fabric", "client or server is not up")
		r.skip("Service over the mesh", "client or server is not up")
		r.skip("authorization policy", "client or server is not up")
	}
	interrupted()

	// ---- the unmanaged pod ----
	if legacy.up && server.up && echo != nil {
		r.check("unmanaged untouched", func() (string, error) {
			present, err := (capture.Installer{}).Present(legacy.pod.NetNS)
			if err != nil {
				return "", err
			}
			if present {
				return "", fmt.Errorf("the unmanaged pod has the capture table inet %s", capture.TableName)
			}
			rules, err := fwmarkRules(legacy.ns)
			if err != nil {
				return "", err
			}
			if len(rules) > 0 {
				return "", fmt.Errorf("the unmanaged pod has capture policy routing: %v", rules)
			}
			recs, err := adminPods(admin)
			if err != nil {
				return "", err
			}
			for _, rec := range recs {
				if rec.Namespace == podNS && rec.Name == legacy.name {
					return "", fmt.Errorf("the agent holds a managed record for the unmanaged pod: %+v", rec)
				}
			}
			before, _ := metrics()
			dst := netip.AddrPortFrom(server.ip, serverPort)
			answer, err := talk(legacy.ns, dst, "hello from shop/legacy")
			if err != nil {
				return "", fmt.Errorf("shop/legacy -> %s: %w", dst, err)
			}
			r.printf("  shop/legacy -> %s: %s", dst, answer)
			pk, err := flows.packets()
			if err != nil {
				return "", err
			}
			if pk["legacy->server"] == 0 {
				return "", fmt.Errorf("the legacy pod's connection did not cross the fabric")
			}
			after, _ := metrics()
			if b, a := sum(before, "istio_tcp_connections_opened_total", nil), sum(after, "istio_tcp_connections_opened_total", nil); a != b {
				return "", fmt.Errorf("aether-proxy's opened connections went from %g to %g: the unmanaged pod's connection was proxied", b, a)
			}
			return fmt.Sprintf("no capture table, no fwmark rules, no agent record; its connection went straight through the fabric (%d packets), not through the proxy", pk["legacy->server"]), nil
		})
	} else {
		r.skip("unmanaged untouched", "legacy or server is not up")
	}
	interrupted()

	// ---- the pod whose cloud binding is not live ----
	r.check("bad binding refused", func() (string, error) {
		addErr := ghost.addErr
		if addErr == nil {
			return "", fmt.Errorf("ADD of %s succeeded although its binding is not in the fabric", ghost.key())
		}
		if cniCode(addErr) != 11 || !strings.Contains(addErr.Error(), "cloud binding not effective") || !strings.Contains(addErr.Error(), fmt.Sprintf("VLAN %d", ghost.vlan)) {
			return "", fmt.Errorf("ADD failed with code %d (%w), want code 11 naming the binding not effective and VLAN %d", cniCode(addErr), addErr, ghost.vlan)
		}
		var leaks []string
		if v4, _ := cloud.Allocated(ghost.pod.ContainerID); v4 != "" {
			leaks = append(leaks, "host-local still holds "+v4)
		}
		if vid, _ := vlanLink(ghost.ns, "eth0"); vid != 0 {
			leaks = append(leaks, fmt.Sprintf("VLAN %d link left in the pod", vid))
		}
		if devs, err := vlanDevices(cloud.Node); err != nil || len(devs) > 0 {
			leaks = append(leaks, fmt.Sprintf("VLAN devices in the node netns: %v %v", devs, err))
		}
		for _, rec := range cloud.Records() {
			if strings.Contains(rec, fmt.Sprint(ghost.vlan)) {
				leaks = append(leaks, "eni-vlan ownership record "+rec)
			}
		}
		recs, err := adminPods(admin)
		if err != nil {
			return "", err
		}
		for _, rec := range recs {
			if rec.Name == ghost.name {
				leaks = append(leaks, "agent record "+rec.ContainerID)
			}
		}
		if _, err := os.Stat(filepath.Join(pinDir, ghost.pod.ContainerID)); err == nil {
			leaks = append(leaks, "netns pin")
		}
		if len(leaks) > 0 {
			return "", fmt.Errorf("refused, but leaked: %s", strings.Join(leaks, "; "))
		}
		r.printf("  %s: CNI error code %d: %v", ghost.key(), cniCode(addErr), addErr)
		return "refused with code 11 before any IP was configured; no IP, link, record, pin or agent state left", nil
	})
	interrupted()

	// ---- the CLI ----
	r.check("aetherctl pods", func() (string, error) {
		recs, err := adminPods(admin)
		if err != nil {
			return "", err
		}
		for _, p := range []*demoPod{client, server} {
			i := slices.IndexFunc(recs, func(a adminPod) bool { return a.Namespace == podNS && a.Name == p.name })
			if i < 0 {
				return "", fmt.Errorf("the agent has no record of %s", p.key())
			}
			if recs[i].LastTimings["total"] == "" {
				return "", fmt.Errorf("the agent's record of %s has no timings from aether-cni: %v", p.key(), recs[i].LastTimings)
			}
		}
		bin, err := optionalBin(t, "aetherctl")
		if err != nil {
			return "", err
		}
		out, err := exec.CommandContext(ctx, bin, "pods", "--admin-socket", admin).CombinedOutput()
		r.printf("  $ aetherctl pods\n%s", indent(string(out)))
		if err != nil {
			return "", fmt.Errorf("aetherctl pods: %w", err)
		}
		for _, want := range []string{client.name, server.name} {
			if !strings.Contains(string(out), want) {
				return "", fmt.Errorf("aetherctl pods does not list %s", want)
			}
		}
		for _, p := range []*demoPod{client, server} {
			out, err := exec.CommandContext(ctx, bin, "pod", "--admin-socket", admin, p.key()).CombinedOutput()
			if err != nil {
				return "", fmt.Errorf("aetherctl pod %s: %w\n%s", p.key(), err, out)
			}
			var timings []string
			for _, l := range strings.Split(string(out), "\n") {
				if strings.HasPrefix(l, "Last ") || strings.HasPrefix(l, "Uncaptured:") {
					timings = append(timings, l)
				}
			}
			r.printf("  $ aetherctl pod %s   (timings)\n%s", p.key(), indent(strings.Join(timings, "\n")))
			if !strings.Contains(string(out), "Last total:") {
				return "", fmt.Errorf("aetherctl pod %s shows no total timing", p.key())
			}
		}
		return "lists both managed pods; aetherctl pod shows aether-cni's timings", nil
	})
	r.check("aetherctl workloads", func() (string, error) {
		if !hasXDS {
			return "", fmt.Errorf("aether-agent does not serve xDS yet (no --xds-socket flag): there are no workloads to list")
		}
		bin, err := optionalBin(t, "aetherctl")
		if err != nil {
			return "", err
		}
		out, err := exec.CommandContext(ctx, bin, "workloads", "--xds-socket", xdsSock).CombinedOutput()
		r.printf("  $ aetherctl workloads\n%s", indent(string(out)))
		if err != nil {
			return "", fmt.Errorf("aetherctl workloads: %w", err)
		}
		for _, p := range []*demoPod{client, server} {
			if !strings.Contains(string(out), p.ip.String()) {
				return "", fmt.Errorf("aetherctl workloads does not list %s (%s)", p.key(), p.ip)
			}
		}
		if legacy.ip.IsValid() && strings.Contains(string(out), legacy.ip.String()) {
			return "", fmt.Errorf("aetherctl workloads lists the unmanaged pod")
		}
		return "both managed pods are workloads with their addresses; the unmanaged pod is not", nil
	})
	interrupted()

	// ---- teardown ----
	r.check("teardown", func() (string, error) {
		var errs []string
		for i := len(pods) - 1; i >= 0; i-- {
			p := pods[i]
			if err := rt.Del(ctx, p.pod); err != nil {
				errs = append(errs, fmt.Sprintf("DEL %s: %v", p.key(), err))
				continue
			}
			p.deleted = true
		}
		if a := harness.Allocations(t, cloud.IPAMDir, cloud.Network); len(a) > 0 {
			errs = append(errs, fmt.Sprintf("host-local still holds %v", a))
		}
		for _, n := range []*harness.NS{cloud.Node, client.ns, server.ns, legacy.ns, ghost.ns} {
			if devs, err := vlanDevices(n); err != nil || len(devs) > 0 {
				errs = append(errs, fmt.Sprintf("VLAN devices left in %s: %v %v", n.Name, devs, err))
			}
		}
		if recs := cloud.Records(); len(recs) > 0 {
			errs = append(errs, fmt.Sprintf("eni-vlan ownership records left: %v", recs))
		}
		if recs, err := adminPods(admin); err != nil || len(recs) > 0 {
			errs = append(errs, fmt.Sprintf("agent records left: %v %v", recs, err))
		}
		deadline := time.Now().Add(5 * time.Second)
		for len(mounts(pinDir)) > 0 && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if m := mounts(pinDir); len(m) > 0 {
			errs = append(errs, fmt.Sprintf("netns pins left: %v", m))
		}
		if hasXDS {
			var serving float64 = -1
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
				if ms, err := metrics(); err == nil {
					if serving = sum(ms, "aether_proxy_pods_serving", nil); serving == 0 {
						break
					}
				}
			}
			if serving != 0 {
				errs = append(errs, fmt.Sprintf("aether-proxy still serves %g pods after every DEL (aether_proxy_pods_serving)", serving))
			}
		}
		if agent.exited() {
			errs = append(errs, fmt.Sprintf("aether-agent died during the demo: %v\n%s", agent.err, agent.tail(20)))
		}
		if proxy.exited() {
			errs = append(errs, fmt.Sprintf("aether-proxy died during the demo: %v\n%s", proxy.err, proxy.tail(20)))
		}
		if len(errs) > 0 {
			return "", fmt.Errorf("%s", strings.Join(errs, "; "))
		}
		return "DEL of every pod; no IP, VLAN device, ownership record, agent record, pin or proxy listener left (daemons and namespaces are removed next)", nil
	})
}

func tcpSamples(ms []Metric) []string {
	var out []string
	for _, m := range ms {
		if strings.HasPrefix(m.Name, "istio_tcp_connections") {
			out = append(out, fmt.Sprintf("%s%v=%g", m.Name, m.Labels, m.Value))
		}
	}
	return out
}

// errString renders a possibly nil error.
func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = "    " + l
	}
	return strings.Join(lines, "\n")
}
