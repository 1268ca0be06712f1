package deploy_test

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"aether.io/node/agent/app"
	"aether.io/node/enivlan/config"
	"aether.io/node/meshcni"
	"aether.io/node/test/harness"
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
