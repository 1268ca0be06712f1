package services

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/registry"
	"aether.io/node/xds/workload"
)

var testCfg = Config{ClusterID: "Kubernetes", ClusterDomain: "cluster.local"}

const webHost = "shop/web.shop.svc.cluster.local"

func webService() *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"},
		Spec: corev1.ServiceSpec{
			Type: corev1.ServiceTypeClusterIP, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"},
			Ports: []corev1.ServicePort{
				{Name: "http", Port: 80, TargetPort: intstr.FromString("http"), Protocol: corev1.ProtocolTCP},
				{Name: "metrics", Port: 9090, TargetPort: intstr.FromInt32(9091)},
				{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP},
			},
		},
	}
}

type sliceEP struct {
	pod, ip, node string
	ready         *bool
}

func slice(name string, httpPort int32, eps ...sliceEP) *discoveryv1.EndpointSlice {
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "shop", Labels: map[string]string{LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{
			{Name: ptr.To("http"), Port: ptr.To(httpPort), Protocol: ptr.To(corev1.ProtocolTCP)},
			{Name: ptr.To("metrics"), Port: ptr.To[int32](9091)},
		},
	}
	for _, e := range eps {
		es.Endpoints = append(es.Endpoints, discoveryv1.Endpoint{
			Addresses: []string{e.ip}, NodeName: ptr.To(e.node),
			Conditions: discoveryv1.EndpointConditions{Ready: e.ready},
			TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: e.pod},
		})
	}
	return es
}

func served(t *testing.T, x *workload.Index, name string) *workloadpb.Address {
	t.Helper()
	r := x.Addresses().Get(name)
	if r == nil {
		return nil
	}
	var a workloadpb.Address
	if err := proto.Unmarshal(r.Body, &a); err != nil {
		t.Fatal(err)
	}
	return &a
}

func uid(pod string) string { return workload.UID("Kubernetes", "shop", pod) }

func ports(t *testing.T, w *workloadpb.Workload) map[uint32]uint32 {
	t.Helper()
	out := map[uint32]uint32{}
	for _, p := range w.GetServices()[webHost].GetPorts() {
		out[p.GetServicePort()] = p.GetTargetPort()
	}
	return out
}

// TestModelClusterIP: a ClusterIP Service is served with its VIP, TCP
// ports (a named target port left 0) and hostname; each ready endpoint
// names it with the target port its slice resolved; a not-ready one does
// not; a pod with a record of its own is served from it (services map
// added), the others from the slice with tunnel NONE.
func TestModelClusterIP(t *testing.T) {
	x := workload.NewIndex()
	m := New(testCfg, x, Metrics{}, nil)
	mesh := registry.Endpoint{Key: "sandbox-a", Namespace: "shop", Name: "web-a", Node: "n1", Healthy: true, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}
	w, err := workload.Build(workload.Config{ClusterID: "Kubernetes", TrustDomain: "cluster.local", HBONE: true}, mesh)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Writer("local").Upsert(mesh.Key, w); err != nil {
		t.Fatal(err)
	}
	m.UpsertService(webService())
	m.UpsertSlice(slice("web-1", 8080, sliceEP{pod: "web-a", ip: "10.0.0.1", node: "n1"}, sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n2", ready: ptr.To(true)},
		sliceEP{pod: "web-c", ip: "10.0.0.3", node: "n2", ready: ptr.To(false)}))
	m.UpsertSlice(slice("web-2", 8081, sliceEP{pod: "web-d", ip: "10.0.0.4", node: "n3"}))

	svc := served(t, x, webHost).GetService()
	want := &workloadpb.Service{
		Name: "web", Namespace: "shop", Hostname: "web.shop.svc.cluster.local",
		Addresses:  []*workloadpb.NetworkAddress{{Address: []byte{10, 96, 0, 10}}},
		Ports:      []*workloadpb.Port{{ServicePort: 80, TargetPort: 0, AppProtocol: workloadpb.AppProtocol_HTTP11}, {ServicePort: 9090, TargetPort: 9091}},
		IpFamilies: workloadpb.IPFamilies_IPV4_ONLY,
	}
	if !proto.Equal(svc, want) {
		t.Fatalf("service = %v\nwant %v", svc, want)
	}
	a := served(t, x, uid("web-a")).GetWorkload()
	if a.GetTunnelProtocol() != workloadpb.TunnelProtocol_HBONE || a.GetNode() != "n1" {
		t.Errorf("mesh pod not served from its record: %v", a)
	}
	if got := ports(t, a); got[80] != 8080 || got[9090] != 9091 || len(got) != 2 {
		t.Errorf("web-a ports %v, want 80->8080, 9090->9091", got)
	}
	b := served(t, x, uid("web-b")).GetWorkload()
	if b.GetTunnelProtocol() != workloadpb.TunnelProtocol_NONE || b.GetStatus() != workloadpb.WorkloadStatus_HEALTHY ||
		netip.AddrFrom4([4]byte(b.GetAddresses()[0])) != netip.MustParseAddr("10.0.0.2") || b.GetNode() != "n2" {
		t.Errorf("slice-only endpoint served as %v", b)
	}
	if got := ports(t, served(t, x, uid("web-d")).GetWorkload()); got[80] != 8081 {
		t.Errorf("web-d ports %v: the named target port is resolved per slice (8081)", got)
	}
	if served(t, x, uid("web-c")) != nil {
		t.Error("a not-ready endpoint is served")
	}

	// The pod's record goes: the slice keeps it served, as NONE.
	x.Writer("local").Remove(mesh.Key)
	if a := served(t, x, uid("web-a")).GetWorkload(); a.GetTunnelProtocol() != workloadpb.TunnelProtocol_NONE || len(ports(t, a)) != 2 {
		t.Errorf("after the record went: %v", a)
	}
	// web-b becomes not ready: it leaves the Service.
	m.UpsertSlice(slice("web-1", 8080, sliceEP{pod: "web-a", ip: "10.0.0.1", node: "n1"}, sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n2", ready: ptr.To(false)}))
	if served(t, x, uid("web-b")) != nil {
		t.Error("web-b still served after it turned not ready")
	}
	// The Service goes: its resource and every membership with it.
	m.DeleteService("shop", "web")
	if served(t, x, webHost) != nil || x.Addresses().Len() != 0 || x.Len() != 0 {
		t.Errorf("after the service went: %d addresses, %d workloads", x.Addresses().Len(), x.Len())
	}
	// It comes back: the slices it left are still known.
	m.UpsertService(webService())
	if x.Len() != 2 || served(t, x, webHost) == nil {
		t.Errorf("after the service came back: %d workloads", x.Len())
	}
	m.Replace(nil, nil)
	if x.Addresses().Len() != 0 || m.Len() != 0 {
		t.Errorf("Replace(nil): %d addresses, %d services", x.Addresses().Len(), m.Len())
	}
}

func TestBuildServiceKinds(t *testing.T) {
	ext := webService()
	ext.Spec.Type, ext.Spec.ExternalName = corev1.ServiceTypeExternalName, "example.com"
	if s := BuildService(testCfg, ext); s != nil {
		t.Errorf("ExternalName served: %v", s)
	}
	headless := webService()
	headless.Spec.ClusterIP, headless.Spec.ClusterIPs = corev1.ClusterIPNone, []string{corev1.ClusterIPNone}
	if s := BuildService(testCfg, headless); s == nil || len(s.GetAddresses()) != 0 || s.GetHostname() != "web.shop.svc.cluster.local" {
		t.Errorf("headless = %v: want served, without addresses", s)
	}
	dual := webService()
	dual.Spec.ClusterIPs = []string{"10.96.0.10", "fd00::a"}
	if s := BuildService(Config{ClusterDomain: "corp.example"}, dual); len(s.GetAddresses()) != 2 || s.GetIpFamilies() != workloadpb.IPFamilies_DUAL || s.GetHostname() != "web.shop.svc.corp.example" {
		t.Errorf("dual-stack = %v", s)
	}
	zone := webService()
	zone.Spec.TrafficDistribution = ptr.To(corev1.ServiceTrafficDistributionPreferClose)
	zone.Spec.PublishNotReadyAddresses = true
	want := &workloadpb.LoadBalancing{
		Mode: workloadpb.LoadBalancing_FAILOVER, HealthPolicy: workloadpb.LoadBalancing_ALLOW_ALL,
		RoutingPreference: []workloadpb.LoadBalancing_Scope{workloadpb.LoadBalancing_NETWORK, workloadpb.LoadBalancing_REGION, workloadpb.LoadBalancing_ZONE},
	}
	if s := BuildService(testCfg, zone); !proto.Equal(s.GetLoadBalancing(), want) {
		t.Errorf("PreferClose + publishNotReadyAddresses = %v, want %v", s.GetLoadBalancing(), want)
	}
	node := webService()
	node.Annotations = map[string]string{AnnotationTrafficDistribution: corev1.ServiceTrafficDistributionPreferSameNode}
	if s := BuildService(testCfg, node); len(s.GetLoadBalancing().GetRoutingPreference()) != 5 {
		t.Errorf("PreferSameNode (annotation) = %v", s.GetLoadBalancing())
	}
}

// TestPublishNotReadyAddresses: the Service's not-ready endpoints are
// members (the proxy may choose them: ALLOW_ALL).
func TestPublishNotReadyAddresses(t *testing.T) {
	x := workload.NewIndex()
	m := New(testCfg, x, Metrics{}, nil)
	svc := webService()
	svc.Spec.PublishNotReadyAddresses = true
	m.UpsertService(svc)
	m.UpsertSlice(slice("web-1", 8080, sliceEP{pod: "web-c", ip: "10.0.0.3", node: "n2", ready: ptr.To(false)}))
	w := served(t, x, uid("web-c")).GetWorkload()
	if w == nil || w.GetStatus() != workloadpb.WorkloadStatus_UNHEALTHY || len(ports(t, w)) != 2 {
		t.Errorf("not-ready endpoint of a publishNotReadyAddresses service: %v", w)
	}
}

// BenchmarkSliceUpdate5000: a Service of 5,000 endpoints in 50 slices of
// 100; one slice changes (an endpoint turns not ready and back) per
// iteration: the cost of one EndpointSlice update, index writes included.
func BenchmarkSliceUpdate5000(b *testing.B) {
	x := workload.NewIndex()
	m := New(testCfg, x, Metrics{}, nil)
	m.UpsertService(webService())
	mk := func(n int, readyAt int) *discoveryv1.EndpointSlice {
		var eps []sliceEP
		for i := range 100 {
			id := n*100 + i
			eps = append(eps, sliceEP{pod: fmt.Sprintf("web-%d", id), ip: fmt.Sprintf("10.%d.%d.%d", id>>16&255, id>>8&255, id&255), node: "n1", ready: ptr.To(i != readyAt)})
		}
		return slice(fmt.Sprintf("web-%d", n), 8080, eps...)
	}
	for n := range 50 {
		m.UpsertSlice(mk(n, -1))
	}
	if x.Len() != 5000 {
		b.Fatalf("%d workloads", x.Len())
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		m.UpsertSlice(mk(7, i%100))
		i++
	}
}

// records is a slog handler keeping every record.
type records struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec)
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

// take returns the records so far, each as "message k=v ...", and forgets
// them.
func (r *records) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, rec := range r.recs {
		s := rec.Message
		rec.Attrs(func(a slog.Attr) bool {
			s += " " + a.String()
			return true
		})
		out = append(out, s)
	}
	r.recs = nil
	return out
}

// TestUnresolvedTargetPort: endpoints whose EndpointSlice gives no port
// for a Service port's named targetPort (the pods declare none, so the
// controller left it out), or a number outside 1-65535, are served
// without that port (the Service's target port is 0 for a named one, so a
// client skips them for it) and keep the others; each such endpoint port
// is counted once, by reason, and logged once per change, not again for
// an update that leaves the problem as it was.
func TestUnresolvedTargetPort(t *testing.T) {
	x := workload.NewIndex()
	met := testMetrics()
	logs := &records{}
	m := New(testCfg, x, met, slog.New(logs))
	m.UpsertService(webService())
	m.UpsertSlice(slice("web-1", 8080, sliceEP{pod: "web-a", ip: "10.0.0.1", node: "n1"}))
	missing := func(eps ...sliceEP) *discoveryv1.EndpointSlice {
		es := slice("web-2", 1, eps...)
		es.Ports = es.Ports[1:] // metrics only: no port named http
		return es
	}
	m.UpsertSlice(missing(sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n1"}, sliceEP{pod: "web-c", ip: "10.0.0.3", node: "n1"}))
	invalid := slice("web-3", 1, sliceEP{pod: "web-d", ip: "10.0.0.4", node: "n1"})
	invalid.Ports[0].Port = ptr.To[int32](-8080)
	m.UpsertSlice(invalid)

	if got := ports(t, served(t, x, uid("web-a")).GetWorkload()); got[80] != 8080 || got[9090] != 9091 {
		t.Errorf("resolved endpoint ports %v", got)
	}
	for _, pod := range []string{"web-b", "web-c", "web-d"} {
		got := ports(t, served(t, x, uid(pod)).GetWorkload())
		if _, ok := got[80]; ok || got[9090] != 9091 || len(got) != 1 {
			t.Errorf("%s ports %v: want 9090->9091 only (80 unresolved, not served)", pod, got)
		}
	}
	count := func(reason string) float64 { return value(t, met.UnresolvedTargetPorts.WithLabelValues(reason)) }
	if nd, inv := count(ReasonNotDeclared), count(ReasonInvalid); nd != 2 || inv != 1 {
		t.Errorf("counted not_declared %v, invalid %v; want 2, 1", nd, inv)
	}
	got := logs.take()
	want := []string{
		`service port not served on some endpoints: its named targetPort is unresolved service=shop/web port=80 target_port=http reason=not_declared detail=the EndpointSlice gives no port of that name: the pods declare no container port named so endpointslice=shop/web-2 endpoints=2 example=shop/web-b`,
		`service port not served on some endpoints: its named targetPort is unresolved service=shop/web port=80 target_port=http reason=invalid detail=the EndpointSlice gives a port number outside 1-65535 endpointslice=shop/web-3 endpoints=1 example=shop/web-d`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("logged\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// The same problem again (an update storm, a Service change): neither
	// counted nor logged again.
	for range 5 {
		m.UpsertSlice(missing(sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n1"}, sliceEP{pod: "web-c", ip: "10.0.0.3", node: "n1", ready: ptr.To(false)}))
	}
	m.UpsertService(webService())
	if nd := count(ReasonNotDeclared); nd != 2 || len(logs.take()) != 0 {
		t.Errorf("an unchanged problem was counted (%v) or logged again", nd)
	}
	// A new endpoint in that slice: it alone.
	m.UpsertSlice(missing(sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n1"}, sliceEP{pod: "web-c", ip: "10.0.0.3", node: "n1"}, sliceEP{pod: "web-e", ip: "10.0.0.5", node: "n1"}))
	if nd, l := count(ReasonNotDeclared), logs.take(); nd != 3 || len(l) != 1 || !strings.Contains(l[0], "endpoints=1 example=shop/web-e") {
		t.Errorf("a new endpoint missing the port: counted %v, logged %q", nd, l)
	}
	// The pods declare the port now: served; broken again: counted again.
	m.UpsertSlice(slice("web-2", 8082, sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n1"}))
	if got := ports(t, served(t, x, uid("web-b")).GetWorkload()); got[80] != 8082 {
		t.Errorf("after the fix web-b ports %v, want 80->8082", got)
	}
	m.UpsertSlice(missing(sliceEP{pod: "web-b", ip: "10.0.0.2", node: "n1"}))
	if nd := count(ReasonNotDeclared); nd != 4 || len(logs.take()) != 1 {
		t.Errorf("broken again: counted %v", nd)
	}
	// A numeric targetPort with a garbage slice port: the Service's number
	// is the target (a consumer's fallback), never the garbage; not counted.
	numeric := webService()
	numeric.Spec.Ports[0].TargetPort = intstr.FromInt32(8080)
	m.UpsertService(numeric)
	if got := ports(t, served(t, x, uid("web-d")).GetWorkload()); got[80] != 0 {
		t.Errorf("numeric targetPort, invalid slice port: web-d ports %v, want no 80 entry (the Service's 8080 applies)", got)
	}
	if inv := count(ReasonInvalid); inv != 1 {
		t.Errorf("invalid counted %v for a numeric targetPort", inv)
	}
	if svc := served(t, x, webHost).GetService(); svc.GetPorts()[0].GetTargetPort() != 8080 {
		t.Errorf("service ports %v", svc.GetPorts())
	}
}
