package manifests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"aether.io/node/agent/podsource"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		in      string
		want    []string
		wantErr string
	}{
		{"yaml multi-doc", "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: b, namespace: x}\n", []string{"default/a", "x/b"}, ""},
		{"json", `{"apiVersion":"v1","kind":"Pod","metadata":{"name":"j","namespace":"n"}}`, []string{"n/j"}, ""},
		{"empty docs skipped", "---\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: a}\n", []string{"default/a"}, ""},
		{"services skipped", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s-1}\naddressType: IPv4\nendpoints: []\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: a}\n", []string{"default/a"}, ""},
		{"other kind", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n", nil, "only v1 Pod, v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Namespace, security.istio.io/v1 AuthorizationPolicy and security.istio.io/v1 PeerAuthentication are allowed"},
		{"no name", "apiVersion: v1\nkind: Pod\nmetadata: {namespace: a}\n", nil, "metadata.name is required"},
		{"garbage", "apiVersion: [\n", nil, "failed to parse"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pods, err := Parse([]byte(tc.in))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, p := range pods {
				got = append(got, p.Namespace+"/"+p.Name)
			}
			if strings.Join(got, ",") != strings.Join(tc.want, ",") {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

func TestFromKubeCSIVolumes(t *testing.T) {
	pods, err := Parse([]byte(`apiVersion: v1
kind: Pod
metadata:
  name: a
  uid: u1
  deletionTimestamp: "2026-01-01T00:00:00Z"
  ownerReferences:
  - {apiVersion: apps/v1, kind: ReplicaSet, name: web-7d9, uid: r1, controller: true}
spec:
  hostNetwork: true
  serviceAccountName: sa
  volumes:
  - {name: m1, csi: {driver: csi.aether.io}}
  - {name: m2, csi: {driver: csi.aether.io}}
  - {name: other, csi: {driver: other.csi}}
  - {name: e, emptyDir: {}}
`))
	if err != nil {
		t.Fatal(err)
	}
	p := podsource.FromKube(pods[0])
	if p.UDSCSIVolume != "" || p.UDSCSIVolumes != 2 || strings.Join(p.Volumes, ",") != "m1,m2,other,e" || !p.Terminating ||
		p.Owner == nil || p.Owner.Kind != "ReplicaSet" || p.Owner.Name != "web-7d9" || !p.HostNetwork || p.ServiceAccount != "sa" || p.UID != "u1" ||
		!p.FixedName {
		t.Fatalf("FromKube = %+v", p)
	}
	pods[0].GenerateName = "web-7d9-"
	if p := podsource.FromKube(pods[0]); p.FixedName {
		t.Fatalf("FromKube of a pod with generateName = %+v, want FixedName false", p)
	}
}

// FuzzParse: the parser never panics, and every pod it returns has a name
// and a namespace.
func FuzzParse(f *testing.F) {
	f.Add([]byte("apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"))
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"name":"j"},"spec":{"volumes":[{"name":"m","csi":{"driver":"csi.aether.io"}}]}}`))
	f.Add([]byte("---\n---\n"))
	f.Add([]byte("kind: Pod\nmetadata:\n  name: [x\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		pods, err := Parse(data)
		if err != nil {
			return
		}
		for _, p := range pods {
			if p.Name == "" || p.Namespace == "" {
				t.Fatalf("pod without name or namespace: %+v", p.ObjectMeta)
			}
			_ = podsource.FromKube(p)
		}
	})
}

// TestUnquotedNodeNameWarns pins the YAML 1.1 trap: `nodeName: n` decodes as
// "false", the pod is not this node's, and the source says so with the fix.
func TestUnquotedNodeNameWarns(t *testing.T) {
	dir := t.TempDir()
	manifest := "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec:\n  nodeName: n\n  containers: [{name: c, image: i}]\n"
	if err := os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	s := New(dir, "n", time.Second, slog.New(slog.NewTextHandler(&logs, nil)))
	_, err := s.Fetch(context.Background(), "default", "a")
	if !errors.Is(err, podsource.ErrNotFound) {
		t.Fatalf("Fetch = %v, want ErrNotFound (the pod decodes with nodeName \"false\")", err)
	}
	if got := logs.String(); !strings.Contains(got, "level=WARN") || !strings.Contains(got, "quote the node name") || !strings.Contains(got, `node_name=false`) {
		t.Fatalf("want a warning naming the YAML boolean, got logs:\n%s", got)
	}

	// Quoted, the same pod is this node's.
	manifest = strings.Replace(manifest, "nodeName: n", `nodeName: "n"`, 1)
	if err := os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(manifest+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Fetch(context.Background(), "default", "a"); err != nil {
		t.Fatalf("Fetch with a quoted nodeName = %v", err)
	}
}

// blockingHandler blocks OnPod of the pod named slow until release closes,
// telling entered first.
type blockingHandler struct {
	slow    string
	entered chan struct{}
	release chan struct{}
}

func (h blockingHandler) OnPod(p *podsource.Pod) {
	if p.Name == h.slow {
		close(h.entered)
		<-h.release
	}
}

func (h blockingHandler) OnDelete(*podsource.Pod) {}

// TestGetDoesNotWaitForHandler: while the handler is busy with one pod (the
// agent deregistering a terminating pod while etcd is away, up to seconds),
// Get of a pod whose manifest just appeared finds it by its rescan instead
// of waiting for the handler (regression: AddPod outlived aether-cni's
// deadline in test/multinode no_quorum).
func TestGetDoesNotWaitForHandler(t *testing.T) {
	dir := t.TempDir()
	write := func(name string) {
		t.Helper()
		m := "apiVersion: v1\nkind: Pod\nmetadata: {name: " + name + ", namespace: ns}\nspec:\n  containers: [{name: c, image: i}]\n"
		if err := os.WriteFile(filepath.Join(dir, name+".yaml"), []byte(m), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("slow")
	s := New(dir, "n", time.Hour, nil)
	h := blockingHandler{slow: "slow", entered: make(chan struct{}), release: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- s.Run(ctx, h) }()
	released := false
	t.Cleanup(func() {
		if !released {
			close(h.release)
		}
		cancel()
		<-ran
	})
	<-h.entered

	write("fast")
	got := make(chan error, 1)
	go func() { _, err := s.Get(ctx, "ns", "fast"); got <- err }()
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("Get of the new pod = %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Get waited for the handler busy with another pod")
	}
	close(h.release)
	released = true
	select {
	case <-s.Synced():
	case <-time.After(30 * time.Second):
		t.Fatal("not synced after the handler returned")
	}
}

// TestDeclaredPorts: a manifest's container ports reach the pod the source
// returns: TCP (and unset protocol) of its containers and sidecars
// (restartable init containers), not UDP or SCTP, not a plain init
// container's; a pod without ports has none.
func TestDeclaredPorts(t *testing.T) {
	dir := t.TempDir()
	m := `apiVersion: v1
kind: Pod
metadata: {name: web, namespace: ns}
spec:
  initContainers:
  - name: proxy
    image: i
    restartPolicy: Always
    ports: [{containerPort: 15090}, {containerPort: 15091, protocol: UDP}]
  - name: migrate
    image: i
    ports: [{containerPort: 7000}]
  containers:
  - name: app
    image: i
    ports:
    - {containerPort: 8080, protocol: TCP}
    - {containerPort: 9090}
    - {containerPort: 53, protocol: UDP}
    - {containerPort: 5000, protocol: SCTP}
---
apiVersion: v1
kind: Pod
metadata: {name: bare, namespace: ns}
spec:
  containers: [{name: c, image: i}]
`
	if err := os.WriteFile(filepath.Join(dir, "pods.yaml"), []byte(m), 0o600); err != nil {
		t.Fatal(err)
	}
	s := New(dir, "n", time.Hour, nil)
	p, err := s.Get(context.Background(), "ns", "web")
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(p.DeclaredTCPPorts); got != "[8080 9090 15090]" {
		t.Fatalf("DeclaredTCPPorts = %s, want [8080 9090 15090]", got)
	}
	p, err = s.Get(context.Background(), "ns", "bare")
	if err != nil {
		t.Fatal(err)
	}
	if len(p.DeclaredTCPPorts) != 0 {
		t.Fatalf("DeclaredTCPPorts of a pod declaring none = %v", p.DeclaredTCPPorts)
	}
}

// TestBrokenManifestLoggedOnce: a manifest rewritten into something that
// does not parse keeps its pods and is logged once, not at every rescan;
// fixed, it is read again.
func TestBrokenManifestLoggedOnce(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a.yaml")
	good := "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec:\n  containers: [{name: c, image: i}]\n"
	if err := os.WriteFile(path, []byte(good), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	s := New(dir, "n", time.Second, slog.New(slog.NewTextHandler(&logs, nil)))
	if _, err := s.Fetch(context.Background(), "default", "a"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("apiVersion: [\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		s.scan()
	}
	if n := strings.Count(logs.String(), "failed to parse pod manifest"); n != 1 {
		t.Errorf("a broken manifest was logged %d times over 3 rescans, want once:\n%s", n, logs.String())
	}
	if len(s.List()) != 1 {
		t.Errorf("the broken manifest's pod was dropped: %v", s.List())
	}
	if err := os.WriteFile(path, []byte(strings.Replace(good, "name: a", "name: b", 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Fetch(context.Background(), "default", "b"); err != nil {
		t.Fatalf("the fixed manifest is not read again: %v", err)
	}
}

// TestNamespaceLabels: a Namespace object in the directory gives its
// labels; rewriting it without them, or removing its file, takes them
// away; a namespace without an object is known and unlabelled.
func TestNamespaceLabels(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "shop.yaml")
	write := func(labels string, mod time.Time) {
		t.Helper()
		m := "apiVersion: v1\nkind: Namespace\nmetadata: {name: shop" + labels + "}\n---\n" +
			"apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: shop}\n"
		if err := os.WriteFile(path, []byte(m), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(path, mod, mod); err != nil { // a new stamp even within the clock's resolution
			t.Fatal(err)
		}
	}
	s := New(dir, "n", time.Hour, nil)
	labelsOf := func(ns string) string {
		t.Helper()
		s.scan()
		l, ok := s.NamespaceLabels(ns)
		if !ok {
			t.Fatalf("NamespaceLabels(%q): not known", ns)
		}
		return fmt.Sprint(l)
	}
	base := time.Now()
	write(", labels: {aether.io/managed: \"true\"}", base)
	if got := labelsOf("shop"); got != "map[aether.io/managed:true]" {
		t.Fatalf("labels of shop = %s, want aether.io/managed=true", got)
	}
	if _, err := s.Get(context.Background(), "shop", "web"); err != nil {
		t.Fatalf("the pod beside the Namespace object: %v", err)
	}
	write("", base.Add(time.Second))
	if got := labelsOf("shop"); got != "map[]" {
		t.Fatalf("labels of shop after the label was removed = %s, want none", got)
	}
	write(", labels: {aether.io/managed: \"true\"}", base.Add(2*time.Second))
	if got := labelsOf("shop"); got != "map[aether.io/managed:true]" {
		t.Fatalf("labels of shop after the label came back = %s, want aether.io/managed=true", got)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if got := labelsOf("shop"); got != "map[]" {
		t.Fatalf("labels of shop after its file was removed = %s, want none", got)
	}
	if got := labelsOf("other"); got != "map[]" {
		t.Fatalf("labels of a namespace without an object = %s, want none", got)
	}
}
