package e2e

import (
	"context"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"aether.io/node/agent/internal/kubetest"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/test/harness"
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
