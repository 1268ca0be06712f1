package workload_test

import (
	"net/netip"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"aether.io/node/api/internal/apitest"
	"aether.io/node/api/istio/workload"
)

func fullWorkload() *workload.Workload {
	v4 := netip.MustParseAddr("10.1.2.3").AsSlice()
	v6 := netip.MustParseAddr("fd00::3").AsSlice()
	return &workload.Workload{
		Uid:                   "Kubernetes//Pod/shop/web-0",
		Name:                  "web-0",
		Namespace:             "shop",
		Addresses:             [][]byte{v4, v6},
		Hostname:              "web-0.web.shop.svc.cluster.local", // both set only to exercise every field's encoding
		Network:               "net1",
		TunnelProtocol:        workload.TunnelProtocol_HBONE,
		TrustDomain:           "cluster.local",
		ServiceAccount:        "web",
		Waypoint:              &workload.GatewayAddress{Destination: &workload.GatewayAddress_Address{Address: &workload.NetworkAddress{Network: "net1", Address: v4}}, HboneMtlsPort: 15008},
		NetworkGateway:        &workload.GatewayAddress{Destination: &workload.GatewayAddress_Hostname{Hostname: &workload.NamespacedHostname{Namespace: "istio-system", Hostname: "eastwest.example.com"}}},
		Node:                  "node-a",
		CanonicalName:         "web",
		CanonicalRevision:     "v1",
		WorkloadType:          workload.WorkloadType_JOB,
		WorkloadName:          "web",
		NativeTunnel:          true,
		ApplicationTunnel:     &workload.ApplicationTunnel{Protocol: workload.ApplicationTunnel_PROXY, Port: 8080},
		Services:              map[string]*workload.PortList{"shop/web.shop.svc.cluster.local": {Ports: []*workload.Port{{ServicePort: 80, TargetPort: 8080}}}},
		AuthorizationPolicies: []string{"shop/allow-web"},
		Status:                workload.WorkloadStatus_UNHEALTHY,
		ClusterId:             "Kubernetes",
		Locality:              &workload.Locality{Region: "eu", Zone: "eu-1a", Subzone: "rack7"},
		NetworkMode:           workload.NetworkMode_HOST_NETWORK,
	}
}

// TestRoundTrip marshals and unmarshals every message of the package.
func TestRoundTrip(t *testing.T) {
	w := fullWorkload()
	msgs := []proto.Message{
		w, w.Locality, w.Services["shop/web.shop.svc.cluster.local"], w.Services["shop/web.shop.svc.cluster.local"].Ports[0],
		w.ApplicationTunnel, w.Waypoint, w.NetworkGateway, w.Waypoint.GetAddress(), w.NetworkGateway.GetHostname(),
		&workload.Address{Type: &workload.Address_Service{Service: fullService()}}, fullService(), fullService().LoadBalancing,
		&workload.BootstrapExtension{ConfigSource: &corev3.ConfigSource{ConfigSourceSpecifier: &corev3.ConfigSource_Ads{Ads: &corev3.AggregatedConfigSource{}}}},
	}
	apitest.RoundTrip(t, workload.File_istio_workload_discovery_proto, msgs...)
}

// upstream lists istio.workload.Workload's field numbers and wire types as in
// ztunnel's proto/workload.proto (the file istio/proxy's discovery.proto is
// derived from): number -> (name, wire type, repeated).
var upstream = map[protowire.Number]struct {
	name     string
	wire     protowire.Type
	repeated bool
}{
	20: {"uid", protowire.BytesType, false},
	1:  {"name", protowire.BytesType, false},
	2:  {"namespace", protowire.BytesType, false},
	3:  {"addresses", protowire.BytesType, true},
	21: {"hostname", protowire.BytesType, false},
	4:  {"network", protowire.BytesType, false},
	5:  {"tunnel_protocol", protowire.VarintType, false},
	6:  {"trust_domain", protowire.BytesType, false},
	7:  {"service_account", protowire.BytesType, false},
	8:  {"waypoint", protowire.BytesType, false},
	19: {"network_gateway", protowire.BytesType, false},
	9:  {"node", protowire.BytesType, false},
	10: {"canonical_name", protowire.BytesType, false},
	11: {"canonical_revision", protowire.BytesType, false},
	12: {"workload_type", protowire.VarintType, false},
	13: {"workload_name", protowire.BytesType, false},
	14: {"native_tunnel", protowire.VarintType, false},
	23: {"application_tunnel", protowire.BytesType, false},
	22: {"services", protowire.BytesType, true},
	16: {"authorization_policies", protowire.BytesType, true},
	17: {"status", protowire.VarintType, false},
	18: {"cluster_id", protowire.BytesType, false},
	24: {"locality", protowire.BytesType, false},
	25: {"network_mode", protowire.VarintType, false},
}

// TestWorkloadDecodesWithUpstreamFieldNumbers encodes a Workload with our code
// and decodes the raw wire bytes with the upstream field numbers.
func TestWorkloadDecodesWithUpstreamFieldNumbers(t *testing.T) {
	w := fullWorkload()
	b, err := proto.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[protowire.Number]int{}
	var addrs [][]byte
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag: %v", protowire.ParseError(n))
		}
		b = b[n:]
		want, ok := upstream[num]
		if !ok {
			t.Fatalf("field %d is not in the upstream Workload", num)
		}
		if typ != want.wire {
			t.Fatalf("field %d (%s): wire type %d, upstream %d", num, want.name, typ, want.wire)
		}
		seen[num]++
		var val []byte
		if typ == protowire.BytesType {
			val, n = protowire.ConsumeBytes(b)
		} else {
			_, n = protowire.ConsumeVarint(b)
		}
		if n < 0 {
			t.Fatalf("bad value for field %d", num)
		}
		b = b[n:]
		switch num {
		case 20:
			if string(val) != w.Uid {
				t.Errorf("uid decoded as %q", val)
			}
		case 3:
			addrs = append(addrs, append([]byte(nil), val...))
		case 9:
			if string(val) != "node-a" {
				t.Errorf("node decoded as %q", val)
			}
		}
	}
	for num, f := range upstream {
		if seen[num] == 0 {
			t.Errorf("upstream field %d (%s) not encoded", num, f.name)
		}
		if seen[num] > 1 && !f.repeated {
			t.Errorf("singular field %d (%s) encoded %d times", num, f.name, seen[num])
		}
	}
	if len(addrs) != 2 || len(addrs[0]) != 4 || len(addrs[1]) != 16 {
		t.Fatalf("addresses must be raw 4- and 16-byte IPs, got %v", addrs)
	}
	// Every field of our Workload maps to an upstream number with the same name.
	fields := w.ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		f := fields.Get(i)
		if u, ok := upstream[f.Number()]; !ok || u.name != string(f.Name()) {
			t.Errorf("our field %s=%d does not match upstream", f.Name(), f.Number())
		}
	}
}

func TestEnumNumbers(t *testing.T) {
	checks := []struct {
		got  protoreflect.EnumNumber
		want protoreflect.EnumNumber
	}{
		{workload.WorkloadStatus_HEALTHY.Number(), 0},
		{workload.WorkloadStatus_UNHEALTHY.Number(), 1},
		{workload.WorkloadType_DEPLOYMENT.Number(), 0},
		{workload.WorkloadType_CRONJOB.Number(), 1},
		{workload.WorkloadType_POD.Number(), 2},
		{workload.WorkloadType_JOB.Number(), 3},
		{workload.TunnelProtocol_NONE.Number(), 0},
		{workload.TunnelProtocol_HBONE.Number(), 1},
		{workload.NetworkMode_STANDARD.Number(), 0},
		{workload.NetworkMode_HOST_NETWORK.Number(), 1},
		{workload.ApplicationTunnel_NONE.Number(), 0},
		{workload.ApplicationTunnel_PROXY.Number(), 1},
	}
	for i, c := range checks {
		if c.got != c.want {
			t.Errorf("case %d: enum number %d, want %d", i, c.got, c.want)
		}
	}
}

func fullService() *workload.Service {
	return &workload.Service{
		Name:      "web",
		Namespace: "shop",
		Hostname:  "web.shop.svc.cluster.local",
		Addresses: []*workload.NetworkAddress{
			{Network: "net1", Address: netip.MustParseAddr("10.96.0.10").AsSlice()},
			{Address: netip.MustParseAddr("fd00:96::10").AsSlice()},
		},
		Ports:           []*workload.Port{{ServicePort: 80, TargetPort: 8080, AppProtocol: workload.AppProtocol_HTTP11}, {ServicePort: 443}},
		SubjectAltNames: []string{"spiffe://cluster.local/ns/shop/sa/legacy"},
		LoadBalancing: &workload.LoadBalancing{
			RoutingPreference: []workload.LoadBalancing_Scope{workload.LoadBalancing_NODE, workload.LoadBalancing_ZONE},
			Mode:              workload.LoadBalancing_FAILOVER,
			HealthPolicy:      workload.LoadBalancing_ALLOW_ALL,
		},
		IpFamilies: workload.IPFamilies_DUAL,
	}
}

// TestAddressRoundTrip covers the Address wrapper with each of its kinds.
func TestAddressRoundTrip(t *testing.T) {
	for _, a := range []*workload.Address{
		{Type: &workload.Address_Workload{Workload: fullWorkload()}},
		{Type: &workload.Address_Service{Service: fullService()}},
	} {
		b, err := proto.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		var got workload.Address
		if err := proto.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(a, &got) {
			t.Fatalf("%v did not survive a round trip", a)
		}
	}
}

// upstreamService lists istio.workload.Service's and Address's field numbers
// as in Istio's pkg/workloadapi/workload.proto; 7 (waypoint) and 10
// (extensions) are Istio's and not declared here.
var upstreamService = map[protoreflect.FullName]map[protowire.Number]string{
	"istio.workload.Service": {
		1: "name", 2: "namespace", 3: "hostname", 4: "addresses", 5: "ports",
		6: "subject_alt_names", 8: "load_balancing", 9: "ip_families",
	},
	"istio.workload.Address":       {1: "workload", 2: "service"},
	"istio.workload.Port":          {1: "service_port", 2: "target_port", 3: "app_protocol"},
	"istio.workload.LoadBalancing": {1: "routing_preference", 2: "mode", 3: "health_policy"},
}

// TestServiceFieldNumbers pins the added messages to Istio's numbering.
func TestServiceFieldNumbers(t *testing.T) {
	for name, want := range upstreamService {
		d, err := protoregistryFind(name)
		if err != nil {
			t.Fatal(err)
		}
		fields := d.Fields()
		if fields.Len() != len(want) {
			t.Errorf("%s has %d fields, upstream table %d", name, fields.Len(), len(want))
		}
		for num, fname := range want {
			f := fields.ByNumber(num)
			if f == nil || string(f.Name()) != fname {
				t.Errorf("%s field %d: want %s, have %v", name, num, fname, f)
			}
		}
	}
	enums := []struct {
		got, want protoreflect.EnumNumber
	}{
		{workload.AppProtocol_TLS.Number(), 5},
		{workload.AppProtocol_HTTP2.Number(), 2},
		{workload.IPFamilies_DUAL.Number(), 3},
		{workload.LoadBalancing_NODE.Number(), 4},
		{workload.LoadBalancing_NETWORK.Number(), 6},
		{workload.LoadBalancing_PASSTHROUGH.Number(), 3},
		{workload.LoadBalancing_ALLOW_ALL.Number(), 1},
	}
	for i, c := range enums {
		if c.got != c.want {
			t.Errorf("enum case %d: %d, want %d", i, c.got, c.want)
		}
	}
}

func protoregistryFind(name protoreflect.FullName) (protoreflect.MessageDescriptor, error) {
	mt, err := protoregistry.GlobalTypes.FindMessageByName(name)
	if err != nil {
		return nil, err
	}
	return mt.Descriptor(), nil
}

// TestGolden pins the wire bytes test/interop/istio/wire decodes with Istio's
// pkg/workloadapi types.
func TestGolden(t *testing.T) {
	apitest.Golden(t, "address_workload.binpb", &workload.Address{Type: &workload.Address_Workload{Workload: fullWorkload()}})
	apitest.Golden(t, "address_service.binpb", &workload.Address{Type: &workload.Address_Service{Service: fullService()}})
}
