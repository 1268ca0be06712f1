package e2e

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	cniv1 "aether.io/node/api/aether/cni/v1"
)

// TestKubeRegistryServesOtherNodes: with --registry=kube (the chart's
// default) an agent serves, next to its own pods, every other node's running
// mesh-managed pod it reads from the API, and withdraws one once it
// terminates; unmanaged pods of other nodes are never served.
func TestKubeRegistryServesOtherNodes(t *testing.T) {
	cl := startKube(t)
	ctx := context.Background()
	pods := cl.Client.CoreV1().Pods("shop")
	running := func(name string, managed bool, node, ip string) {
		t.Helper()
		p, err := pods.Create(ctx, kubePod(name, managed, node), metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// No kubelet: the test reports the pod running, as node-b's would.
		p.Status = corev1.PodStatus{
			Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
		}
		if _, err := pods.UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	running("remote-web", true, "node-b", "10.2.1.5")
	running("remote-plain", false, "node-b", "10.2.1.6")
	if _, err := pods.Create(ctx, kubePod("local-web", true, "node-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	dir := newAgentDirs(t)
	a := startAgent(t, dir, "--kubeconfig", cl.Kubeconfig, "--registry", "kube")
	a.waitReady(t)
	if resp, err := a.client(t).AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "local-web", "cid-local-web", "10.2.0.5")}); err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod local-web = %v, %v", resp, err)
	}
	w := watchAgentXDS(t, dir+"/run/xds.sock")
	const remote, local, plain = "Kubernetes//Pod/shop/remote-web", "Kubernetes//Pod/shop/local-web", "Kubernetes//Pod/shop/remote-plain"
	eventually(t, "the other node's managed pod and this node's pod served", func() bool { return w.serves(remote, local) })
	if !w.lacks(plain) {
		t.Fatal("an unmanaged pod of another node is served")
	}

	// Terminating on node-b: withdrawn.
	if err := pods.Delete(ctx, "remote-web", metav1.DeleteOptions{GracePeriodSeconds: new(int64(30))}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the terminating remote pod withdrawn", func() bool { return w.lacks(remote) })
	if !w.serves(local) {
		t.Fatal("this node's pod was withdrawn with the remote one")
	}
	a.terminate(t)
}
