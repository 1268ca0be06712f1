package kubernetes_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/deploy/chart"
	"aether.io/node/test/kubetest"
)

// promServer is Debian's Prometheus (make deps) in the node netns,
// scraping the DaemonSet every second through the chart's own scrape
// configuration: the ConfigMap the chart installed (metrics.scrapeConfig).
//
// Debian builds Prometheus without Kubernetes service discovery (its
// package removes it), so the job's kubernetes_sd_configs is replaced by a
// file the lane writes every second from the API, in the shape
// kubernetes_sd gives (one target per container port of each selected
// pod, the same __meta_kubernetes_* labels); the chart's relabelling runs
// unchanged in the real server.
type promServer struct {
	n    *node
	proc *kubetest.Proc
	addr string
	stop chan struct{}
	done chan struct{}
}

// promTargetGroup is one file_sd target group.
type promTargetGroup struct {
	Targets []string          `json:"targets"`
	Labels  map[string]string `json:"labels"`
}

func startPrometheus(t *testing.T, n *node) *promServer {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("prometheus not found (Debian package prometheus; run make deps): %v", err)
	}
	ctx := context.Background()
	cm, err := n.cluster.Client.CoreV1().ConfigMaps(chart.Namespace).Get(ctx, chart.Release+"-prometheus-scrape", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the chart's scrape configuration (metrics.scrapeConfig.enabled) is not installed: %v", err)
	}
	dir := filepath.Join(n.base, "prometheus")
	mkdir(t, dir)
	targets := filepath.Join(dir, "targets.json")
	jobs, sel, err := chart.ScrapeConfigsWithFileSD([]byte(cm.Data["scrape-configs.yaml"]), targets)
	if err != nil {
		t.Fatal(err)
	}
	p := &promServer{n: n, stop: make(chan struct{}), done: make(chan struct{})}
	if err := writePromTargets(ctx, n, sel, targets); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.done)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-tick.C:
				_ = writePromTargets(ctx, n, sel, targets) // the next tick retries
			}
		}
	}()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, append([]byte("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"), jobs...), 0o600); err != nil {
		t.Fatal(err)
	}
	p.addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(kubetest.FreePort(t)))
	p.proc = n.cluster.Run(t, dir, bin, "--config.file="+cfg, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+p.addr, "--log.level=warn")
	t.Cleanup(p.Stop)
	kubetest.WaitFor(t, "prometheus ready", 30*time.Second, p.proc, func() bool {
		hc := &http.Client{Timeout: time.Second, Transport: &http.Transport{DialContext: n.cluster.Dial}}
		resp, err := hc.Get("http://" + p.addr + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	// Scraping before the caller goes on: what happens next is in the
	// series from their first sample.
	p.waitUp(t)
	return p
}

// waitUp waits until Prometheus has scraped both of the DaemonSet's
// metrics ports (its discovery hands targets over every 5 s, so the first
// scrape comes seconds after the start) and returns their up series.
func (p *promServer) waitUp(t *testing.T) []promSample {
	t.Helper()
	n := p.n
	// Both targets up (the first scrapes may still be under way).
	var up []promSample
	for start := time.Now(); ; time.Sleep(200 * time.Millisecond) {
		up = p.query(t, `up{job="`+chart.Release+`"} == 1`)
		_, agent := find(up, "container", "aether-agent", "namespace", chart.Namespace, "node", nodeName)
		_, proxy := find(up, "container", "aether-proxy", "namespace", chart.Namespace, "node", nodeName)
		if agent && proxy {
			return up
		}
		if time.Since(start) > 20*time.Second {
			_, targets := nodeFetch(t, n, "http://"+p.addr+"/api/v1/targets?state=any")
			b, _ := os.ReadFile(filepath.Join(n.base, "prometheus", "targets.json"))
			t.Fatalf("Prometheus does not scrape aether-agent and aether-proxy through the chart's scrape configuration (up = %v)\ntargets: %s\ndiscovered file: %s\nprometheus: %s", up, targets, b, p.proc.Output())
		}
	}
}

// waitScrapes waits until the proxy's target was scraped n times after
// since (its up sample's timestamp, one scrape a second).
func (p *promServer) waitScrapes(t *testing.T, since time.Time, n int) {
	t.Helper()
	want := float64(since.Add(time.Duration(n)*time.Second).UnixMilli()) / 1000
	for start := time.Now(); ; time.Sleep(200 * time.Millisecond) {
		if s, ok := find(p.query(t, `timestamp(up{container="aether-proxy"})`)); ok && s.Value >= want {
			return
		}
		if time.Since(start) > 30*time.Second {
			t.Fatalf("no %d scrapes of aether-proxy within 30 s", n)
		}
	}
}

// Stop stops the target writer and the server (idempotent).
func (p *promServer) Stop() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	<-p.done
	p.proc.Stop()
}

// writePromTargets writes the pods sel selects as kubernetes_sd (role
// pod) would discover them, replacing file atomically.
func writePromTargets(ctx context.Context, n *node, sel []chart.PodSelection, file string) error {
	groups := []promTargetGroup{}
	for _, s := range sel {
		for _, ns := range s.Namespaces {
			pods, err := n.cluster.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: s.LabelSelector})
			if err != nil {
				return err
			}
			for _, pod := range pods.Items {
				groups = append(groups, podTargetGroups(pod)...)
			}
		}
	}
	b, err := json.Marshal(groups)
	if err != nil {
		return err
	}
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, file)
}

var promLabelName = regexp.MustCompile(`[^a-zA-Z0-9_]`)

// podTargetGroups are the targets kubernetes_sd gives for one pod: one
// per declared container port (address pod IP:port), one per container
// without ports (address pod IP), with its __meta_kubernetes_* labels.
func podTargetGroups(pod corev1.Pod) []promTargetGroup {
	if pod.Status.PodIP == "" {
		return nil
	}
	base := map[string]string{
		"__meta_kubernetes_namespace":     pod.Namespace,
		"__meta_kubernetes_pod_name":      pod.Name,
		"__meta_kubernetes_pod_ip":        pod.Status.PodIP,
		"__meta_kubernetes_pod_node_name": pod.Spec.NodeName,
		"__meta_kubernetes_pod_host_ip":   pod.Status.HostIP,
		"__meta_kubernetes_pod_uid":       string(pod.UID),
		"__meta_kubernetes_pod_phase":     string(pod.Status.Phase),
		"__meta_kubernetes_pod_controller_kind": func() string {
			if ref := metav1.GetControllerOf(&pod); ref != nil {
				return ref.Kind
			}
			return ""
		}(),
	}
	for k, v := range pod.Labels {
		base["__meta_kubernetes_pod_label_"+promLabelName.ReplaceAllString(k, "_")] = v
	}
	for k, v := range pod.Annotations {
		base["__meta_kubernetes_pod_annotation_"+promLabelName.ReplaceAllString(k, "_")] = v
	}
	with := func(extra map[string]string) map[string]string {
		out := make(map[string]string, len(base)+len(extra))
		for k, v := range base {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	var groups []promTargetGroup
	for _, c := range pod.Spec.Containers {
		if len(c.Ports) == 0 {
			groups = append(groups, promTargetGroup{Targets: []string{pod.Status.PodIP}, Labels: with(map[string]string{"__meta_kubernetes_pod_container_name": c.Name})})
			continue
		}
		for _, port := range c.Ports {
			groups = append(groups, promTargetGroup{
				Targets: []string{net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(int(port.ContainerPort)))},
				Labels: with(map[string]string{
					"__meta_kubernetes_pod_container_name":          c.Name,
					"__meta_kubernetes_pod_container_port_name":     port.Name,
					"__meta_kubernetes_pod_container_port_number":   strconv.Itoa(int(port.ContainerPort)),
					"__meta_kubernetes_pod_container_port_protocol": string(port.Protocol),
				}),
			})
		}
	}
	return groups
}

// promSample is one series of an instant query's result.
type promSample struct {
	Metric map[string]string
	Value  float64
}

func (s promSample) String() string { return fmt.Sprintf("%v = %g", s.Metric, s.Value) }

// query runs an instant PromQL query.
func (p *promServer) query(t *testing.T, expr string) []promSample {
	t.Helper()
	code, b := nodeFetch(t, p.n, "http://"+p.addr+"/api/v1/query?query="+url.QueryEscape(expr))
	var resp struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string `json:"resultType"`
			Result     []struct {
				Metric map[string]string `json:"metric"`
				Value  [2]any            `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &resp); err != nil || code != http.StatusOK || resp.Status != "success" {
		t.Fatalf("query %s: HTTP %d, %v %s: %s", expr, code, err, resp.Error, b)
	}
	if resp.Data.ResultType != "vector" {
		t.Fatalf("query %s: result type %s, want vector", expr, resp.Data.ResultType)
	}
	out := make([]promSample, 0, len(resp.Data.Result))
	for _, r := range resp.Data.Result {
		v, err := strconv.ParseFloat(fmt.Sprint(r.Value[1]), 64)
		if err != nil {
			t.Fatalf("query %s: value %v: %v", expr, r.Value[1], err)
		}
		out = append(out, promSample{Metric: r.Metric, Value: v})
	}
	return out
}

// find returns the first sample carrying every label given (k, v pairs).
func find(samples []promSample, kv ...string) (promSample, bool) {
	for _, s := range samples {
		ok := true
		for i := 0; i+1 < len(kv); i += 2 {
			if s.Metric[kv[i]] != kv[i+1] {
				ok = false
				break
			}
		}
		if ok {
			return s, true
		}
	}
	return promSample{}, false
}

// dashboardWindow stands for Grafana's $__rate_interval in the dashboard's
// queries: long enough to hold the lane's traffic since the Prometheus
// server started (the policy scenario's denials included).
const dashboardWindow = "3m"

// testPrometheus: after the mesh and policy scenarios, Prometheus scraped
// both of the DaemonSet's metrics ports on the node's address; Istio's
// dashboard queries and every query of the chart's dashboard (from the
// installed ConfigMap) return the series the lane's traffic made, with the
// right labels; the policy scenario's denials are in the denial panel.
func testPrometheus(t *testing.T, n *node, p *promServer) {
	client := runningPods(t, n, "client", 1, 60*time.Second)[0]
	web := runningPods(t, n, "web", 1, 60*time.Second)[0]
	plain := runningPods(t, n, "plain", 1, 60*time.Second)[0]
	webAddr := net.JoinHostPort(web.Status.PodIP, strconv.Itoa(echoPort))
	for _, s := range p.waitUp(t) {
		t.Logf("scraped: %s", s)
	}
	// Denials while Prometheus scrapes: a DENY on web's port, tried every
	// 200 ms from both sources for three scrape intervals, so the new
	// denial series have samples before and after increments.
	del := applyIstio(t, n, "authorizationpolicies", `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-web-port}
spec:
  selector: {matchLabels: {app: web}}
  action: DENY
  rules:
  - to:
    - operation: {ports: ["8080"]}
`)
	denied := 0
	for start := time.Now(); time.Since(start) < 3500*time.Millisecond || denied == 0; time.Sleep(200 * time.Millisecond) {
		if time.Since(start) > 30*time.Second {
			t.Fatal("the DENY never refused a connection to web")
		}
		for _, src := range []corev1.Pod{client, plain} {
			if tryEcho(podNetns(t, n, src), webAddr) != nil {
				denied++
			}
		}
	}
	del()
	for start := time.Now(); tryEcho(podNetns(t, n, plain), webAddr) != nil; time.Sleep(100 * time.Millisecond) {
		if time.Since(start) > 30*time.Second {
			t.Fatal("web refuses connections 30 s after the DENY was deleted")
		}
	}
	t.Logf("%d connections denied while Prometheus scraped", denied)
	// Fresh traffic for the 1m windows of Istio's queries: HBONE
	// (client -> web), plaintext into the mesh (plain -> web, through
	// web's inbound capture) and out of it (client -> plain); then two
	// scrapes, so every rate sees it.
	echoFrom(t, podNetns(t, n, client), webAddr)
	echoFrom(t, podNetns(t, n, plain), webAddr)
	echoFrom(t, podNetns(t, n, client), net.JoinHostPort(plain.Status.PodIP, strconv.Itoa(echoPort)))
	p.waitScrapes(t, time.Now(), 2)

	// Istio's own dashboard queries, as its workload and service
	// dashboards write them.
	istioBytes := `sum(rate(istio_tcp_sent_bytes_total{reporter="destination"}[1m])) by (source_workload, destination_workload)`
	start := time.Now()
	for {
		if s, ok := find(p.query(t, istioBytes), "source_workload", "client", "destination_workload", "web"); ok && s.Value > 0 {
			t.Logf("%s: %s after %s", istioBytes, s, time.Since(start).Round(time.Millisecond))
			break
		}
		if time.Since(start) > 30*time.Second {
			_, raw := nodeFetch(t, n, "http://"+p.addr+"/api/v1/query?query="+url.QueryEscape(`istio_tcp_sent_bytes_total{reporter="destination", source_workload="client", destination_workload="web"}[2m]`))
			t.Fatalf("%s has no client -> web series after 30 s: %v\nsamples: %s\nproxy now: %s", istioBytes, p.query(t, istioBytes), raw,
				metricLine(proxyMetrics(t, n), "istio_tcp_sent_bytes_total", `reporter="destination"`, `source_workload="client"`, `destination_workload="web"`))
		}
		time.Sleep(500 * time.Millisecond)
	}
	inbound := p.query(t, fmt.Sprintf(`sum(irate(istio_tcp_connections_opened_total{reporter="destination", destination_workload_namespace=%q, destination_workload="web"}[1m])) by (source_workload, source_workload_namespace, connection_security_policy)`, appNamespace))
	for _, want := range [][]string{
		{"source_workload", "client", "source_workload_namespace", appNamespace, "connection_security_policy", "mutual_tls"},
		{"source_workload", "unknown", "connection_security_policy", "none"},
	} {
		if _, ok := find(inbound, want...); !ok {
			t.Errorf("web's inbound connections by source lack %v: %v", want, inbound)
		}
	}
	outbound := p.query(t, fmt.Sprintf(`sum(rate(istio_tcp_received_bytes_total{reporter="source", source_workload="client", source_workload_namespace=%q}[1m])) by (destination_workload, connection_security_policy)`, appNamespace))
	for _, want := range [][]string{{"destination_workload", "web", "connection_security_policy", "mutual_tls"}, {"destination_workload", "unknown", "connection_security_policy", "none"}} {
		if _, ok := find(outbound, want...); !ok {
			t.Errorf("client's outbound bytes by destination lack %v: %v", want, outbound)
		}
	}

	// Every query of the shipped dashboard, as the chart installed it.
	cm, err := n.cluster.Client.CoreV1().ConfigMaps(chart.Namespace).Get(context.Background(), chart.Release+"-dashboard", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the chart's dashboard (metrics.dashboard.enabled) is not installed: %v", err)
	}
	exprs, err := chart.DashboardQueries([]byte(cm.Data["aether-node.json"]))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range exprs {
		q := chart.ResolveDashboardVars(e, dashboardWindow)
		res := p.query(t, q)
		switch {
		case strings.Contains(e, "aether_policy_dry_run_total"):
			// No dry-run policy in the lane: no series, by design.
			if len(res) != 0 {
				t.Errorf("dry-run panel %s: %v, want none (the lane applies no dry-run policy)", q, res)
			}
			continue
		case len(res) == 0:
			t.Errorf("dashboard query returns no series: %s", q)
			continue
		case strings.Contains(e, "aether_policy_denials_total"):
			denied := 0.0
			for _, s := range res {
				denied += s.Value
			}
			if denied <= 0 {
				t.Errorf("denial panel %s: %v, want the policy scenario's denials", q, res)
			}
		case strings.Contains(e, `connection_security_policy="mutual_tls"`):
			// client -> web in mTLS, plain -> web in plaintext.
			if v := res[0].Value; !(v > 0 && v < 1) {
				t.Errorf("mTLS share %s = %v, want between 0 and 1 (HBONE and plaintext connections both reached web)", q, res)
			}
		case strings.Contains(e, "istio_tcp_connections_opened_total"):
			if _, ok := find(res, "source_workload", "client", "destination_workload", "web", "destination_workload_namespace", appNamespace); !ok {
				t.Errorf("connections panel %s lacks client -> web: %v", q, res)
			}
		case strings.Contains(e, "aether_cni_add_duration_seconds"):
			if _, ok := find(res, "phase", "total"); !ok {
				t.Errorf("CNI latency panel %s lacks phase total: %v", q, res)
			}
		}
		t.Logf("dashboard query: %d series, first %s", len(res), res[0])
	}
	adds := p.query(t, `sum by (phase) (aether_cni_add_duration_seconds_count)`)
	if s, ok := find(adds, "phase", "total"); !ok || s.Value < 2 {
		t.Errorf("aether_cni_add_duration_seconds{phase=\"total\"} counts %v, want the managed pods' ADDs (client, web)", adds)
	}
}
