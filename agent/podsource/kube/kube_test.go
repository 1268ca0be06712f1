package kube

import (
	"context"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
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
