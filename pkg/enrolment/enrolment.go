// Package enrolment decides whether a pod is mesh-managed: from its own
// label, its namespace's label (optionally Istio ambient's), and the
// exclusions no label overrides (system namespaces, host-network pods, pods
// without IPs). The rule is a pure function of its input, so the agent's
// decision at CNI ADD and a re-decision after a label change agree.
package enrolment

import "slices"

// Label names and values the rules read.
const (
	// ManagedLabel on a pod or a namespace: "true" enrols, and on a pod
	// "false" keeps it out of an enrolled namespace.
	ManagedLabel = "aether.io/managed"
	// AmbientLabel with AmbientValue on a namespace enrols it too, when
	// Rules.AmbientAlias is on (Istio ambient's namespace label).
	AmbientLabel = "istio.io/dataplane-mode"
	// AmbientValue is AmbientLabel's enrolling value.
	AmbientValue = "ambient"
)

// DefaultSystemNamespaces are never mesh-managed.
var DefaultSystemNamespaces = []string{"kube-system", "kube-public", "kube-node-lease", "aether-system"}

// Via says which label enrolled a managed pod.
type Via string

// The ways a pod is enrolled.
const (
	// ViaPodLabel: the pod carries aether.io/managed: "true".
	ViaPodLabel Via = "pod_label"
	// ViaNamespaceLabel: its namespace carries aether.io/managed: "true".
	ViaNamespaceLabel Via = "namespace_label"
	// ViaNamespaceAmbient: its namespace carries
	// istio.io/dataplane-mode: ambient (with Rules.AmbientAlias).
	ViaNamespaceAmbient Via = "namespace_ambient"
)

// Reason says why a pod is not managed.
type Reason string

// The reasons a pod is not managed, in the order the rules test them.
const (
	ReasonSystemNamespace Reason = "system_namespace"
	ReasonHostNetwork     Reason = "host_network"
	ReasonNoIPs           Reason = "no_ips"
	// ReasonOptedOut: the pod carries aether.io/managed: "false" in an
	// enrolled namespace.
	ReasonOptedOut Reason = "opted_out"
	// ReasonNotManaged: neither the pod nor its namespace enrols it.
	ReasonNotManaged Reason = "not_managed"
)

// Rules are the node's enrolment settings.
type Rules struct {
	// SystemNamespaces are never managed, whatever their labels.
	SystemNamespaces []string
	// AmbientAlias makes istio.io/dataplane-mode: ambient on a namespace
	// enrol it as aether.io/managed: "true" does.
	AmbientAlias bool
}

// Pod is what the rules read of a pod and its namespace.
type Pod struct {
	Namespace       string
	Labels          map[string]string
	NamespaceLabels map[string]string
	HostNetwork     bool
	HasIPs          bool
}

// Decision is the outcome for one pod: Via when Managed, else Reason.
type Decision struct {
	Managed bool
	Via     Via
	Reason  Reason
}

// IsSystemNamespace says whether ns is never managed.
func (r Rules) IsSystemNamespace(ns string) bool {
	return slices.Contains(r.SystemNamespaces, ns)
}

// Decide applies the rules to p: exclusions first (system namespace, host
// network, no IPs), then the pod's own label, then its namespace's.
func (r Rules) Decide(p Pod) Decision {
	switch {
	case r.IsSystemNamespace(p.Namespace):
		return Decision{Reason: ReasonSystemNamespace}
	case p.HostNetwork:
		return Decision{Reason: ReasonHostNetwork}
	case !p.HasIPs:
		return Decision{Reason: ReasonNoIPs}
	}
	switch p.Labels[ManagedLabel] {
	case "true":
		return Decision{Managed: true, Via: ViaPodLabel}
	case "false":
		if r.namespaceVia(p.NamespaceLabels) != "" {
			return Decision{Reason: ReasonOptedOut}
		}
		return Decision{Reason: ReasonNotManaged}
	}
	if via := r.namespaceVia(p.NamespaceLabels); via != "" {
		return Decision{Managed: true, Via: via}
	}
	return Decision{Reason: ReasonNotManaged}
}

// namespaceVia is how a namespace with labels enrols its pods, or "".
func (r Rules) namespaceVia(labels map[string]string) Via {
	switch {
	case labels[ManagedLabel] == "true":
		return ViaNamespaceLabel
	case r.AmbientAlias && labels[AmbientLabel] == AmbientValue:
		return ViaNamespaceAmbient
	}
	return ""
}
