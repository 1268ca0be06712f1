package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/agent/nodegate"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
)

func kubePod(name string, managed bool, node string) *corev1.Pod {
	m := "false"
	if managed {
		m = "true"
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: "shop",
			Labels:      map[string]string{"app": name, "aether.io/managed": m},
			Annotations: map[string]string{"endpoint.aether.io/uds-socket": "mesh/app.sock"},
		},
		Spec: corev1.PodSpec{
			NodeName: node, ServiceAccountName: "default",
			Containers: []corev1.Container{{Name: "c", Image: "pause"}},
			Volumes: []corev1.Volume{
				{Name: "mesh", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: "csi.aether.io"}}},
				{Name: "data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
			},
		},
	}
}

// startKube runs kube-apiserver with namespace "shop" for a test that
// needs root and is skipped under -short.
func startKube(t *testing.T) *kubetest.Cluster {
	t.Helper()
	harness.RequireRoot(t)
	if testing.Short() {
		t.Skip("needs a kube-apiserver build (minutes when cold)")
	}
	cl := kubetest.Start(t)
	cl.Namespace(t, "shop")
	return cl
}

// TestKubernetesPodSource runs the agent against a real kube-apiserver:
// pods are created, labelled, annotated and deleted through the API and the
// agent follows; then the API server is stopped and a restarted agent
// serves every stored pod from disk.
func TestKubernetesPodSource(t *testing.T) {
	cl := startKube(t)
	ctx := context.Background()
	pods := cl.Client.CoreV1().Pods("shop")
	web1, err := pods.Create(ctx, kubePod("web-1", true, "node-a"), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Create(ctx, kubePod("plain", false, "node-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	dir := newAgentDirs(t)
	a := startAgent(t, dir, "--kubeconfig", cl.Kubeconfig, "--liveness-interval", "100ms")
	a.waitReady(t)
	c := a.client(t)

	resp, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "web-1", "cid-k-web-1", "10.2.0.5")})
	if err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod web-1 = %v, %v", resp, err)
	}
	got, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-web-1"})
	if err != nil || got.GetPod().GetUid() != string(web1.UID) || got.GetPod().GetServiceAccount() != "default" ||
		got.GetPod().GetUdsCsiVolume() != "mesh" || got.GetPod().GetUdsCsiVolumes() != 1 || !slices.Contains(got.GetPod().GetVolumes(), "data") || !slices.Contains(got.GetPod().GetVolumes(), "mesh") || !got.GetRegistered() {
		t.Fatalf("GetPod web-1 = %v, %v", got, err)
	}
	resp, err = c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "plain", "cid-k-plain", "10.2.0.6")})
	if err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_IGNORED {
		t.Fatalf("AddPod plain = %v, %v", resp, err)
	}

	// A pod created while AddPod waits for it is found.
	done := make(chan error, 1)
	go func() {
		r, err := c.AddPod(ctxT(t, 15*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "web-2", "cid-k-web-2", "10.2.0.7")})
		if err == nil && r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
			err = status.Errorf(codes.Unknown, "result %v", r.GetResult())
		}
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	if _, err := pods.Create(ctx, kubePod("web-2", true, "node-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("AddPod web-2 created late: %v", err)
	}

	// Label and annotate through the API: the record follows.
	p, _ := pods.Get(ctx, "web-1", metav1.GetOptions{})
	p.Labels["version"] = "v2"
	p.Annotations["note"] = "hello"
	if _, err := pods.Update(ctx, p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "label and annotation on the record", func() bool {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-web-1"})
		return err == nil && g.GetPod().GetLabels()["version"] == "v2" && g.GetPod().GetAnnotations()["note"] == "hello"
	})

	// Graceful delete: deletionTimestamp → terminating, deregistered, and
	// never re-registered by liveness (100ms ticks); the record stays.
	grace := int64(30)
	if err := pods.Delete(ctx, "web-1", metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "web-1 terminating and deregistered", func() bool {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-web-1"})
		return err == nil && g.GetPod().GetTerminating() && !g.GetRegistered()
	})
	time.Sleep(500 * time.Millisecond) // several liveness ticks
	g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-web-1"})
	if err != nil || g.GetRegistered() {
		t.Fatalf("terminating pod re-registered: %v, %v", g, err)
	}
	// A re-ADD of the terminating pod does not clear terminating.
	if r, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "web-1", "cid-k-web-1", "10.2.0.5")}); err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("re-AddPod of terminating pod = %v, %v", r, err)
	}
	g, _ = c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-web-1"})
	if !g.GetPod().GetTerminating() || g.GetRegistered() {
		t.Fatalf("after re-AddPod: %v", g)
	}
	// Force delete of web-2 (grace 0) arrives as a Delete event.
	zero := int64(0)
	if err := pods.Delete(ctx, "web-2", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "web-2 terminating after force delete", func() bool {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-web-2"})
		return err == nil && g.GetPod().GetTerminating() && !g.GetRegistered()
	})
	// web-3 stays live across the outage.
	if _, err := pods.Create(ctx, kubePod("web-3", true, "node-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if r, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "web-3", "cid-k-web-3", "10.2.0.8")}); err != nil || r.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod web-3 = %v, %v", r, err)
	}

	// API server stopped → the agent restarts and serves every stored pod
	// from disk.
	cl.Stop()
	a.kill9()
	a = startAgent(t, dir, "--kubeconfig", cl.Kubeconfig, "--liveness-interval", "100ms")
	c = a.client(t)
	for cid, want := range map[string]struct{ terminating, registered bool }{
		"cid-k-web-1": {true, false}, "cid-k-web-2": {true, false}, "cid-k-web-3": {false, true},
	} {
		g, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: cid})
		if err != nil || g.GetPod().GetTerminating() != want.terminating || g.GetRegistered() != want.registered {
			t.Fatalf("GetPod %s without API server = %v, %v; want terminating=%v registered=%v", cid, g, err, want.terminating, want.registered)
		}
	}
	if _, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-k-plain"}); status.Code(err) != codes.NotFound {
		t.Fatalf("ignored pod stored: %v", err)
	}
	// Not ready without a pod-source sync.
	if body := a.httpGet(t, "/readyz"); body == "ok\n" {
		t.Fatal("agent ready without an API server")
	}
	// Stored pods can still be removed.
	if r, err := c.RemovePod(ctxT(t, 5*time.Second), &cniv1.RemovePodRequest{Name: "web-1", Namespace: "shop", ContainerId: "cid-k-web-1"}); err != nil || r.GetResult() != cniv1.RemovePodResponse_RESULT_SUCCESS {
		t.Fatalf("RemovePod without API = %v, %v", r, err)
	}
	a.terminate(t)
}

// TestNodeGate runs the agent against a real kube-apiserver with a Node
// registered with aether.io/agent-not-ready:NoSchedule and another taint.
// The agent's identity first may not list pods: the pod source cannot sync
// and the taint stays although the CNI socket serves. Once the agent may
// list and watch pods it syncs, and the taint (only that one) goes.
func TestNodeGate(t *testing.T) {
	harness.RequireRoot(t)
	if testing.Short() {
		t.Skip("needs a kube-apiserver build (minutes when cold)")
	}
	cl := kubetest.Start(t)
	ctx := context.Background()
	const ns = "aether-system"
	cl.Namespace(t, ns)
	notReady := corev1.Taint{Key: nodegate.TaintKey, Effect: corev1.TaintEffectNoSchedule}
	other := corev1.Taint{Key: "example.com/dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}
	if _, err := cl.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-a"},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{notReady, other}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// The agent runs as a service account with the deploy/ rules minus
	// list and watch on pods.
	rbac := cl.Client.RbacV1()
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "aether-agent"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}},
			{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "patch"}},
			{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list", "watch"}},
		},
	}
	if _, err := rbac.ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "aether-agent"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "aether-agent"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "aether-agent"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "aether-agent", Namespace: ns}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tok, err := cl.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "aether-agent", &authv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := newAgentDirs(t)
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {server: %q, insecure-skip-tls-verify: true}
users:
- name: agent
  user: {token: %q}
contexts:
- name: test
  context: {cluster: test, user: agent}
current-context: test
`, cl.Config.Host, tok.Status.Token)), 0o600); err != nil {
		t.Fatal(err)
	}
	taints := func() []corev1.Taint {
		n, err := cl.Client.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n.Spec.Taints
	}

	// The API server adds its own taints (node.kubernetes.io/not-ready):
	// they must survive too.
	registered := taints()
	if !slices.Contains(registered, notReady) || !slices.Contains(registered, other) {
		t.Fatalf("registered taints = %v, want %v and %v among them", registered, notReady, other)
	}
	survivors := slices.DeleteFunc(slices.Clone(registered), func(x corev1.Taint) bool { return x == notReady })

	a := startAgent(t, dir, "--kubeconfig", kubeconfig)
	// The CNI socket serves (startAgent waited for it) but the informer's
	// list is forbidden: not synced, the taint stays.
	eventually(t, "the pod list forbidden", func() bool { return strings.Contains(a.logs.String(), "forbidden") })
	if got := taints(); !slices.Equal(got, registered) {
		t.Fatalf("taints before the pod source synced = %v, want %v", got, registered)
	}
	if a.logs.find("agent ready") != nil || a.logs.find("removed node taint") != nil {
		t.Fatalf("agent ready or taint removed before the pod source synced:\n%s", a.logs.String())
	}

	role.Rules[0].Verbs = []string{"get", "list", "watch"}
	if _, err := rbac.ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	a.waitReady(t)
	eventually(t, "the not-ready taint removed", func() bool { return slices.Equal(taints(), survivors) })
	// The agent logs the removal after the API server answered it: wait
	// for the line too before reading the order.
	eventually(t, "the taint removal logged", func() bool { return a.logs.find("removed node taint") != nil })
	// Lifecycle order: node_gate starts after cni_socket; the taint goes
	// after the agent is ready.
	var order []string
	for _, l := range a.logs.logLines() {
		if l["msg"] == "started" && (l["part"] == "cni_socket" || l["part"] == "node_gate") {
			order = append(order, l["part"].(string))
		}
		if l["msg"] == "agent ready" || l["msg"] == "removed node taint" {
			order = append(order, l["msg"].(string))
		}
	}
	if want := []string{"cni_socket", "node_gate", "agent ready", "removed node taint"}; !slices.Equal(order, want) {
		t.Errorf("order = %q, want %q", order, want)
	}
}

// TestKubernetesPodOtherNodeRefused: the agent (node-a) finds pods of
// another node, and pods not scheduled yet, through the API server's GET
// on a cache miss, and refuses their AddPod with PermissionDenied naming
// the pod, its nodeName and this node; nothing is recorded for them.
func TestKubernetesPodOtherNodeRefused(t *testing.T) {
	cl := startKube(t)
	ctx := context.Background()
	pods := cl.Client.CoreV1().Pods("shop")
	for name, node := range map[string]string{"theirs": "node-b", "unscheduled": ""} {
		if _, err := pods.Create(ctx, kubePod(name, true, node), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	dir := newAgentDirs(t)
	a := startAgent(t, dir, "--kubeconfig", cl.Kubeconfig)
	a.waitReady(t)
	c := a.client(t)
	for name, node := range map[string]string{"theirs": "node-b", "unscheduled": ""} {
		_, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", name, "cid-"+name, "10.2.0.9")})
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("AddPod %s (nodeName %q) = %v; want PermissionDenied", name, node, err)
		}
		for _, w := range []string{"shop/" + name, fmt.Sprintf("spec.nodeName is %q", node), `this node is "node-a"`} {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("refusal %q does not contain %q", err, w)
			}
		}
		if _, err := c.GetPod(ctxT(t, 5*time.Second), &cniv1.GetPodRequest{ContainerId: "cid-" + name}); status.Code(err) != codes.NotFound {
			t.Errorf("GetPod %s after the refusal = %v; want NotFound (no record)", name, err)
		}
	}
	if l := a.logs.find("pod refused: not scheduled to this node"); l == nil {
		t.Error("no log line for the refused pod")
	}
}

// TestKubernetesNamespaceEnrolment runs the agent against a real
// kube-apiserver: a pod without a label of its own is ignored at ADD until
// its namespace is labelled aether.io/managed=true, then enrolled; a pod
// labelled
// aether.io/managed=false in that namespace stays out; the label removed,
// a new sandbox of the pod is ignored again.
func TestKubernetesNamespaceEnrolment(t *testing.T) {
	cl := startKube(t)
	ctx := context.Background()
	pods := cl.Client.CoreV1().Pods("shop")
	plain := kubePod("plain", false, "node-a")
	delete(plain.Labels, "aether.io/managed") // no label of its own
	if _, err := pods.Create(ctx, plain, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Create(ctx, kubePod("out", false, "node-a"), metav1.CreateOptions{}); err != nil { // aether.io/managed: "false"
		t.Fatal(err)
	}
	a := startAgent(t, newAgentDirs(t), "--kubeconfig", cl.Kubeconfig)
	a.waitReady(t)
	c := a.client(t)
	sandbox := 0
	add := func(name string) cniv1.AddPodResponse_Result {
		t.Helper()
		sandbox++
		cid := fmt.Sprintf("cid-ns-%s-%d", name, sandbox)
		resp, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", name, cid, fmt.Sprintf("10.3.0.%d", sandbox))})
		if err != nil {
			t.Fatalf("AddPod %s: %v", name, err)
		}
		if resp.GetResult() == cniv1.AddPodResponse_RESULT_SUCCESS {
			if _, err := c.RemovePod(ctxT(t, 5*time.Second), &cniv1.RemovePodRequest{ContainerId: cid, Namespace: "shop", Name: name}); err != nil {
				t.Fatalf("RemovePod %s: %v", cid, err)
			}
		}
		return resp.GetResult()
	}
	label := func(v *string) {
		t.Helper()
		ns, err := cl.Client.CoreV1().Namespaces().Get(ctx, "shop", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if v == nil {
			delete(ns.Labels, "aether.io/managed")
		} else {
			if ns.Labels == nil {
				ns.Labels = map[string]string{}
			}
			ns.Labels["aether.io/managed"] = *v
		}
		if _, err := cl.Client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if r := add("plain"); r != cniv1.AddPodResponse_RESULT_IGNORED {
		t.Fatalf("AddPod plain in an unlabelled namespace = %v, want RESULT_IGNORED", r)
	}
	on := "true"
	label(&on)
	eventually(t, "plain enrolled by its namespace's label", func() bool { return add("plain") == cniv1.AddPodResponse_RESULT_SUCCESS })
	if r := add("out"); r != cniv1.AddPodResponse_RESULT_IGNORED {
		t.Fatalf("AddPod of a pod labelled false in an enrolled namespace = %v, want RESULT_IGNORED", r)
	}
	label(nil)
	eventually(t, "plain ignored again once the label is gone", func() bool { return add("plain") == cniv1.AddPodResponse_RESULT_IGNORED })
}
