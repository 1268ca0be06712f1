package meshcontract

// The inbound policy contract between aether-agent (which decides each pod's
// policy), aether-cni (which turns on the inbound redirect for a pod
// annotated strict) and aether-proxy (which enforces it on the inbound
// listener).
const (
	// InboundPolicyAnnotation is the pod annotation that sets the pod's
	// inbound policy; absent, the agent's --inbound-policy applies.
	InboundPolicyAnnotation = "aether.io/inbound-policy"
	// InboundPolicyPermissive accepts plaintext inbound connections (and
	// HBONE): the proxy delivers them to the app.
	InboundPolicyPermissive = "permissive"
	// InboundPolicyStrict accepts only HBONE from the trust domain: the
	// proxy resets every plaintext inbound connection.
	InboundPolicyStrict = "strict"
)

// ValidInboundPolicy reports whether v is one of the inbound policies.
func ValidInboundPolicy(v string) bool {
	return v == InboundPolicyPermissive || v == InboundPolicyStrict
}

// InboundPolicyOf is the inbound policy of a pod with annotations when the
// agent's default is def: the InboundPolicyAnnotation when it is valid, def
// when it is absent. Any other value is served strict (fail safe: a typo
// never opens a pod to plaintext) and reported invalid.
func InboundPolicyOf(annotations map[string]string, def string) (policy string, invalid bool) {
	v, ok := annotations[InboundPolicyAnnotation]
	switch {
	case !ok:
		return def, false
	case ValidInboundPolicy(v):
		return v, false
	default:
		return InboundPolicyStrict, true
	}
}
