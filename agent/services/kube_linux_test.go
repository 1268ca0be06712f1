package services_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"aether.io/node/agent/services"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/test/harness"
	"aether.io/node/test/kubetest"
	"aether.io/node/xds/workload"
)

func TestMain(m *testing.M) { harness.Main(m) }

func address(x *workload.Index, name string) *workloadpb.Address {
	r := x.Addresses().Get(name)
	if r == nil {
		return nil
	}
	var a workloadpb.Address
	if proto.Unmarshal(r.Body, &a) != nil {
		return nil
	}
	return &a
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestInformers runs the Service model's informers against a real
// kube-apiserver: a Service gets the ClusterIP the API server allocated,
// its EndpointSlice's ready pods name it, a pod turning not ready leaves
// it, and a deleted Service is withdrawn.
func TestInformers(t *testing.T) {
	harness.RequireRoot(t)
	if testing.Short() {
		t.Skip("needs a kube-apiserver build (minutes when cold)")
	}
	cl := kubetest.Start(t)
	ctx := context.Background()
	cl.Namespace(t, "shop")
	x := workload.NewIndex()
	m := services.New(services.Config{ClusterID: "Kubernetes", ClusterDomain: "cluster.local"}, x, services.Metrics{}, nil)
	inf, err := services.NewInformers(cl.Client, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); inf.Run(rctx) }()
	t.Cleanup(func() { cancel(); <-done })

	svc, err := cl.Client.CoreV1().Services("shop").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{"unrelated": "x"}},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports:    []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vip := netip.MustParseAddr(svc.Spec.ClusterIP)
	const name = "shop/web.shop.svc.cluster.local"
	eventually(t, "the service", func() bool { return address(x, name) != nil })
	got := address(x, name).GetService()
	if netip.AddrFrom4([4]byte(got.GetAddresses()[0].GetAddress())) != vip || got.GetPorts()[0].GetServicePort() != 80 {
		t.Fatalf("served %v, want VIP %s port 80", got, vip)
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-abc", Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints: []discoveryv1.Endpoint{{
			Addresses: []string{"10.1.0.7"}, NodeName: ptr.To("node-b"),
			Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: "web-7d9f8c6b5-x2x4q"},
		}},
	}
	es, err = cl.Client.DiscoveryV1().EndpointSlices("shop").Create(ctx, es, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	uid := workload.UID("Kubernetes", "shop", "web-7d9f8c6b5-x2x4q")
	eventually(t, "the endpoint", func() bool { return address(x, uid) != nil })
	w := address(x, uid).GetWorkload()
	if p := w.GetServices()[name].GetPorts(); len(p) != 1 || p[0].GetServicePort() != 80 || p[0].GetTargetPort() != 8080 {
		t.Errorf("endpoint ports %v, want 80 -> 8080", p)
	}
	es.Endpoints[0].Conditions.Ready = ptr.To(false)
	if _, err := cl.Client.DiscoveryV1().EndpointSlices("shop").Update(ctx, es, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the not-ready endpoint to leave", func() bool { return address(x, uid) == nil })
	if err := cl.Client.CoreV1().Services("shop").Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the service to leave", func() bool { return address(x, name) == nil })
}
