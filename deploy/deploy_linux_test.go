package deploy_test

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"aether.io/node/agent/adminapi"
	"aether.io/node/agent/app"
	"aether.io/node/agent/nodegate"
	"aether.io/node/enivlan/config"
	"aether.io/node/meshcni"
	"aether.io/node/test/harness"
	workloadclient "aether.io/node/xds/workload/client"
)

func decodeManifests(t *testing.T) []any {
	t.Helper()
	raw, err := os.ReadFile("aether-node.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dec := serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()
	r := yamlutil.NewYAMLReader(bufioReader(raw))
	var objs []any
	for {
		doc, err := r.Read()
		if err != nil {
			break
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("manifest document does not decode strictly: %v\n%s", err, doc)
		}
		t.Logf("decoded %s", gvk.Kind)
		objs = append(objs, obj)
	}
	if len(objs) < 5 {
		t.Fatalf("decoded %d objects, want the namespace, RBAC and the DaemonSet", len(objs))
	}
	return objs
}

func container(t *testing.T, objs []any, name string) corev1.Container {
	t.Helper()
	for _, o := range objs {
		if ds, ok := o.(*appsv1.DaemonSet); ok {
			for _, c := range ds.Spec.Template.Spec.Containers {
				if c.Name == name {
					return c
				}
			}
		}
	}
	t.Fatalf("no container %q in the DaemonSet", name)
	return corev1.Container{}
}

func expand(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = strings.ReplaceAll(a, "$(NODE_NAME)", "node-1")
	}
	return out
}

func TestAgentArgsParse(t *testing.T) {
	objs := decodeManifests(t)
	c := container(t, objs, "aether-agent")
	var stderr bytes.Buffer
	cfg, err := app.ParseFlags(expand(c.Args), &stderr)
	if err != nil {
		t.Fatalf("aether-agent rejects the manifest's args: %v\n%s", err, stderr.String())
	}
	if cfg.NodeName != "node-1" || cfg.XDSSocket == "" || cfg.LDSSocket == "" {
		t.Fatalf("unexpected agent config %+v", cfg)
	}
}

// TestNodeGating checks the agent removes the not-ready taint and its
// ClusterRole allows the patch that does it.
func TestNodeGating(t *testing.T) {
	objs := decodeManifests(t)
	cfg, err := app.ParseFlags(expand(container(t, objs, "aether-agent").Args), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if !cfg.RemoveNotReadyTaint || cfg.PodManifests != "" {
		t.Fatalf("the agent must use the Kubernetes pod source and remove %s (--remove-not-ready-taint)", nodegate.TaintKey)
	}
	for _, o := range objs {
		if r, ok := o.(*rbacv1.ClusterRole); ok && r.Name == "aether-agent" {
			for _, rule := range r.Rules {
				if slices.Contains(rule.APIGroups, "") && slices.Contains(rule.Resources, "nodes") &&
					slices.Contains(rule.Verbs, "get") && slices.Contains(rule.Verbs, "patch") {
					return
				}
			}
			t.Fatalf("ClusterRole aether-agent does not allow get and patch on nodes: %+v", r.Rules)
		}
	}
	t.Fatal("no ClusterRole aether-agent")
}

// TestSocketLayout checks every side names the same sockets, and that they
// sit in a directory of their own below the hostPath: kubelet creates the
// hostPath 0755, which the agent refuses as a socket directory.
func TestSocketLayout(t *testing.T) {
	objs := decodeManifests(t)
	cfg, err := app.ParseFlags(expand(container(t, objs, "aether-agent").Args), &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	var hostPath string
	for _, o := range objs {
		if ds, ok := o.(*appsv1.DaemonSet); ok {
			for _, v := range ds.Spec.Template.Spec.Volumes {
				if v.Name == "run-aether" && v.HostPath != nil {
					hostPath = v.HostPath.Path
				}
			}
		}
	}
	if hostPath == "" {
		t.Fatal("no run-aether hostPath volume")
	}
	for _, s := range []string{cfg.CNISocket, cfg.AdminSocket, cfg.XDSSocket, cfg.LDSSocket} {
		if dir := filepath.Dir(s); dir != app.SocketDir || dir == hostPath {
			t.Errorf("agent socket %q: want it in %s, a directory of its own below the hostPath %s", s, app.SocketDir, hostPath)
		}
	}
	// aetherctl's defaults (it runs on the node, in the agent's container)
	// name the agent's default sockets.
	def, err := app.ParseFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if adminapi.DefaultSocket != def.AdminSocket || workloadclient.DefaultSocket != def.XDSSocket {
		t.Errorf("aetherctl defaults admin %q, xds %q; the agent's are %q, %q", adminapi.DefaultSocket, workloadclient.DefaultSocket, def.AdminSocket, def.XDSSocket)
	}
	proxyArgs := expand(container(t, objs, "aether-proxy").Args)
	for _, want := range []string{"-xds-address=unix://" + cfg.XDSSocket, "-lds-address=unix://" + cfg.LDSSocket} {
		if !slices.Contains(proxyArgs, want) {
			t.Errorf("aether-proxy args %q lack %q", proxyArgs, want)
		}
	}
	raw, err := os.ReadFile(filepath.Join("cni", "10-aether.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.NetworkConfFromBytes(raw)
	if err != nil {
		t.Fatal(err)
	}
	var entry struct {
		AgentSocket string `json:"agent_socket"`
	}
	if err := json.Unmarshal(list.Plugins[len(list.Plugins)-1].Bytes, &entry); err != nil {
		t.Fatal(err)
	}
	if entry.AgentSocket != cfg.CNISocket || entry.AgentSocket != meshcni.DefaultAgentSocket {
		t.Errorf("conflist agent_socket %q, agent --cni-socket %q, aether-cni default %q: want one path", entry.AgentSocket, cfg.CNISocket, meshcni.DefaultAgentSocket)
	}
}

func TestProxyArgsExist(t *testing.T) {
	objs := decodeManifests(t)
	c := container(t, objs, "aether-proxy")
	bin := filepath.Join(harness.BuildOwn(t, "aether-proxy"), "aether-proxy")
	out, _ := exec.Command(bin, "-h").CombinedOutput()
	known := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z-]+)`).FindAllStringSubmatch(string(out), -1) {
		known[m[1]] = true
	}
	if len(known) == 0 {
		t.Fatalf("could not read aether-proxy's flags from -h:\n%s", out)
	}
	for _, a := range expand(c.Args) {
		name := strings.TrimLeft(strings.SplitN(a, "=", 2)[0], "-")
		if !known[name] {
			t.Errorf("aether-proxy has no flag %q (manifest arg %q)", name, a)
		}
	}
}

func TestConflistParses(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("cni", "10-aether.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.NetworkConfFromBytes(raw)
	if err != nil {
		t.Fatalf("libcni rejects the conflist: %v", err)
	}
	if len(list.Plugins) != 2 || list.Plugins[0].Network.Type != "eni-vlan" || list.Plugins[1].Network.Type != "aether-cni" {
		t.Fatalf("want eni-vlan then aether-cni, got %d plugins", len(list.Plugins))
	}
	// Each plugin gets its object with the list's name and version, as
	// libcni passes it.
	inject := func(b []byte) []byte {
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		m["cniVersion"], m["name"] = list.CNIVersion, list.Name
		out, _ := json.Marshal(m)
		return out
	}
	if _, err := config.Parse(inject(list.Plugins[0].Bytes)); err != nil {
		t.Errorf("eni-vlan rejects its netconf: %v", err)
	}
	mc, err := meshcni.ParseConfig(inject(list.Plugins[1].Bytes), false)
	if err != nil {
		t.Fatalf("aether-cni rejects its netconf: %v", err)
	}
	if !mc.Capture.RedirectAll {
		t.Error("the node conflist must divert every port (redirect_all), or pod traffic is not captured")
	}
}
