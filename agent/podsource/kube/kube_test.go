package kube

import (
	"context"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"aether.io/node/agent/podsource"
)

// TestDeclaredPorts: the pod the API answers carries its containers' and
// sidecars' TCP ports (protocol TCP or unset), not UDP or SCTP ones, nor a
// plain init container's.
func TestDeclaredPorts(t *testing.T) {
	always := corev1.ContainerRestartPolicyAlways
	client := fake.NewClientset(&corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u1"},
		Spec: corev1.PodSpec{
			NodeName: "n",
			InitContainers: []corev1.Container{
				{Name: "proxy", RestartPolicy: &always, Ports: []corev1.ContainerPort{{ContainerPort: 15090}, {ContainerPort: 15091, Protocol: corev1.ProtocolUDP}}},
				{Name: "migrate", Ports: []corev1.ContainerPort{{ContainerPort: 7000}}},
			},
			Containers: []corev1.Container{{Name: "app", Ports: []corev1.ContainerPort{
				{ContainerPort: 9090},
				{ContainerPort: 8080, Protocol: corev1.ProtocolTCP},
				{ContainerPort: 53, Protocol: corev1.ProtocolUDP},
				{ContainerPort: 5000, Protocol: corev1.ProtocolSCTP},
			}}},
		},
	})
	s := New(client, "n", time.Hour, nil)
	p, err := s.Fetch(context.Background(), "ns", "web")
	if err != nil {
		t.Fatal(err)
	}
	if want := []uint32{8080, 9090, 15090}; !slices.Equal(p.DeclaredTCPPorts, want) {
		t.Fatalf("DeclaredTCPPorts = %v, want %v", p.DeclaredTCPPorts, want)
	}
}

type nopHandler struct{}

func (nopHandler) OnPod(*podsource.Pod)    {}
func (nopHandler) OnDelete(*podsource.Pod) {}

// TestNamespaceLabels: the source is synced only once it knows the
// namespaces, and a namespace's label change reaches NamespaceLabels
// through the informer.
func TestNamespaceLabels(t *testing.T) {
	// The fake clientset answers no watch-list stream (it sends no initial
	// bookmark): list, then watch, as against an API server before it.
	t.Setenv("KUBE_FEATURE_WatchListClient", "false")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"aether.io/managed": "true"}}})
	s := New(client, "n", time.Hour, nil)
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, nopHandler{}) }()
	defer func() { cancel(); <-done }()
	select {
	case <-s.Synced():
	case <-time.After(30 * time.Second):
		t.Fatal("source never synced")
	}
	if l, ok := s.NamespaceLabels("shop"); !ok || l["aether.io/managed"] != "true" {
		t.Fatalf("NamespaceLabels(shop) after sync = %v, %v; want aether.io/managed=true", l, ok)
	}
	if _, ok := s.NamespaceLabels("other"); ok {
		t.Fatal("NamespaceLabels(other): known, but no such namespace exists")
	}
	ns, err := client.CoreV1().Namespaces().Get(ctx, "shop", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ns.Labels = map[string]string{"aether.io/managed": "false"}
	if _, err := client.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if l, _ := s.NamespaceLabels("shop"); l["aether.io/managed"] == "false" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the namespace's label change never reached NamespaceLabels")
		}
	}
}
