package kube_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"aether.io/node/pkg/enrolment"
	"aether.io/node/registry"
	"aether.io/node/registry/kube"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
)

func TestMain(m *testing.M) { harness.Main(m) }

const managed = "aether.io/managed"

// events collects a Watch into the latest endpoint per key.
type events struct {
	ch   <-chan registry.Event
	seen map[string]registry.Endpoint
}

// waitFor reads events until cond holds on the view (30 s at most).
func (e *events) waitFor(t *testing.T, what string, cond func(map[string]registry.Endpoint) bool) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for !cond(e.seen) {
		select {
		case ev := <-e.ch:
			if ev.Type == registry.EventPut {
				e.seen[ev.Key] = ev.Endpoint
			} else {
				delete(e.seen, ev.Key)
			}
		case <-deadline:
			t.Fatalf("timed out waiting for %s; view %+v", what, e.seen)
		}
	}
}

func createPod(t *testing.T, cl *kubetest.Cluster, ns, name, node string, lbl map[string]string, ips ...string) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	p, err := cl.Client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Labels: lbl,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "web-7d9f8c6b5", UID: types.UID("rs-uid"), Controller: ptr.To(true)}},
		},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: "web", Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	setStatus(t, cl, p, true, ips...)
	return p
}

// setStatus makes the pod Running with ips and the Ready condition given.
func setStatus(t *testing.T, cl *kubetest.Cluster, p *corev1.Pod, isReady bool, ips ...string) {
	t.Helper()
	ctx := context.Background()
	cur, err := cl.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	status := corev1.ConditionFalse
	if isReady {
		status = corev1.ConditionTrue
	}
	cur.Status.Phase = corev1.PodRunning
	cur.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}
	cur.Status.PodIPs = nil
	for _, ip := range ips {
		cur.Status.PodIPs = append(cur.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	if len(ips) > 0 {
		cur.Status.PodIP = ips[0]
	}
	if _, err := cl.Client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestKubeRegistry runs the backend against a real kube-apiserver: other
// nodes' managed running pods appear with their node's locality and
// readiness, follow relabels, readiness and node label changes, and leave
// when terminating; this node's pods come only from Register.
func TestKubeRegistry(t *testing.T) {
	harness.RequireRoot(t)
	if testing.Short() {
		t.Skip("needs a kube-apiserver build (minutes when cold)")
	}
	cl := kubetest.Start(t)
	ctx := context.Background()
	for _, ns := range []string{"shop", "kube-system"} {
		cl.Namespace(t, ns)
		// No controller-manager: the pods' service account is made here.
		if _, err := cl.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "web"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cl.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: "node-b", Labels: map[string]string{corev1.LabelTopologyRegion: "eu", corev1.LabelTopologyZone: "eu-1a", kube.SubzoneLabel: "rack1"},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	r, err := kube.New(kube.Options{Client: cl.Client, Node: "node-a", Rules: enrolment.Rules{SystemNamespaces: []string{"kube-system"}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	wctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	ch, err := r.Watch(wctx)
	if err != nil {
		t.Fatal(err)
	}
	ev := &events{ch: ch, seen: map[string]registry.Endpoint{}}
	if !r.WaitForSync(ctx) {
		t.Fatal("never synced")
	}

	on := map[string]string{managed: "true", "app": "web"}
	web := createPod(t, cl, "shop", "web-1", "node-b", on, "10.2.0.5", "fd00:2::5")
	createPod(t, cl, "shop", "plain-1", "node-b", map[string]string{"app": "plain"}, "10.2.0.6")
	createPod(t, cl, "shop", "local-1", "node-a", on, "10.1.0.5")
	createPod(t, cl, "kube-system", "sys-1", "node-b", on, "10.2.0.7")
	key := kube.KeyPrefix + string(web.UID)
	ev.waitFor(t, "web-1 from node-b", func(v map[string]registry.Endpoint) bool { return v[key].Healthy })
	got := ev.seen[key]
	want := registry.Endpoint{
		Key: key, Node: "node-b", Namespace: "shop", Name: "web-1", UID: string(web.UID),
		IPs: []netip.Addr{netip.MustParseAddr("10.2.0.5"), netip.MustParseAddr("fd00:2::5")}, ServiceAccount: "web",
		Labels: on, Owner: &registry.Owner{Kind: "ReplicaSet", Name: "web-7d9f8c6b5"}, FixedName: true, Healthy: true,
		Locality: registry.Locality{Region: "eu", Zone: "eu-1a", Subzone: "rack1"},
	}
	// The API server may add labels of its own (the node's topology labels,
	// PodTopologyLabels admission): the pod's labels are served as the API
	// has them.
	for k, v := range on {
		if got.Labels[k] != v {
			t.Fatalf("label %s=%q missing from %v", k, v, got.Labels)
		}
	}
	want.Labels = got.Labels
	if !equal(got, want) {
		t.Fatalf("endpoint\n got %+v\nwant %+v", got, want)
	}

	// This node's endpoints come from Register; ListNode lists them alone.
	own := registry.Endpoint{Key: "sandbox-1", Node: "node-a", Namespace: "shop", Name: "local-1", IPs: []netip.Addr{netip.MustParseAddr("10.1.0.5")}, Healthy: true}
	if err := r.Register(ctx, own); err != nil {
		t.Fatal(err)
	}
	if err := r.Register(ctx, registry.Endpoint{Key: kube.KeyPrefix + "x"}); err == nil {
		t.Fatal("a key with the watch's prefix was accepted")
	}
	ev.waitFor(t, "the registered endpoint", func(v map[string]registry.Endpoint) bool { _, ok := v["sandbox-1"]; return ok })
	nodeOnly, err := r.ListNode(ctx)
	if err != nil || len(nodeOnly) != 1 || nodeOnly[0].Key != "sandbox-1" {
		t.Fatalf("ListNode = %v, %v; want sandbox-1 alone", nodeOnly, err)
	}
	all, err := r.List(ctx)
	if err != nil || len(all) != 2 {
		t.Fatalf("List = %v, %v; want sandbox-1 and web-1 (not the unmanaged, local or system pods)", all, err)
	}

	// Not ready: served unhealthy.
	setStatus(t, cl, web, false, "10.2.0.5", "fd00:2::5")
	ev.waitFor(t, "web-1 unhealthy", func(v map[string]registry.Endpoint) bool { e, ok := v[key]; return ok && !e.Healthy })

	// The node moves zone: its pods follow.
	n, err := cl.Client.CoreV1().Nodes().Get(ctx, "node-b", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	n.Labels[corev1.LabelTopologyZone] = "eu-1b"
	if _, err := cl.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ev.waitFor(t, "web-1 in eu-1b", func(v map[string]registry.Endpoint) bool { return v[key].Locality.Zone == "eu-1b" })

	// Unlabelled: gone.
	cur, err := cl.Client.CoreV1().Pods("shop").Get(ctx, "web-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Labels = map[string]string{"app": "web"}
	if _, err := cl.Client.CoreV1().Pods("shop").Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ev.waitFor(t, "web-1 withdrawn once unmanaged", func(v map[string]registry.Endpoint) bool { _, ok := v[key]; return !ok })

	// Terminating (no kubelet finishes the deletion): gone, never back.
	web2 := createPod(t, cl, "shop", "web-2", "node-b", on, "10.2.0.8")
	key2 := kube.KeyPrefix + string(web2.UID)
	ev.waitFor(t, "web-2", func(v map[string]registry.Endpoint) bool { _, ok := v[key2]; return ok })
	if err := cl.Client.CoreV1().Pods("shop").Delete(ctx, "web-2", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](30)}); err != nil {
		t.Fatal(err)
	}
	ev.waitFor(t, "web-2 withdrawn while terminating", func(v map[string]registry.Endpoint) bool { _, ok := v[key2]; return !ok })
	if p, err := cl.Client.CoreV1().Pods("shop").Get(ctx, "web-2", metav1.GetOptions{}); err != nil || p.DeletionTimestamp == nil {
		t.Fatalf("web-2 should still exist, terminating: %v, %v", p, err)
	}

	testNamespaceEnrolment(t, cl, ev)
}

// testNamespaceEnrolment: another node's pod without a label is served while
// its namespace is enrolled (as its own agent decides at ADD), one that opts
// out never is, and the namespace's label removed withdraws it.
func testNamespaceEnrolment(t *testing.T, cl *kubetest.Cluster, ev *events) {
	ctx := context.Background()
	ns, err := cl.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: "enrolled", Labels: map[string]string{managed: "true"},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Client.CoreV1().ServiceAccounts(ns.Name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "web"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	plain := createPod(t, cl, ns.Name, "plain-1", "node-b", map[string]string{"app": "plain"}, "10.2.0.9")
	out := createPod(t, cl, ns.Name, "out-1", "node-b", map[string]string{"app": "out", managed: "false"}, "10.2.0.10")
	key, outKey := kube.KeyPrefix+string(plain.UID), kube.KeyPrefix+string(out.UID)
	ev.waitFor(t, "the unlabelled pod of the enrolled namespace", func(v map[string]registry.Endpoint) bool { return v[key].Healthy })
	if _, ok := ev.seen[outKey]; ok {
		t.Fatal("a pod labelled aether.io/managed=false in an enrolled namespace was served")
	}
	ns.Labels = nil
	if _, err := cl.Client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	ev.waitFor(t, "the pod withdrawn once its namespace is not enrolled", func(v map[string]registry.Endpoint) bool { _, ok := v[key]; return !ok })
	if _, ok := ev.seen[outKey]; ok {
		t.Fatal("the opted-out pod was served")
	}
}

func equal(a, b registry.Endpoint) bool {
	if len(a.IPs) != len(b.IPs) || len(a.Labels) != len(b.Labels) || (a.Owner == nil) != (b.Owner == nil) {
		return false
	}
	for i := range a.IPs {
		if a.IPs[i] != b.IPs[i] {
			return false
		}
	}
	for k, v := range a.Labels {
		if b.Labels[k] != v {
			return false
		}
	}
	if a.Owner != nil && *a.Owner != *b.Owner {
		return false
	}
	a.IPs, b.IPs, a.Labels, b.Labels, a.Owner, b.Owner = nil, nil, nil, nil, nil, nil
	return a.Key == b.Key && a.Node == b.Node && a.Namespace == b.Namespace && a.Name == b.Name && a.UID == b.UID &&
		a.ServiceAccount == b.ServiceAccount && a.HostNetwork == b.HostNetwork && a.FixedName == b.FixedName &&
		a.Healthy == b.Healthy && a.Locality == b.Locality
}
