package meshcontract

import "testing"

func TestInboundPolicyOf(t *testing.T) {
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		def         string
		want        string
		invalid     bool
	}{
		{"no annotation: default permissive", nil, InboundPolicyPermissive, InboundPolicyPermissive, false},
		{"no annotation: default strict", map[string]string{"x": "y"}, InboundPolicyStrict, InboundPolicyStrict, false},
		{"annotation strict over default", map[string]string{InboundPolicyAnnotation: "strict"}, InboundPolicyPermissive, InboundPolicyStrict, false},
		{"annotation permissive over default", map[string]string{InboundPolicyAnnotation: "permissive"}, InboundPolicyStrict, InboundPolicyPermissive, false},
		{"invalid: strict", map[string]string{InboundPolicyAnnotation: "permisive"}, InboundPolicyPermissive, InboundPolicyStrict, true},
		{"empty: strict", map[string]string{InboundPolicyAnnotation: ""}, InboundPolicyPermissive, InboundPolicyStrict, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, invalid := InboundPolicyOf(tc.annotations, tc.def)
			if got != tc.want || invalid != tc.invalid {
				t.Errorf("InboundPolicyOf = %q, %v; want %q, %v", got, invalid, tc.want, tc.invalid)
			}
		})
	}
}
