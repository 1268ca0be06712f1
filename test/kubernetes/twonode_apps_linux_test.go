package kubernetes_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	workloadclient "aether.io/node/xds/workload/client"
)

const (
	// serverNamespace holds the backends, with PeerAuthentication STRICT
	// for the whole namespace: plaintext reaching a managed backend (its
	// inbound capture is on) is refused, so an answer means mTLS.
	serverNamespace = "strict"
	// clientPrincipal is the client's SPIFFE ID (service account default
	// of appNamespace), as the backends' proxies verify it.
	clientPrincipal = "spiffe://cluster.local/ns/" + appNamespace + "/sa/default"
	// laneLine is what every lane connection sends and expects back.
	laneLine = "hello across the nodes\n"
	// backendLinger is how long a deleted backend keeps answering.
	backendLinger = 15 * time.Second
)

// laneApps are the two-node lane's workloads and Services.
type laneApps struct {
	client   corev1.Pod
	clientNS string // the client's netns (on node A)
	// backendVIP, plainVIP and emptyVIP are the ClusterIP:80 of the
	// Services of the managed backends, of the unmanaged server and of no
	// endpoint at all.
	backendVIP, plainVIP, emptyVIP string
}

// deployTwoNodeApps creates the namespaces (STRICT in serverNamespace), a
// managed client on node A, the managed backend Deployment (two replicas
// spread over the nodes; each answers with its pod's name first and keeps
// serving backendLinger after SIGTERM), an unmanaged server on node B,
// and the Services backend, plainsrv and empty.
func deployTwoNodeApps(t *testing.T, tn *twoNodes) *laneApps {
	t.Helper()
	c, kubelet := tn.cluster, tn.nodes[0].kubelet
	ctx := context.Background()
	createNamespaceIn(t, c, kubelet, appNamespace)
	createNamespaceIn(t, c, kubelet, serverNamespace)
	applyIstioIn(t, c.Config, serverNamespace, "peerauthentications", `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict}
spec:
  mtls: {mode: STRICT}
`)
	onNode := func(name string) map[string]string { return map[string]string{corev1.LabelHostname: name} }
	named := func(d *corev1.PodSpec) {
		ct := &d.Containers[0]
		ct.Env = append(ct.Env, corev1.EnvVar{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}})
		ct.Args = append(ct.Args, "-tcp-greeting=$(POD_NAME)")
	}
	client := echoDeployment(appNamespace, "client", true, 1)
	client.Spec.Template.Spec.NodeSelector = onNode(tn.nodes[0].name)
	backend := echoDeployment(serverNamespace, "backend", true, 2)
	spec := &backend.Spec.Template.Spec
	named(spec)
	spec.Containers[0].Args = append(spec.Containers[0].Args, "-linger="+backendLinger.String())
	grace := int64(2 * backendLinger / time.Second)
	spec.TerminationGracePeriodSeconds = &grace
	spec.TopologySpreadConstraints = []corev1.TopologySpreadConstraint{{
		MaxSkew: 1, TopologyKey: corev1.LabelHostname, WhenUnsatisfiable: corev1.DoNotSchedule,
		LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "backend"}},
	}}
	plain := echoDeployment(appNamespace, "plainsrv", false, 1)
	plain.Spec.Template.Spec.NodeSelector = onNode(tn.nodes[1].name)
	named(&plain.Spec.Template.Spec)
	deps := c.Client.AppsV1()
	if _, err := deps.Deployments(appNamespace).Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := deps.Deployments(serverNamespace).Create(ctx, backend, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := deps.Deployments(appNamespace).Create(ctx, plain, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	apps := &laneApps{
		backendVIP: createService(t, tn, serverNamespace, "backend", "backend"),
		plainVIP:   createService(t, tn, appNamespace, "plainsrv", "plainsrv"),
		emptyVIP:   createService(t, tn, serverNamespace, "empty", "nothing-selects-this"),
	}
	apps.client = runningPodsIn(t, c, kubelet, appNamespace, "client", 1, 120*time.Second)[0]
	apps.clientNS = tn.podNetns(t, apps.client)
	backends := runningPodsIn(t, c, kubelet, serverNamespace, "backend", 2, 120*time.Second)
	if backends[0].Spec.NodeName == backends[1].Spec.NodeName {
		t.Fatalf("both backends run on %s, want one per node", backends[0].Spec.NodeName)
	}
	runningPodsIn(t, c, kubelet, appNamespace, "plainsrv", 1, 120*time.Second)
	return apps
}

// createService creates a ClusterIP Service name in ns (port 80 to the
// echo port of the pods labelled app=app) and returns its VIP:80.
func createService(t *testing.T, tn *twoNodes, ns, name, app string) string {
	t.Helper()
	svc, err := tn.cluster.Client.CoreV1().Services(ns).Create(context.Background(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": app},
			Ports:    []corev1.ServicePort{{Name: "tcp-echo", Port: 80, TargetPort: intstr.FromInt32(echoPort)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(svc.Spec.ClusterIP, "80")
}

// nodeOf is the lane node pod p runs on.
func (tn *twoNodes) nodeOf(t *testing.T, p corev1.Pod) *node {
	t.Helper()
	for _, n := range tn.nodes {
		if n.name == p.Spec.NodeName {
			return n
		}
	}
	t.Fatalf("pod %s runs on %q, no node of the lane", p.Name, p.Spec.NodeName)
	return nil
}

// podNetns is pod p's netns as the test can open it.
func (tn *twoNodes) podNetns(t *testing.T, p corev1.Pod) string {
	t.Helper()
	n := tn.nodeOf(t, p)
	return n.view + podNetns(t, n, p)
}

// proxyMetrics is aether-proxy's /metrics on node n.
func (tn *twoNodes) proxyMetrics(t *testing.T, n *node) string {
	t.Helper()
	resp, err := nodeHTTP(n).Get("http://" + proxyAdmin + "/metrics")
	if err != nil {
		t.Fatalf("failed to get %s's proxy metrics: %v", n.name, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// who dials addr from the netns at nsPath and returns the greeting (the
// answering pod's name), after checking that laneLine comes back.
func who(nsPath, addr string) (string, error) {
	netns, err := ns.GetNS(nsPath)
	if err != nil {
		return "", err
	}
	defer netns.Close()
	var c net.Conn
	if err := netns.Do(func(ns.NetNS) error {
		var err error
		c, err = (&net.Dialer{Timeout: 3 * time.Second}).Dial("tcp", addr)
		return err
	}); err != nil {
		return "", fmt.Errorf("failed to dial %s: %w", addr, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	rd := bufio.NewReader(c)
	name, err := rd.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("no greeting from %s: %w", addr, err)
	}
	if _, err := io.WriteString(c, laneLine); err != nil {
		return "", fmt.Errorf("failed to write to %s: %w", addr, err)
	}
	got, err := rd.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("no echo from %s: %w", addr, err)
	}
	if got != laneLine {
		return "", fmt.Errorf("echo from %s = %q, want %q", addr, got, laneLine)
	}
	return strings.TrimSpace(name), nil
}

// probe is one connection of a probe loop.
type probe struct {
	at   time.Time
	name string
	err  error
}

// probeLoop connects to addr from nsPath every interval until the
// returned function is called, which returns every probe.
func probeLoop(t *testing.T, nsPath, addr string, interval time.Duration) func() []probe {
	t.Helper()
	var (
		mu     sync.Mutex
		probes []probe
		stop   = make(chan struct{})
		done   = make(chan struct{})
	)
	go func() {
		defer close(done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			at := time.Now()
			name, err := who(nsPath, addr)
			mu.Lock()
			probes = append(probes, probe{at, name, err})
			mu.Unlock()
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	var once sync.Once
	end := func() []probe {
		once.Do(func() { close(stop); <-done })
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(probes)
	}
	t.Cleanup(func() { end() })
	return end
}

// serviceEndpoints are the serving endpoints (pod names, without the
// namespace aetherctl prefixes) node n's proxy
// was pushed for Service ns/name (aetherctl services on n's xds socket).
func (tn *twoNodes) serviceEndpoints(t *testing.T, n *node, ns, name string) []string {
	t.Helper()
	var rows []workloadclient.ServiceRow
	aetherctlJSON(t, &rows, "services", "--xds-socket", n.view+filepath.Join(tn.hostPath("run/aether"), "proxy", "xds.sock"))
	var eps []string
	for _, r := range rows {
		if r.Name != ns+"/"+name+"."+ns+".svc.cluster.local" {
			continue
		}
		for _, e := range r.Endpoints {
			if e.Serving {
				eps = append(eps, strings.TrimPrefix(e.Name, ns+"/"))
			}
		}
	}
	slices.Sort(eps)
	return eps
}

// podNames are the sorted names of pods.
func podNames(pods []corev1.Pod) []string {
	var names []string
	for _, p := range pods {
		names = append(names, p.Name)
	}
	slices.Sort(names)
	return names
}
