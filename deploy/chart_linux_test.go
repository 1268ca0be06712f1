package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"aether.io/node/deploy/chart"
	"aether.io/node/meshcni"
)

var update = flag.Bool("update", false, "rewrite the golden renders in testdata/golden")

// valueSet is one set of chart values the tests render, lint, check
// against the binaries and dry-run against a kube-apiserver.
type valueSet struct {
	name  string
	files []string // values files under testdata/values
}

var valueSets = []valueSet{
	{name: "default"},
	{name: "etcd-tls", files: []string{"etcd-tls.yaml"}},
	{name: "eni-vlan-debug", files: []string{"eni-vlan-debug.yaml"}},
	{name: "identity", files: []string{"identity.yaml"}},
	{name: "csi-sidecar", files: []string{"csi-sidecar.yaml"}},
	{name: "inbound-strict", files: []string{"inbound-strict.yaml"}},
	{name: "identity-spire", files: []string{"identity-spire.yaml"}},
	{name: "k3s", files: []string{"k3s.yaml"}},
	{name: "ports", files: []string{"ports.yaml"}},
	{name: "observability", files: []string{"observability.yaml"}},
}

func (v valueSet) paths() []string {
	var out []string
	for _, f := range v.files {
		out = append(out, filepath.Join("testdata", "values", f))
	}
	return out
}

// render is one value set rendered by `helm template` and decoded.
type render struct {
	set  valueSet
	raw  []byte
	objs []runtime.Object
	ds   *appsv1.DaemonSet
}

var (
	rendersMu sync.Mutex
	renders   = map[string]*render{}
)

// renderSet renders v once per test binary.
func renderSet(t *testing.T, v valueSet) *render {
	t.Helper()
	rendersMu.Lock()
	defer rendersMu.Unlock()
	if r, ok := renders[v.name]; ok {
		return r
	}
	raw, err := chart.Render(context.Background(), v.paths()...)
	if err != nil {
		t.Fatalf("value set %s: %v", v.name, err)
	}
	r := &render{set: v, raw: raw, objs: decodeManifests(t, raw)}
	for _, o := range r.objs {
		if ds, ok := o.(*appsv1.DaemonSet); ok {
			if r.ds != nil {
				t.Fatalf("value set %s renders two DaemonSets", v.name)
			}
			r.ds = ds
		}
	}
	if r.ds == nil {
		t.Fatalf("value set %s renders no DaemonSet", v.name)
	}
	renders[v.name] = r
	return r
}

// forEachSet runs f as a subtest for every value set.
func forEachSet(t *testing.T, f func(t *testing.T, r *render)) {
	for _, v := range valueSets {
		t.Run(v.name, func(t *testing.T) { f(t, renderSet(t, v)) })
	}
}

// manifestScheme is client-go's scheme plus the CustomResourceDefinition
// (the chart installs Istio's security CRDs).
var manifestScheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := apiextensionsv1.AddToScheme(s); err != nil {
		panic(err)
	}
	return s
}()

// decodeManifests decodes every document of a multi-document YAML stream
// strictly into the client-go scheme's types.
func decodeManifests(t *testing.T, raw []byte) []runtime.Object {
	t.Helper()
	dec := serializer.NewCodecFactory(manifestScheme, serializer.EnableStrict).UniversalDeserializer()
	r := yamlutil.NewYAMLReader(bufioReader(raw))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if err != nil {
			break
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("manifest document does not decode strictly: %v\n%s", err, doc)
		}
		obj.GetObjectKind().SetGroupVersionKind(*gvk)
		objs = append(objs, obj)
	}
	if len(objs) < 4 {
		t.Fatalf("decoded %d objects, want the ServiceAccount, the RBAC and the DaemonSet", len(objs))
	}
	return objs
}

// stripComments drops YAML comment lines (helm's "# Source:" lines).
func stripComments(doc []byte) []byte {
	var out []byte
	for _, l := range bytes.SplitAfter(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			out = append(out, l...)
		}
	}
	return out
}

func TestHelmLint(t *testing.T) {
	for _, v := range valueSets {
		t.Run(v.name, func(t *testing.T) {
			args := []string{"lint", "--strict", chart.Dir(), "--namespace", chart.Namespace}
			for _, f := range v.paths() {
				args = append(args, "--values", f)
			}
			out, err := chart.Run(context.Background(), args...)
			if err != nil {
				t.Fatalf("helm lint --strict: %v\n%s", err, out)
			}
			t.Logf("%s", out)
		})
	}
}

// TestGolden compares every render with testdata/golden/<set>.yaml
// (`go test ./deploy -run TestGolden -update` rewrites them) and checks a
// second render is byte-identical.
func TestGolden(t *testing.T) {
	forEachSet(t, func(t *testing.T, r *render) {
		again, err := chart.Render(context.Background(), r.set.paths()...)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, r.raw) {
			t.Fatal("two renders of the same values differ: the chart's output is not stable")
		}
		golden := filepath.Join("testdata", "golden", r.set.name+".yaml")
		if *update {
			if err := os.WriteFile(golden, r.raw, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		want, err := os.ReadFile(golden)
		if err != nil {
			t.Fatalf("%v (run go test ./deploy -run TestGolden -update)", err)
		}
		if !bytes.Equal(r.raw, want) {
			t.Errorf("render differs from %s (run go test ./deploy -run TestGolden -update and review the diff):\n%s", golden, firstDiff(string(want), string(r.raw)))
		}
	})
}

// firstDiff names the first line where got differs from want.
func firstDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := 0; i < len(w) || i < len(g); i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return "line " + strconv.Itoa(i+1) + ":\n  want " + wl + "\n  got  " + gl
		}
	}
	return ""
}

// TestGeneratedManifest checks aether-node.yaml is the chart's default
// render (`make generate` writes it).
func TestGeneratedManifest(t *testing.T) {
	want, err := chart.Manifest(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile("aether-node.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("aether-node.yaml is not the chart's default render: run make generate\n%s", firstDiff(string(want), string(got)))
	}
	if !bytes.HasPrefix(got, []byte("# GENERATED")) {
		t.Error("aether-node.yaml lacks its generated-file header")
	}
}

// TestChartRejects checks values the binaries would refuse fail the render
// with a message naming the value.
func TestChartRejects(t *testing.T) {
	tests := []struct {
		name, values, want string
	}{
		{"log level", "logLevel: verbose\n", `invalid logLevel "verbose"`},
		{"istio CRDs", "policy:\n  installCRDs: sometimes\n", `invalid policy.installCRDs "sometimes": want auto, always or never`},
		{"plugin log level", "cni:\n  pluginLogLevel: trace\n", `invalid cni.pluginLogLevel "trace"`},
		{"capture failure", "cni:\n  captureFailure: ignore\n", `invalid cni.captureFailure "ignore"`},
		{"CRI socket a bare path", "cni:\n  criSocket: /run/containerd/containerd.sock\n", `invalid cni.criSocket /run/containerd/containerd.sock: must be empty`},
		{"CRI socket not clean", "cni:\n  criSocket: unix:///run/k3s//containerd.sock\n", `invalid cni.criSocket "unix:///run/k3s//containerd.sock": the path must be clean`},
		{"CRI socket not a string", "cni:\n  criSocket: 7\n", `invalid cni.criSocket 7: must be empty`},
		{"port out of range", "ports:\n  agentHTTP: 70000\n", "invalid ports.agentHTTP 70000: must be a port number, 1-65535"},
		{"port not a number", "ports:\n  proxyAdmin: admin\n", "invalid ports.proxyAdmin admin: must be a port number"},
		{"port not whole", "ports:\n  proxyAdmin: 18090.5\n", "invalid ports.proxyAdmin 18090.5: must be a port number"},
		{"ports the same", "ports:\n  agentHTTP: 18090\n", "invalid ports.proxyAdmin 18090: the same port as ports.agentHTTP"},
		{"shutdown drain past the grace period", "proxy:\n  shutdownDrainSeconds: 45\n", "invalid proxy.shutdownDrainSeconds 45: must be at least 10 below terminationGracePeriodSeconds (45)"},
		{"shutdown drain leaves the installer no time", "proxy:\n  shutdownDrainSeconds: 36\n", "invalid proxy.shutdownDrainSeconds 36: must be at least 10 below"},
		{"shutdown drain negative", "proxy:\n  shutdownDrainSeconds: -1\n", "invalid proxy.shutdownDrainSeconds -1: must be a whole number of seconds, 0 or more"},
		{"access log level", "proxy:\n  accessLog: debug\n", "invalid proxy.accessLog debug: must be off, errors or all"},
		{"access log sample rate", "proxy:\n  accessLogSampleRate: 1.5\n", "invalid proxy.accessLogSampleRate 1.5: must be a number from 0 to 1"},
		{"access log sample rate not a number", "proxy:\n  accessLogSampleRate: half\n", "invalid proxy.accessLogSampleRate half"},
		{"pod drain zero", "proxy:\n  podDrainSeconds: 0\n", "invalid proxy.podDrainSeconds 0: must be a whole number of seconds, at least 1"},
		{"grace period not a number", "terminationGracePeriodSeconds: soon\n", "invalid terminationGracePeriodSeconds soon"},
		{"max unavailable zero", "maxUnavailable: 0\n", "invalid maxUnavailable 0: must be a number of at least 1 or a percentage"},
		{"max unavailable bad percentage", "maxUnavailable: 150%\n", `invalid maxUnavailable "150%": must be`},
		{"primary", "cni:\n  primary: calico\n", `invalid cni.primary "calico"`},
		{"inbound policy", "inboundPolicy: mtls\n", `invalid inboundPolicy "mtls"`},
		{"strict without inbound capture", "inboundPolicy: strict\n", "invalid inboundPolicy strict without cni.inboundCapture"},
		{"registry mode", "registry:\n  mode: consul\n", `invalid registry.mode "consul"`},
		{"etcd without endpoints", "registry:\n  mode: etcd\n  etcd:\n    insecure: true\n", "invalid registry.etcd.endpoints"},
		{"etcd without TLS or insecure", "registry:\n  mode: etcd\n  etcd:\n    endpoints: [https://e:2379]\n", "no tlsSecret.name and insecure is false"},
		{"empty cluster id", "clusterID: \"\"\n", "invalid clusterID"},
		{"identity without a CA", "identity:\n  enabled: true\n", "invalid identity: enabled without a CA"},
		{"identity with two CAs", "identity:\n  enabled: true\n  caSecret: ca\n  generateCA: true\n", "both caSecret and generateCA"},
		{"identity provider", "identity:\n  provider: vault\n", `invalid identity.provider "vault"`},
		{"spire with a CA", "identity:\n  enabled: true\n  provider: spire\n  generateCA: true\n", "invalid identity: provider spire with caSecret, generateCA or trustBundleConfigMap"},
		{"spire with a trust bundle", "identity:\n  enabled: true\n  provider: spire\n  trustBundleConfigMap: b\n", "invalid identity: provider spire with"},
		{"spire admin socket relative", "identity:\n  enabled: true\n  provider: spire\n  spire:\n    adminSocket: admin.sock\n", `invalid identity.spire.adminSocket "admin.sock": must be an absolute host path`},
		{"spire admin socket in the run dir", "identity:\n  enabled: true\n  provider: spire\n  spire:\n    adminSocket: /run/aether/admin.sock\n", `invalid identity.spire.adminSocket's directory "/run/aether": is the same path as hostPaths.runDir "/run/aether"`},
		{"host path relative", "hostPaths:\n  runDir: run/aether\n", `invalid hostPaths.runDir "run/aether": must be an absolute host path`},
		{"host path trailing slash", "hostPaths:\n  stateDir: /var/lib/aether/\n", `invalid hostPaths.stateDir "/var/lib/aether/": must not end in a slash; use "/var/lib/aether"`},
		{"host path dot dot", "hostPaths:\n  cniBinDir: /opt/cni/../bin\n", `invalid hostPaths.cniBinDir "/opt/cni/../bin": must not contain ..`},
		{"host path not clean", "hostPaths:\n  cniConfDir: /etc//cni/./net.d\n", `invalid hostPaths.cniConfDir "/etc//cni/./net.d": must be a clean path`},
		{"host path root", "hostPaths:\n  stateDir: /\n", `invalid hostPaths.stateDir "/": must not be the host's root directory`},
		{"host path empty", "hostPaths:\n  kubeletDir: \"\"\n", `invalid hostPaths.kubeletDir "": must be an absolute host path`},
		{"host path not a string", "hostPaths:\n  runDir: 7\n", "invalid hostPaths.runDir 7: must be a host path"},
		{"host path with a space", "hostPaths:\n  stateDir: /var/lib/my aether\n", `invalid hostPaths.stateDir "/var/lib/my aether": may contain only`},
		{"host path too long for its sockets", "hostPaths:\n  runDir: /run/" + strings.Repeat("a", 80) + "\n", "85 bytes, at most 84"},
		{"kubelet dir too long for its sockets", "hostPaths:\n  kubeletDir: /k/" + strings.Repeat("a", 65) + "\n", "68 bytes, at most 67"},
		{"two host paths the same", "hostPaths:\n  stateDir: /run/aether\n", `invalid hostPaths.stateDir "/run/aether": is the same path as hostPaths.runDir "/run/aether"`},
		{"a host path inside another", "hostPaths:\n  cniConfDir: /opt/cni/bin/net.d\n", `invalid hostPaths.cniConfDir "/opt/cni/bin/net.d": lies inside hostPaths.cniBinDir "/opt/cni/bin"`},
		{"a host path holding another", "hostPaths:\n  kubeletDir: /var/lib\n", `invalid hostPaths.kubeletDir "/var/lib": holds hostPaths.stateDir "/var/lib/aether"`},
		{"a host path over the image's binaries", "hostPaths:\n  stateDir: /usr/local\n", `invalid hostPaths.stateDir "/usr/local": holds the container path "/usr/local/bin"`},
		{"a host path inside a Secret's mount", "hostPaths:\n  runDir: /etc/aether/run\n", `invalid hostPaths.runDir "/etc/aether/run": lies inside the container path "/etc/aether"`},
		{"a host path over the token", "hostPaths:\n  runDir: /var/run/secrets\n", `invalid hostPaths.runDir "/var/run/secrets": holds the container path "/var/run/secrets/kubernetes.io/serviceaccount"`},
		{"cni.binDir moved", "cni:\n  binDir: /opt/cni/bin\n", "invalid cni.binDir: moved to hostPaths.cniBinDir"},
		{"cni.confDir moved", "cni:\n  confDir: /etc/cni/net.d\n", "invalid cni.confDir: moved to hostPaths.cniConfDir"},
		{"csi.kubeletDir moved", "csi:\n  kubeletDir: /var/lib/kubelet\n", "invalid csi.kubeletDir: moved to hostPaths.kubeletDir"},
		{"hbone port out of range", "hbonePort: 70000\n", "invalid hbonePort 70000: must be a port number, 1-65535"},
		{"hbone port on the capture's", "hbonePort: 18008\n", "invalid hbonePort 18008: one of the capture's own ports"},
		{"metrics port out of range", "metrics:\n  proxyPort: 0\n", "invalid metrics.proxyPort 0: must be a port number, 1-65535"},
		{"metrics port not a number", "metrics:\n  agentPort: metrics\n", "invalid metrics.agentPort metrics: must be a port number"},
		{"metrics ports the same", "metrics:\n  agentPort: 15020\n", "invalid metrics.proxyPort 15020: the same port as metrics.agentPort"},
		{"metrics port taken by the loopback ones", "metrics:\n  agentPort: 15029\n", "invalid metrics.agentPort 15029: the same port as ports.agentHTTP; the pod is hostNetwork"},
		{"metrics pod monitor mode", "metrics:\n  podMonitor:\n    enabled: yes\n", "invalid metrics.podMonitor.enabled true: must be auto, always or never"},
		{"metrics pod monitor interval", "metrics:\n  podMonitor:\n    interval: 15\n", "invalid metrics.podMonitor.interval 15: must be a Prometheus duration"},
		{"metrics scrape config without metrics", "metrics:\n  enabled: false\n  scrapeConfig:\n    enabled: true\n", "invalid metrics: podMonitor.enabled always or scrapeConfig.enabled with metrics.enabled false"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := filepath.Join(t.TempDir(), "values.yaml")
			if err := os.WriteFile(f, []byte(tt.values), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := chart.Render(context.Background(), f)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("render error = %v, want one containing %q\n%s", err, tt.want, out)
			}
		})
	}
}

// container returns the DaemonSet's container (or init container) name.
func container(t *testing.T, r *render, name string) corev1.Container {
	t.Helper()
	c, ok := findContainer(r, name)
	if !ok {
		t.Fatalf("no container %q in the DaemonSet", name)
	}
	return c
}

// findContainer returns the DaemonSet's container (or init container) name,
// if it renders one.
func findContainer(r *render, name string) (corev1.Container, bool) {
	spec := r.ds.Spec.Template.Spec
	for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
		if c.Name == name {
			return c, true
		}
	}
	return corev1.Container{}, false
}

// TestPortsAndDrain: the loopback ports, drain times and rolling update
// move together wherever they are used (flags, probes, the strategy).
func TestPortsAndDrain(t *testing.T) {
	for _, tt := range []struct {
		set                            string
		agentPort, proxyPort           int32
		shutdown, podDrain, maxUnavail string
		grace                          int64
	}{
		{"default", 15029, 18090, "20s", "30s", "1", 45},
		{"ports", 25029, 28090, "50s", "90s", "10%", 60},
	} {
		t.Run(tt.set, func(t *testing.T) {
			r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == tt.set })])
			agent, proxy := container(t, r, "aether-agent"), container(t, r, "aether-proxy")
			if want := fmt.Sprintf("--http-addr=127.0.0.1:%d", tt.agentPort); !slices.Contains(agent.Args, want) {
				t.Errorf("agent args %v lack %s", agent.Args, want)
			}
			for _, p := range []*corev1.Probe{agent.ReadinessProbe, agent.LivenessProbe} {
				if p == nil || p.HTTPGet == nil || p.HTTPGet.Port.IntVal != tt.agentPort || p.HTTPGet.Host != "127.0.0.1" {
					t.Errorf("agent probe %+v, want 127.0.0.1:%d", p, tt.agentPort)
				}
			}
			for _, want := range []string{
				fmt.Sprintf("-admin-address=127.0.0.1:%d", tt.proxyPort),
				"-shutdown-drain=" + tt.shutdown,
				"-drain-timeout=" + tt.podDrain,
			} {
				if !slices.Contains(proxy.Args, want) {
					t.Errorf("proxy args %v lack %s", proxy.Args, want)
				}
			}
			spec := r.ds.Spec
			if ru := spec.UpdateStrategy.RollingUpdate; ru == nil || ru.MaxUnavailable == nil || ru.MaxUnavailable.String() != tt.maxUnavail {
				t.Errorf("rolling update %+v, want maxUnavailable %s", spec.UpdateStrategy.RollingUpdate, tt.maxUnavail)
			}
			if g := spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g != tt.grace {
				t.Errorf("grace period %v, want %d", g, tt.grace)
			}
		})
	}
}

// TestHBONEPort: the chart's hbonePort reaches aether-proxy's -hbone-port
// and, through the installer, the capture exemption of the aether-cni
// entry it chains, as aether-cni parses it: one value, every side.
func TestHBONEPort(t *testing.T) {
	for _, tt := range []struct {
		set  string
		port int
	}{{"default", 15008}, {"ports", 15009}} {
		t.Run(tt.set, func(t *testing.T) {
			r := renderSet(t, valueSets[slices.IndexFunc(valueSets, func(v valueSet) bool { return v.name == tt.set })])
			if want := fmt.Sprintf("-hbone-port=%d", tt.port); !slices.Contains(container(t, r, "aether-proxy").Args, want) {
				t.Errorf("proxy args %v lack %s", container(t, r, "aether-proxy").Args, want)
			}
			entry := installerOptions(t, r).Config.Entry
			var m map[string]any
			if err := json.Unmarshal(entry, &m); err != nil {
				t.Fatal(err)
			}
			m["cniVersion"], m["name"] = "1.0.0", "mesh"
			b, _ := json.Marshal(m)
			mc, err := meshcni.ParseConfig(b, false)
			if err != nil {
				t.Fatalf("aether-cni rejects the installer's entry %s: %v", entry, err)
			}
			if int(mc.Capture.HBONEPort) != tt.port {
				t.Errorf("aether-cni's capture exempts HBONE port %d (entry %s), want the chart's %d", mc.Capture.HBONEPort, entry, tt.port)
			}
		})
	}
}

// TestIstioCRDs: with installCRDs auto (helm template sees no cluster, so
// no CRD exists) and always the chart renders Istio's AuthorizationPolicy
// and PeerAuthentication CRDs, byte-for-byte schema from istio.io/api and
// kept on uninstall; never renders none.
func TestIstioCRDs(t *testing.T) {
	for mode, want := range map[string]int{"auto": 2, "always": 2, "never": 0} {
		f := filepath.Join(t.TempDir(), "values.yaml")
		if err := os.WriteFile(f, []byte("policy:\n  installCRDs: "+mode+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		raw, err := chart.Render(context.Background(), f)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, o := range decodeManifests(t, raw) {
			if crd, ok := o.(*apiextensionsv1.CustomResourceDefinition); ok {
				names = append(names, crd.Name)
				if crd.Annotations["helm.sh/resource-policy"] != "keep" {
					t.Errorf("%s: CRD %s is not kept on uninstall", mode, crd.Name)
				}
				if crd.Spec.Group != "security.istio.io" || len(crd.Spec.Versions) == 0 || crd.Spec.Versions[0].Schema == nil {
					t.Errorf("%s: CRD %s has no schema of security.istio.io", mode, crd.Name)
				}
			}
		}
		if len(names) != want {
			t.Errorf("installCRDs %s rendered CRDs %v, want %d", mode, names, want)
		}
	}
}
