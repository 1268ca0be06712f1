package deploy_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"aether.io/node/deploy/chart"
)

// TestMetricsOnNodeAddress: with the default values both binaries serve
// /metrics on the node's address (status.hostIP, bracketed so an IPv6 node
// works too) on the metrics ports, declared as named container ports; the
// annotations name the proxy's port; health stays on 127.0.0.1.
func TestMetricsOnNodeAddress(t *testing.T) {
	for _, tt := range []struct {
		set                  string
		agentPort, proxyPort int32
	}{{"default", 15030, 15020}, {"observability", 25030, 25020}} {
		t.Run(tt.set, func(t *testing.T) {
			r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == tt.set })])
			for _, c := range []struct {
				name, flag, port string
				num              int32
			}{
				{"aether-agent", "--metrics-addr", "agent-metrics", tt.agentPort},
				{"aether-proxy", "-metrics-address", "proxy-metrics", tt.proxyPort},
			} {
				ctr := container(t, r, c.name)
				if want := fmt.Sprintf("%s=[$(NODE_IP)]:%d", c.flag, c.num); !slices.Contains(ctr.Args, want) {
					t.Errorf("%s args %v lack %s", c.name, ctr.Args, want)
				}
				if got := envVars(ctr)["NODE_IP"]; got != "status.hostIP" {
					t.Errorf("%s NODE_IP from %q, want status.hostIP", c.name, got)
				}
				if !slices.ContainsFunc(ctr.Ports, func(p corev1.ContainerPort) bool {
					return p.Name == c.port && p.ContainerPort == c.num && p.Protocol == corev1.ProtocolTCP
				}) {
					t.Errorf("%s ports %+v lack %s %d/TCP", c.name, ctr.Ports, c.port, c.num)
				}
			}
			ann := r.ds.Spec.Template.Annotations
			if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != fmt.Sprint(tt.proxyPort) || ann["prometheus.io/path"] != "/metrics" {
				t.Errorf("pod annotations %v, want prometheus.io scrape true, port %d, path /metrics", ann, tt.proxyPort)
			}
		})
	}
	t.Run("off", func(t *testing.T) {
		raw := renderValues(t, "metrics:\n  enabled: false\npodAnnotations:\n  team: platform\n")
		decodeManifests(t, raw) // strictly valid without the metrics parts
		if strings.Contains(string(raw), "prometheus.io/") || strings.Contains(string(raw), "NODE_IP") || strings.Contains(string(raw), "-metrics") {
			t.Errorf("metrics off renders prometheus.io annotations, NODE_IP or a metrics flag or port:\n%s", grepLines(raw, "prometheus.io/|NODE_IP|-metrics"))
		}
		if !strings.Contains(string(raw), "team: platform") {
			t.Error("metrics off dropped podAnnotations")
		}
	})
}

// TestPodMonitor: podMonitor always renders a PodMonitor selecting the
// DaemonSet's pods on both named ports, with its extra labels; auto
// renders none where the cluster has no PodMonitor API (helm template).
func TestPodMonitor(t *testing.T) {
	raw := renderValues(t, "metrics:\n  podMonitor:\n    enabled: always\n    interval: 30s\n    labels:\n      release: prom\n")
	pm := findDoc(t, raw, "PodMonitor")
	if pm == nil {
		t.Fatal("podMonitor always renders no PodMonitor")
	}
	var got struct {
		APIVersion string `json:"apiVersion"`
		Metadata   struct {
			Namespace string            `json:"namespace"`
			Labels    map[string]string `json:"labels"`
		} `json:"metadata"`
		Spec struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			Endpoints []struct {
				Port, Path, Interval string
			} `json:"podMetricsEndpoints"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(pm, &got); err != nil {
		t.Fatal(err)
	}
	if got.APIVersion != "monitoring.coreos.com/v1" || got.Metadata.Namespace != chart.Namespace || got.Metadata.Labels["release"] != "prom" {
		t.Errorf("PodMonitor %s in %q with labels %v, want monitoring.coreos.com/v1 in %s with release=prom", got.APIVersion, got.Metadata.Namespace, got.Metadata.Labels, chart.Namespace)
	}
	r := renderSet(t, valueSets[0])
	for k, v := range got.Spec.Selector.MatchLabels {
		if r.ds.Spec.Template.Labels[k] != v {
			t.Errorf("PodMonitor selects %s=%s, which the DaemonSet's pods do not carry (%v)", k, v, r.ds.Spec.Template.Labels)
		}
	}
	var ports []string
	for _, e := range got.Spec.Endpoints {
		ports = append(ports, e.Port)
		if e.Path != "/metrics" || e.Interval != "30s" {
			t.Errorf("PodMonitor endpoint %+v, want path /metrics every 30s", e)
		}
	}
	if !slices.Equal(ports, []string{"agent-metrics", "proxy-metrics"}) {
		t.Errorf("PodMonitor scrapes ports %v, want agent-metrics and proxy-metrics", ports)
	}
	if findDoc(t, renderSet(t, valueSets[0]).raw, "PodMonitor") != nil {
		t.Error("podMonitor auto rendered a PodMonitor although helm template sees no PodMonitor API")
	}
}

// TestScrapeConfig: the chart's scrape configuration is one Prometheus
// accepts (promtool check config) and keeps the two metrics ports of this
// release's pods.
func TestScrapeConfig(t *testing.T) {
	r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == "observability" })])
	cm := configMap(t, r, chart.Release+"-prometheus-scrape")
	sc := cm.Data["scrape-configs.yaml"]
	for _, want := range []string{"role: pod", "regex: agent-metrics|proxy-metrics", "target_label: node"} {
		if !strings.Contains(sc, want) {
			t.Errorf("scrape config lacks %q:\n%s", want, sc)
		}
	}
	// Debian's Prometheus (make deps) is built without Kubernetes
	// discovery: check the job with file discovery in its place, as the
	// Kubernetes lane runs it.
	dir := t.TempDir()
	jobs, sel, err := chart.ScrapeConfigsWithFileSD([]byte(sc), filepath.Join(dir, "targets.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(sel) != 1 || !slices.Equal(sel[0].Namespaces, []string{chart.Namespace}) || sel[0].LabelSelector != "app.kubernetes.io/name=aether-node,app.kubernetes.io/instance="+chart.Release {
		t.Errorf("scrape config selects %+v, want the release namespace and the DaemonSet's selector labels", sel)
	}
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, append([]byte("scrape_configs:\n"), jobs...), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool(t), "check", "config", "--syntax-only", cfg).CombinedOutput(); err != nil {
		t.Fatalf("promtool check config refuses the chart's scrape config: %v\n%s", err, out)
	}
	if findDoc(t, renderSet(t, valueSets[0]).raw, "ConfigMap") != nil {
		t.Error("the default values render a ConfigMap (scrape config and dashboard are off by default)")
	}
}

// TestDashboard: the dashboard ConfigMap carries the JSON of
// files/dashboards byte for byte with Grafana's sidecar label, and every
// query of every panel is PromQL Prometheus parses (promtool check rules)
// over series the binaries export.
func TestDashboard(t *testing.T) {
	r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == "observability" })])
	cm := configMap(t, r, chart.Release+"-dashboard")
	if cm.Labels["grafana_dashboard"] != "1" || cm.Labels["team"] != "platform" {
		t.Errorf("dashboard ConfigMap labels %v, want grafana_dashboard=1 and team=platform", cm.Labels)
	}
	file, err := os.ReadFile(filepath.Join(chart.Dir(), chart.DashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data["aether-node.json"]; got != strings.TrimSuffix(string(file), "\n") {
		t.Errorf("dashboard ConfigMap data differs from files/dashboards/aether-node.json: %s", firstDiff(string(file), got))
	}
	exprs, err := chart.DashboardQueries(file)
	if err != nil {
		t.Fatal(err)
	}
	if len(exprs) < 10 {
		t.Fatalf("dashboard has %d queries, want the panels an operator opens first", len(exprs))
	}
	var rules strings.Builder
	rules.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, e := range exprs {
		fmt.Fprintf(&rules, "      - record: dashboard:query%d\n        expr: %q\n", i, chart.ResolveDashboardVars(e, "5m"))
	}
	f := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(f, []byte(rules.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool(t), "check", "rules", f).CombinedOutput(); err != nil {
		t.Fatalf("promtool refuses the dashboard's queries: %v\n%s", err, out)
	}
	exported := exportedMetricNames(t)
	for _, e := range exprs {
		for _, name := range regexp.MustCompile(`\b(?:istio|aether)_[a-z_]+`).FindAllString(e, -1) {
			base := strings.TrimSuffix(name, "_bucket")
			if !exported[base] {
				t.Errorf("dashboard query %q reads %s, which neither binary exports", e, name)
			}
		}
	}
}

// exportedMetricNames are the metric names the agent's and the proxy's
// telemetry packages register, read from their Go sources (a registry
// gathers a vector only once it has a label value, and the HBONE
// collector builds its names at scrape time). The Kubernetes lane checks
// the same queries against a real Prometheus.
func exportedMetricNames(t *testing.T) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	root := filepath.Join(chart.Dir(), "..", "..", "..")
	for _, dir := range []string{"agent/telemetry", "proxy/telemetry"} {
		files, err := filepath.Glob(filepath.Join(root, dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range regexp.MustCompile(`"((?:istio|aether)_[a-z_]+)"`).FindAllStringSubmatch(string(b), -1) {
				out[m[1]] = true
			}
		}
	}
	if len(out) < 20 {
		t.Fatalf("found %d metric names in the telemetry packages: the source layout changed", len(out))
	}
	return out
}

// promtool returns Prometheus' promtool (Debian's prometheus package,
// installed by make deps).
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (Debian package prometheus; run make deps): %v", err)
	}
	return p
}

// renderValues renders the chart with one values document.
func renderValues(t *testing.T, values string) []byte {
	t.Helper()
	f := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(f, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	raw, err := chart.Render(context.Background(), f)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// findDoc returns the first document of raw of kind, or nil.
func findDoc(t *testing.T, raw []byte, kind string) []byte {
	t.Helper()
	for _, doc := range strings.Split(string(raw), "\n---\n") {
		var meta struct {
			Kind string `json:"kind"`
		}
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			t.Fatalf("document does not parse: %v\n%s", err, doc)
		}
		if meta.Kind == kind {
			return []byte(doc)
		}
	}
	return nil
}

// configMap returns the render's ConfigMap name.
func configMap(t *testing.T, r *render, name string) *corev1.ConfigMap {
	t.Helper()
	for _, o := range r.objs {
		if cm, ok := o.(*corev1.ConfigMap); ok && cm.Name == name {
			return cm
		}
	}
	t.Fatalf("value set %s renders no ConfigMap %s", r.set.name, name)
	return nil
}

// grepLines returns raw's lines matching pattern.
func grepLines(raw []byte, pattern string) string {
	re := regexp.MustCompile(pattern)
	var out []string
	for _, l := range strings.Split(string(raw), "\n") {
		if re.MatchString(l) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
