// Package wire decodes the istio.workload and istio.security resources
// aether-agent serves with Istio's own generated Go types
// (istio.io/istio/pkg/workloadapi), field by field against what we meant.
// The bytes are the golden files the main module's api tests pin
// (api/istio/*/testdata, `go test -update` there rewrites them); this package
// imports none of our api packages, since both register the same proto names.
package wire

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"
)

func golden(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "..", "..", "api", "istio", rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ip(s string) []byte { return netip.MustParseAddr(s).AsSlice() }

// decode unmarshals b into m and fails on any field Istio's type does not
// know (an unknown field means a number or wire type differs).
func decode(t *testing.T, b []byte, m proto.Message) {
	t.Helper()
	if err := proto.Unmarshal(b, m); err != nil {
		t.Fatalf("istio's %T cannot decode our bytes: %v", m, err)
	}
	var walk func(proto.Message)
	walk = func(m proto.Message) {
		r := m.ProtoReflect()
		if len(r.GetUnknown()) > 0 {
			t.Errorf("istio's %T sees unknown fields in our bytes: %x", m, r.GetUnknown())
		}
		for _, child := range children(m) {
			walk(child)
		}
	}
	walk(m)
}

func TestServiceDecodesWithIstioTypes(t *testing.T) {
	var got workloadapi.Address
	decode(t, golden(t, "workload/testdata/address_service.binpb"), &got)
	want := &workloadapi.Address{Type: &workloadapi.Address_Service{Service: &workloadapi.Service{
		Name:      "web",
		Namespace: "shop",
		Hostname:  "web.shop.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{
			{Network: "net1", Address: ip("10.96.0.10")},
			{Address: ip("fd00:96::10")},
		},
		Ports:           []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080, AppProtocol: workloadapi.AppProtocol_HTTP11}, {ServicePort: 443}},
		SubjectAltNames: []string{"spiffe://cluster.local/ns/shop/sa/legacy"},
		LoadBalancing: &workloadapi.LoadBalancing{
			RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NODE, workloadapi.LoadBalancing_ZONE},
			Mode:              workloadapi.LoadBalancing_FAILOVER,
			HealthPolicy:      workloadapi.LoadBalancing_ALLOW_ALL,
		},
		IpFamilies: workloadapi.IPFamilies_DUAL,
	}}}
	if !proto.Equal(&got, want) {
		t.Fatalf("decoded %v\nwant    %v", &got, want)
	}
}

func TestWorkloadAddressDecodesWithIstioTypes(t *testing.T) {
	var got workloadapi.Address
	decode(t, golden(t, "workload/testdata/address_workload.binpb"), &got)
	want := &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
		Uid:               "Kubernetes//Pod/shop/web-0",
		Name:              "web-0",
		Namespace:         "shop",
		Addresses:         [][]byte{ip("10.1.2.3"), ip("fd00::3")},
		Hostname:          "web-0.web.shop.svc.cluster.local",
		Network:           "net1",
		TunnelProtocol:    workloadapi.TunnelProtocol_HBONE,
		TrustDomain:       "cluster.local",
		ServiceAccount:    "web",
		Waypoint:          &workloadapi.GatewayAddress{Destination: &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: "net1", Address: ip("10.1.2.3")}}, HboneMtlsPort: 15008},
		NetworkGateway:    &workloadapi.GatewayAddress{Destination: &workloadapi.GatewayAddress_Hostname{Hostname: &workloadapi.NamespacedHostname{Namespace: "istio-system", Hostname: "eastwest.example.com"}}},
		Node:              "node-a",
		CanonicalName:     "web",
		CanonicalRevision: "v1",
		WorkloadType:      workloadapi.WorkloadType_JOB,
		WorkloadName:      "web",
		NativeTunnel:      true,
		ApplicationTunnel: &workloadapi.ApplicationTunnel{Protocol: workloadapi.ApplicationTunnel_PROXY, Port: 8080},
		Services: map[string]*workloadapi.PortList{
			"shop/web.shop.svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}},
		},
		AuthorizationPolicies: []string{"shop/allow-web"},
		Status:                workloadapi.WorkloadStatus_UNHEALTHY,
		ClusterId:             "Kubernetes",
		Locality:              &workloadapi.Locality{Region: "eu", Zone: "eu-1a", Subzone: "rack7"},
		NetworkMode:           workloadapi.NetworkMode_HOST_NETWORK,
	}}}
	if !proto.Equal(&got, want) {
		t.Fatalf("decoded %v\nwant    %v", &got, want)
	}
}

func TestAuthorizationDecodesWithIstioTypes(t *testing.T) {
	var got security.Authorization
	decode(t, golden(t, "security/testdata/authorization.binpb"), &got)
	m := &security.Match{
		Namespaces:          []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "shop"}}},
		NotNamespaces:       []*security.StringMatch{{MatchType: &security.StringMatch_Prefix{Prefix: "kube-"}}},
		ServiceAccounts:     []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "web"}},
		NotServiceAccounts:  []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "batch"}},
		Principals:          []*security.StringMatch{{MatchType: &security.StringMatch_Suffix{Suffix: "/sa/web"}}},
		NotPrincipals:       []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}},
		SourceIps:           []*security.Address{{Address: ip("10.1.0.0"), Length: 16}},
		NotSourceIps:        []*security.Address{{Address: ip("fd00::"), Length: 8}},
		DestinationIps:      []*security.Address{{Address: ip("10.2.0.1"), Length: 32}},
		NotDestinationIps:   []*security.Address{{Address: ip("10.2.0.2"), Length: 32}},
		DestinationPorts:    []uint32{8080, 9090},
		NotDestinationPorts: []uint32{22},
	}
	want := &security.Authorization{
		Name:      "allow-web",
		Namespace: "shop",
		Scope:     security.Scope_WORKLOAD_SELECTOR,
		Action:    security.Action_DENY,
		Groups:    []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{m}}}}},
		DryRun:    true,
	}
	if !proto.Equal(&got, want) {
		t.Fatalf("decoded %v\nwant    %v", &got, want)
	}
}
