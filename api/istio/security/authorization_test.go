package security_test

import (
	"net/netip"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/emptypb"

	"aether.io/node/api/internal/apitest"
	"aether.io/node/api/istio/security"
)

func fullAuthorization() *security.Authorization {
	m := &security.Match{
		Namespaces:          []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: "shop"}}},
		NotNamespaces:       []*security.StringMatch{{MatchType: &security.StringMatch_Prefix{Prefix: "kube-"}}},
		ServiceAccounts:     []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "web"}},
		NotServiceAccounts:  []*security.ServiceAccountMatch{{Namespace: "shop", ServiceAccount: "batch"}},
		Principals:          []*security.StringMatch{{MatchType: &security.StringMatch_Suffix{Suffix: "/sa/web"}}},
		NotPrincipals:       []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}},
		SourceIps:           []*security.Address{{Address: netip.MustParseAddr("10.1.0.0").AsSlice(), Length: 16}},
		NotSourceIps:        []*security.Address{{Address: netip.MustParseAddr("fd00::").AsSlice(), Length: 8}},
		DestinationIps:      []*security.Address{{Address: netip.MustParseAddr("10.2.0.1").AsSlice(), Length: 32}},
		NotDestinationIps:   []*security.Address{{Address: netip.MustParseAddr("10.2.0.2").AsSlice(), Length: 32}},
		DestinationPorts:    []uint32{8080, 9090},
		NotDestinationPorts: []uint32{22},
	}
	return &security.Authorization{
		Name:      "allow-web",
		Namespace: "shop",
		Scope:     security.Scope_WORKLOAD_SELECTOR,
		Action:    security.Action_DENY,
		Groups:    []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{m}}}}},
		DryRun:    true,
	}
}

// TestRoundTrip marshals and unmarshals every message of the package.
func TestRoundTrip(t *testing.T) {
	a := fullAuthorization()
	m := a.Groups[0].Rules[0].Matches[0]
	apitest.RoundTrip(t, security.File_istio_security_authorization_proto,
		a, a.Groups[0], a.Groups[0].Rules[0], m, m.SourceIps[0], m.ServiceAccounts[0], m.Namespaces[0])
}

// upstream lists the field numbers of Istio's
// pkg/workloadapi/security/authorization.proto (extensions, Istio's 7, is not
// declared here).
var upstream = map[string]map[protoreflect.FieldNumber]string{
	"Authorization":       {1: "name", 2: "namespace", 3: "scope", 4: "action", 5: "groups", 6: "dry_run"},
	"Group":               {1: "rules"},
	"Rules":               {2: "matches"},
	"Address":             {1: "address", 2: "length"},
	"ServiceAccountMatch": {1: "namespace", 2: "serviceAccount"},
	"StringMatch":         {1: "exact", 2: "prefix", 3: "suffix", 4: "presence"},
	"Match": {
		1: "namespaces", 2: "not_namespaces", 3: "principals", 4: "not_principals",
		5: "source_ips", 6: "not_source_ips", 7: "destination_ips", 8: "not_destination_ips",
		9: "destination_ports", 10: "not_destination_ports", 11: "service_accounts", 12: "not_service_accounts",
	},
}

// TestFieldNumbers pins every message to Istio's numbering, and the enums.
func TestFieldNumbers(t *testing.T) {
	msgs := security.File_istio_security_authorization_proto.Messages()
	if msgs.Len() != len(upstream) {
		t.Errorf("%d messages, upstream table %d", msgs.Len(), len(upstream))
	}
	for name, want := range upstream {
		d := msgs.ByName(protoreflect.Name(name))
		if d == nil {
			t.Errorf("message %s missing", name)
			continue
		}
		if d.Fields().Len() != len(want) {
			t.Errorf("%s has %d fields, upstream %d", name, d.Fields().Len(), len(want))
		}
		for num, fname := range want {
			if f := d.Fields().ByNumber(num); f == nil || string(f.Name()) != fname {
				t.Errorf("%s field %d: want %s, have %v", name, num, fname, f)
			}
		}
	}
	if security.Action_DENY.Number() != 1 || security.Scope_WORKLOAD_SELECTOR.Number() != 2 || security.Scope_NAMESPACE.Number() != 1 {
		t.Error("enum numbers differ from Istio's")
	}
}

// TestGolden pins the wire bytes test/interop/istio/wire decodes with Istio's
// pkg/workloadapi/security types.
func TestGolden(t *testing.T) {
	apitest.Golden(t, "authorization.binpb", fullAuthorization())
}
