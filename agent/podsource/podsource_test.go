package podsource_test

import (
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"aether.io/node/agent/podsource"
)

// TestDeclaredTCPPorts: the TCP ports (protocol TCP or unset) of the
// containers and of the restartable init containers (sidecars), ascending,
// each once; UDP and SCTP ports, and those of init containers that run to
// completion, left out; a pod declaring none gets an empty list.
func TestDeclaredTCPPorts(t *testing.T) {
	always := corev1.ContainerRestartPolicyAlways
	cases := []struct {
		name string
		spec corev1.PodSpec
		want []uint32
	}{
		{name: "none", spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}}}, want: nil},
		{name: "tcp and unset protocol", spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Ports: []corev1.ContainerPort{
			{ContainerPort: 8080, Protocol: corev1.ProtocolTCP}, {ContainerPort: 9090},
		}}}}, want: []uint32{8080, 9090}},
		{name: "udp and sctp excluded", spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Ports: []corev1.ContainerPort{
			{ContainerPort: 53, Protocol: corev1.ProtocolUDP},
			{ContainerPort: 53, Protocol: corev1.ProtocolTCP},
			{ContainerPort: 5000, Protocol: corev1.ProtocolSCTP},
			{ContainerPort: 5001, Protocol: corev1.ProtocolUDP},
		}}}}, want: []uint32{53}},
		{name: "several containers sorted and deduplicated", spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "b", Ports: []corev1.ContainerPort{{ContainerPort: 9000}, {ContainerPort: 80}}},
			{Name: "a", Ports: []corev1.ContainerPort{{ContainerPort: 80, HostPort: 8080}, {ContainerPort: 443}}},
		}}, want: []uint32{80, 443, 9000}},
		{name: "sidecars included, plain init containers not", spec: corev1.PodSpec{
			InitContainers: []corev1.Container{
				{Name: "sidecar", RestartPolicy: &always, Ports: []corev1.ContainerPort{{ContainerPort: 15090}, {ContainerPort: 15091, Protocol: corev1.ProtocolUDP}}},
				{Name: "migrate", Ports: []corev1.ContainerPort{{ContainerPort: 7000}}},
			},
			Containers: []corev1.Container{{Name: "app", Ports: []corev1.ContainerPort{{ContainerPort: 8080}}}},
		}, want: []uint32{8080, 15090}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := podsource.FromKube(&corev1.Pod{Spec: tc.spec})
			if !slices.Equal(p.DeclaredTCPPorts, tc.want) {
				t.Fatalf("DeclaredTCPPorts = %v, want %v", p.DeclaredTCPPorts, tc.want)
			}
		})
	}
}
