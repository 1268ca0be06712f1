package kubernetes_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// TestKubernetes runs aether-node on a real single-node Kubernetes and walks
// the scenarios of issue 11 item 6 in order.
func TestKubernetes(t *testing.T) {
	start := time.Now()
	n := startNode(t)
	buildImage(t, []*node{n}, "v1", "v2")
	n.runtime.ImportBinary(t, "./test/kubernetes/echo", echoImage)
	in := installAetherNode(t, n, "v1")

	if !t.Run("DaemonSetReady", func(t *testing.T) {
		waitDaemonSetReady(t, n, 120*time.Second)
		// Ready says the containers started; the installer sidecar and the
		// agent's taint removal finish on their own: poll, then check.
		ready := time.Now()
		var (
			b       []byte
			taints  []corev1.Taint
			plugins []map[string]any
		)
		for {
			no, err := n.cluster.Client.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			taints = no.Spec.Taints
			if b, err = os.ReadFile(n.conflist); err != nil {
				t.Fatal(err)
			}
			var cl struct {
				Plugins []map[string]any `json:"plugins"`
			}
			if err := json.Unmarshal(b, &cl); err != nil {
				t.Fatalf("the conflist does not parse: %v\n%s", err, b)
			}
			plugins = cl.Plugins
			chained := len(plugins) == 2 && plugins[0]["type"] == "bridge" && plugins[1]["type"] == "aether-cni"
			if (chained && !hasTaint(taints, notReadyTaint)) || time.Since(ready) > 30*time.Second {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if hasTaint(taints, notReadyTaint) {
			t.Fatalf("the agent did not remove %s from its Node: taints %v", notReadyTaint, taints)
		}
		if len(plugins) != 2 || plugins[0]["type"] != "bridge" || plugins[1]["type"] != "aether-cni" {
			t.Fatalf("the installer did not chain aether-cni after bridge:\n%s", b)
		}
		if sock := filepath.Join(in.agentSocketDir(), "cni.sock"); plugins[1]["agent_socket"] != sock {
			t.Fatalf("chained aether-cni has agent_socket %v, want the agent's socket %s", plugins[1]["agent_socket"], sock)
		}
		t.Logf("chained and untainted %s after the DaemonSet was Ready", time.Since(ready).Round(time.Millisecond))
		t.Logf("chained conflist:\n%s", b)
	}) {
		return // later scenarios build on this one
	}

	// Scrapes from before the first managed pod, so the CNI ADDs and all
	// the traffic of the scenarios below are in its series.
	prom := startPrometheus(t, n)
	createNamespace(t, n)
	deployEcho(t, n, "client", true)
	deployEcho(t, n, "web", true)
	deployEcho(t, n, "plain", false)
	if !t.Run("ManagedPods", func(t *testing.T) {
		pods := map[string]corev1.Pod{}
		for _, name := range []string{"client", "web", "plain"} {
			pods[name] = runningPods(t, n, name, 1, 120*time.Second)[0]
		}
		recs, rows := agentPods(t, in), workloads(t, in)
		for _, name := range []string{"client", "web"} {
			p := pods[name]
			nsPath := podNetns(t, n, p)
			if !captured(t, nsPath) {
				t.Fatalf("managed pod %s has no capture table", p.Name)
			}
			proxyServing(t, nsPath)
			rec := findAgentPod(recs, p.Name)
			if rec == nil || rec.UID != string(p.UID) || rec.ServiceAccount != "default" || !rec.Managed {
				t.Fatalf("aetherctl pods: record of %s = %+v, want uid %s, service account default, managed", p.Name, rec, p.UID)
			}
			if ref := metav1.GetControllerOf(&p); ref == nil || rec.Owner != ref.Kind+"/"+ref.Name {
				t.Fatalf("aetherctl pods: owner of %s = %q, want its controller %+v", p.Name, rec.Owner, ref)
			}
			w := findWorkload(rows, p.Name)
			if w == nil || w.WorkloadName != name || w.ServiceAccount != "default" || w.Status != "HEALTHY" || !strings.Contains(w.UID, p.Name) {
				t.Fatalf("aetherctl workloads: workload of %s = %+v, want owner deployment %s, service account default, HEALTHY", p.Name, w, name)
			}
		}
		plain := pods["plain"]
		if captured(t, podNetns(t, n, plain)) {
			t.Fatalf("unmanaged pod %s has a capture table", plain.Name)
		}
		if rec, w := findAgentPod(recs, plain.Name), findWorkload(rows, plain.Name); rec != nil || w != nil {
			t.Fatalf("unmanaged pod %s is known to the agent: record %+v, workload %+v", plain.Name, rec, w)
		}

		// client -> web's pod IP: captured in client's netns, forwarded by
		// aether-proxy, which names both workloads.
		echoFrom(t, podNetns(t, n, pods["client"]), net.JoinHostPort(pods["web"].Status.PodIP, strconv.Itoa(echoPort)))
		m := proxyMetrics(t, n)
		line := metricLine(m, "istio_tcp_connections_opened_total", `reporter="source"`, `source_workload="client"`, `destination_workload="web"`)
		if line == "" {
			t.Fatalf("aether-proxy metrics do not name client -> web:\n%s", m)
		}
		t.Logf("proxy metric: %s", line)

		// client -> the unmanaged pod's IP: still captured on client's side
		// (the divert is per source pod); the destination is no workload the
		// agent knows, so the proxy cannot name it.
		echoFrom(t, podNetns(t, n, pods["client"]), net.JoinHostPort(plain.Status.PodIP, strconv.Itoa(echoPort)))
		m = proxyMetrics(t, n)
		line = metricLine(m, "istio_tcp_connections_opened_total", `reporter="source"`, `source_workload="client"`, `destination_workload="unknown"`)
		if line == "" {
			t.Fatalf("aether-proxy metrics have no client -> unknown series for the unmanaged destination:\n%s", m)
		}
		t.Logf("proxy metric: %s", line)
	}) {
		return // later scenarios build on this one
	}

	if !t.Run("ServiceVIP", func(t *testing.T) {
		// A ClusterIP Service of web, with its EndpointSlices from the
		// controller-manager; no kube-proxy runs in the lane, so only the
		// client's proxy can make the VIP answer (resolved from workload
		// discovery, tunnelled over HBONE to web's pod).
		svc, err := n.cluster.Client.CoreV1().Services(appNamespace).Create(context.Background(), &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "web"},
			Spec: corev1.ServiceSpec{
				Selector: map[string]string{"app": "web"},
				Ports:    []corev1.ServicePort{{Name: "tcp-echo", Port: 80, TargetPort: intstr.FromInt32(echoPort)}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vip := net.JoinHostPort(svc.Spec.ClusterIP, "80")
		client := runningPods(t, n, "client", 1, 60*time.Second)[0]
		start := time.Now()
		for {
			err := tryEcho(podNetns(t, n, client), vip)
			if err == nil {
				break
			}
			if time.Since(start) > 60*time.Second {
				t.Fatalf("client -> Service web %s: %v", vip, err)
			}
			time.Sleep(500 * time.Millisecond)
		}
		t.Logf("client -> Service web (%s) answered %s after the Service was created", vip, time.Since(start).Round(time.Millisecond))
		m := proxyMetrics(t, n)
		if line := metricLine(m, "aether_outbound_connections_total", `path="service_hbone"`); line == "" {
			t.Fatalf("the VIP answered but aether-proxy counted no service_hbone connection:\n%s", m)
		} else {
			t.Logf("proxy metric: %s", line)
		}
		out := string(aetherctl(t, "services", "--xds-socket", filepath.Join(in.proxySocketDir(), "xds.sock")))
		if !strings.Contains(out, appNamespace+"/web."+appNamespace+".svc.cluster.local") {
			t.Fatalf("aetherctl services does not list web:\n%s", out)
		}
		t.Logf("aetherctl services:\n%s", out)
	}) {
		return // later scenarios build on this one
	}

	if !t.Run("AuthorizationPolicy", func(t *testing.T) {
		// Istio's own YAML on the CRDs the chart installed, each checked
		// by connections that must pass and must be refused at web's
		// proxy: client is managed (HBONE, principal
		// cluster.local/ns/<ns>/sa/default), plain is not (plaintext,
		// through web's inbound capture).
		client := runningPods(t, n, "client", 1, 60*time.Second)[0]
		plain := runningPods(t, n, "plain", 1, 60*time.Second)[0]
		web := runningPods(t, n, "web", 1, 60*time.Second)[0]
		addr := net.JoinHostPort(web.Status.PodIP, strconv.Itoa(echoPort))
		from := map[string]string{"client": podNetns(t, n, client), "plain": podNetns(t, n, plain)}
		apply := func(resource, doc string) func() { return applyIstio(t, n, resource, doc) }
		// expect waits until every source gets the outcome it must (the
		// push takes milliseconds; 30 s bound).
		expect := func(what string, want map[string]bool) {
			t.Helper()
			start := time.Now()
			for {
				var wrong []string
				for src, ok := range want {
					if err := tryEcho(from[src], addr); (err == nil) != ok {
						wrong = append(wrong, fmt.Sprintf("%s (allowed=%v, err %v)", src, !ok, err))
					}
				}
				if len(wrong) == 0 {
					t.Logf("%s: %v after %s", what, want, time.Since(start).Round(time.Millisecond))
					return
				}
				if time.Since(start) > 30*time.Second {
					t.Fatalf("%s: %s", what, strings.Join(wrong, "; "))
				}
				time.Sleep(200 * time.Millisecond)
			}
		}
		expect("no policy", map[string]bool{"client": true, "plain": true})

		del := apply("authorizationpolicies", `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: web-port-9999}
spec:
  selector: {matchLabels: {app: web}}
  action: ALLOW
  rules:
  - to:
    - operation: {ports: ["9999"]}
`)
		expect("a port-restricted ALLOW", map[string]bool{"client": false, "plain": false})
		if line := metricLine(proxyMetrics(t, n), "aether_policy_denials_total", `reason="no_allow_match"`); line == "" {
			t.Fatal("refused, but no aether_policy_denials_total{reason=\"no_allow_match\"}")
		}
		del()
		expect("the policy deleted", map[string]bool{"client": true, "plain": true})

		del = apply("authorizationpolicies", fmt.Sprintf(`apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-default-sa}
spec:
  selector: {matchLabels: {app: web}}
  action: ALLOW
  rules:
  - from:
    - source: {principals: ["cluster.local/ns/%s/sa/default"]}
`, appNamespace))
		expect("ALLOW one service account", map[string]bool{"client": true, "plain": false})
		del()

		del = apply("authorizationpolicies", fmt.Sprintf(`apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-own-namespace}
spec:
  action: DENY
  rules:
  - from:
    - source: {namespaces: ["%s"]}
`, appNamespace))
		expect("DENY a namespace", map[string]bool{"client": false, "plain": true})
		del()

		del = apply("authorizationpolicies", `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: get-only}
spec:
  selector: {matchLabels: {app: web}}
  action: ALLOW
  rules:
  - to:
    - operation: {methods: ["GET"]}
`)
		expect("an L7 ALLOW rule fails safe (matches nothing)", map[string]bool{"client": false, "plain": false})
		del()

		del = apply("peerauthentications", `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web-strict}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: STRICT}
`)
		expect("PeerAuthentication STRICT", map[string]bool{"client": true, "plain": false})
		del()
		del = apply("peerauthentications", `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: web-permissive}
spec:
  selector: {matchLabels: {app: web}}
  mtls: {mode: PERMISSIVE}
`)
		expect("PeerAuthentication PERMISSIVE", map[string]bool{"client": true, "plain": true})
		del()

		// A connection open while a DENY is applied is closed within a
		// second of the push.
		netns, err := ns.GetNS(from["client"])
		if err != nil {
			t.Fatal(err)
		}
		defer netns.Close()
		var c net.Conn
		if err := netns.Do(func(ns.NetNS) error {
			var err error
			c, err = (&net.Dialer{Timeout: 5 * time.Second}).Dial("tcp", addr)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		rd := bufio.NewReader(c)
		if _, err := io.WriteString(c, "before\n"); err != nil {
			t.Fatal(err)
		}
		if _, err := rd.ReadString('\n'); err != nil {
			t.Fatalf("the open connection does not echo: %v", err)
		}
		applied := time.Now()
		del = apply("authorizationpolicies", `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-all}
spec:
  selector: {matchLabels: {app: web}}
  action: DENY
  rules: [{}]
`)
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, rerr := rd.ReadString('\n') // blocks until the proxy closes it
		closed := time.Since(applied)
		if rerr == nil || closed > 5*time.Second {
			t.Fatalf("the open connection was not closed by the DENY (read %v after %s)", rerr, closed)
		}
		t.Logf("an open connection closed %s after the DENY was created (API write, watch, push and the proxy's reset)", closed.Round(time.Millisecond))
		del()
		expect("the DENY deleted", map[string]bool{"client": true, "plain": true})
	}) {
		return // later scenarios build on this one
	}

	if !t.Run("Prometheus", func(t *testing.T) { testPrometheus(t, n, prom) }) {
		return // later scenarios build on this one
	}
	prom.Stop()

	if !t.Run("DeletePod", func(t *testing.T) {
		events := watchWorkloads(t, in)
		web := runningPods(t, n, "web", 1, 60*time.Second)[0]
		listed := nextEvent(t, events, "the watch to list "+web.Name, 10*time.Second, func(e watchEvent) bool {
			return e.Event == "put" && e.Workload != nil && e.Workload.Name == web.Name
		})
		if err := n.cluster.Client.CoreV1().Pods(appNamespace).Delete(context.Background(), web.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		deleted := time.Now()
		first := nextEvent(t, events, web.Name+" UNHEALTHY or removed", 30*time.Second, func(e watchEvent) bool {
			return e.UID == listed.UID && (e.Event == "removed" || e.Workload.Status != "HEALTHY")
		})
		if first.Event != "put" || first.Workload.Status != "UNHEALTHY" {
			t.Fatalf("first change of the deleted pod's workload = %+v, want UNHEALTHY before removal", first)
		}
		t.Logf("delete -> UNHEALTHY in %s", time.Since(deleted).Round(time.Millisecond))
		nextEvent(t, events, web.Name+" removed", 60*time.Second, func(e watchEvent) bool {
			return e.UID == listed.UID && e.Event == "removed"
		})
		t.Logf("delete -> removed in %s", time.Since(deleted).Round(time.Millisecond))
		if rec := findAgentPod(agentPods(t, in), web.Name); rec != nil {
			t.Fatalf("agent record of deleted pod %s left: %+v", web.Name, rec)
		}
		// The Deployment's replacement is captured like the first pod.
		repl := runningPods(t, n, "web", 1, 60*time.Second)[0]
		if repl.UID == web.UID || !captured(t, podNetns(t, n, repl)) {
			t.Fatalf("replacement pod %s (uid %s) is not captured", repl.Name, repl.UID)
		}
	}) {
		return // later scenarios build on this one
	}

	if !t.Run("RollingUpdate", func(t *testing.T) {
		before := managedRecords(t, in)
		if len(before) != 2 {
			t.Fatalf("managed records before the roll-out = %v, want client and web", before)
		}
		chain := watchChain(t, n.conflist)
		rollStart := time.Now()
		setImage(t, n, "v2")
		// Created while the DaemonSet rolls: its ADD meets the agent going
		// away and coming back (aether-cni answers code 11; kubelet retries).
		deployEcho(t, n, "during", true)
		waitDaemonSetReady(t, n, 120*time.Second)
		t.Logf("DaemonSet rolled in %s", time.Since(rollStart).Round(time.Millisecond))
		during := runningPods(t, n, "during", 1, 120*time.Second)[0]
		t.Logf("pod %s running %s after the roll-out began; %s", during.Name, time.Since(rollStart).Round(time.Millisecond), sandboxRetries(t, n, during))
		// The chart's installer (--uninstall-on-exit=auto) keeps the chain
		// while its DaemonSet exists: the conflist is never unchained.
		if gaps := chain(); gaps.count != 0 {
			t.Errorf("the conflist lost aether-cni during the roll-out: %s", gaps)
		} else {
			t.Logf("conflist during the roll-out: %s", gaps)
		}
		after := managedRecords(t, in)
		for name, uid := range before {
			if after[name] != uid {
				t.Errorf("record of %s (uid %s) lost across the roll-out: records now %v", name, uid, after)
			}
		}
		for _, name := range []string{"client", "web"} {
			p := runningPods(t, n, name, 1, 10*time.Second)[0]
			if !captured(t, podNetns(t, n, p)) {
				t.Errorf("pod %s lost its capture table in the roll-out", p.Name)
			}
		}
		if !captured(t, podNetns(t, n, during)) || after[during.Name] != string(during.UID) {
			t.Errorf("pod %s created during the roll-out: captured %v, agent record uid %q, want captured with uid %s",
				during.Name, captured(t, podNetns(t, n, during)), after[during.Name], during.UID)
		}
		if !t.Failed() {
			echoFrom(t, podNetns(t, n, runningPods(t, n, "client", 1, 10*time.Second)[0]),
				net.JoinHostPort(runningPods(t, n, "web", 1, 10*time.Second)[0].Status.PodIP, strconv.Itoa(echoPort)))
		}
	}) {
		return // later scenarios build on this one
	}

	if !t.Run("UDSSocket", func(t *testing.T) {
		udsStart := time.Now()
		testUDSSocket(t, n, in)
		t.Logf("UDS scenario took %s", time.Since(udsStart).Round(time.Millisecond))
	}) {
		return // later scenarios build on this one
	}

	if !t.Run("Uninstall", func(t *testing.T) {
		unStart := time.Now()
		in.uninstall(t, n)
		t.Logf("aether-node pods gone %s after the uninstall began", time.Since(unStart).Round(time.Millisecond))
		b, err := os.ReadFile(n.conflist)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, n.original) {
			t.Fatalf("conflist after uninstall:\n%s\nwant the original bytes:\n%s", b, n.original)
		}
		if _, err := os.Stat(filepath.Join(n.cniBin, "aether-cni")); !os.IsNotExist(err) {
			t.Fatalf("aether-cni binary left in the CNI bin dir: %v", err)
		}
		deployEcho(t, n, "after", true)
		p := runningPods(t, n, "after", 1, 60*time.Second)[0]
		if captured(t, podNetns(t, n, p)) {
			t.Fatalf("pod %s created after uninstall has a capture table", p.Name)
		}
	}) {
		return // later scenarios build on this one
	}

	t.Logf("lane took %s", time.Since(start).Round(time.Millisecond))
}

func hasTaint(taints []corev1.Taint, key string) bool {
	for _, ta := range taints {
		if ta.Key == key && ta.Effect == corev1.TaintEffectNoSchedule {
			return true
		}
	}
	return false
}

// applyIstio creates an Istio security object (resource authorizationpolicies
// or peerauthentications) from doc in the app namespace, on the CRDs the
// chart installed, and returns its deletion.
func applyIstio(t *testing.T, n *node, resource, doc string) func() {
	t.Helper()
	return applyIstioIn(t, n.cluster.Config, appNamespace, resource, doc)
}

// applyIstioIn is applyIstio in namespace ns of the cluster at cfg.
func applyIstioIn(t *testing.T, cfg *rest.Config, ns, resource, doc string) func() {
	t.Helper()
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var obj unstructured.Unstructured
	if err := yaml.Unmarshal([]byte(doc), &obj.Object); err != nil {
		t.Fatal(err)
	}
	r := dyn.Resource(schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: resource}).Namespace(ns)
	if _, err := r.Create(context.Background(), &obj, metav1.CreateOptions{}); err != nil {
		t.Fatalf("failed to create %s %s (is the chart's CRD installed?): %v", resource, obj.GetName(), err)
	}
	return func() {
		if err := r.Delete(context.Background(), obj.GetName(), metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}
