package enrolment

import "testing"

// TestDecide is the rule table: the pod's own label wins over its
// namespace's, "false" opts a pod out of an enrolled namespace, and no
// label overrides a system namespace, host network or missing IPs.
func TestDecide(t *testing.T) {
	on := map[string]string{ManagedLabel: "true"}
	off := map[string]string{ManagedLabel: "false"}
	ambient := map[string]string{AmbientLabel: AmbientValue}
	other := map[string]string{ManagedLabel: "yes", AmbientLabel: "sidecar"}
	sys := Rules{SystemNamespaces: DefaultSystemNamespaces}
	alias := Rules{SystemNamespaces: DefaultSystemNamespaces, AmbientAlias: true}
	for _, tt := range []struct {
		name  string
		rules Rules
		pod   Pod
		want  Decision
	}{
		{"pod label", sys, Pod{Namespace: "shop", Labels: on, HasIPs: true}, Decision{Managed: true, Via: ViaPodLabel}},
		{"pod label in an enrolled namespace", sys, Pod{Namespace: "shop", Labels: on, NamespaceLabels: on, HasIPs: true}, Decision{Managed: true, Via: ViaPodLabel}},
		{"namespace label", sys, Pod{Namespace: "shop", NamespaceLabels: on, HasIPs: true}, Decision{Managed: true, Via: ViaNamespaceLabel}},
		{"pod opts out of an enrolled namespace", sys, Pod{Namespace: "shop", Labels: off, NamespaceLabels: on, HasIPs: true}, Decision{Reason: ReasonOptedOut}},
		{"pod false, namespace not enrolled", sys, Pod{Namespace: "shop", Labels: off, HasIPs: true}, Decision{Reason: ReasonNotManaged}},
		{"no labels", sys, Pod{Namespace: "shop", HasIPs: true}, Decision{Reason: ReasonNotManaged}},
		{"values other than true enrol nothing", alias, Pod{Namespace: "shop", Labels: other, NamespaceLabels: other, HasIPs: true}, Decision{Reason: ReasonNotManaged}},
		{"ambient namespace, alias off", sys, Pod{Namespace: "shop", NamespaceLabels: ambient, HasIPs: true}, Decision{Reason: ReasonNotManaged}},
		{"ambient namespace, alias on", alias, Pod{Namespace: "shop", NamespaceLabels: ambient, HasIPs: true}, Decision{Managed: true, Via: ViaNamespaceAmbient}},
		{"ambient namespace, pod opts out", alias, Pod{Namespace: "shop", Labels: off, NamespaceLabels: ambient, HasIPs: true}, Decision{Reason: ReasonOptedOut}},
		{"both namespace labels: aether's named", alias, Pod{Namespace: "shop", NamespaceLabels: map[string]string{ManagedLabel: "true", AmbientLabel: AmbientValue}, HasIPs: true}, Decision{Managed: true, Via: ViaNamespaceLabel}},
		{"system namespace, pod label", sys, Pod{Namespace: "kube-system", Labels: on, HasIPs: true}, Decision{Reason: ReasonSystemNamespace}},
		{"system namespace, namespace label", sys, Pod{Namespace: "kube-system", NamespaceLabels: on, HasIPs: true}, Decision{Reason: ReasonSystemNamespace}},
		{"chart namespace in the list", Rules{SystemNamespaces: []string{"mesh"}}, Pod{Namespace: "mesh", Labels: on, HasIPs: true}, Decision{Reason: ReasonSystemNamespace}},
		{"default list replaced", Rules{SystemNamespaces: []string{"mesh"}}, Pod{Namespace: "kube-system", Labels: on, HasIPs: true}, Decision{Managed: true, Via: ViaPodLabel}},
		{"host network, pod label", sys, Pod{Namespace: "shop", Labels: on, HostNetwork: true, HasIPs: true}, Decision{Reason: ReasonHostNetwork}},
		{"host network, namespace label", sys, Pod{Namespace: "shop", NamespaceLabels: on, HostNetwork: true, HasIPs: true}, Decision{Reason: ReasonHostNetwork}},
		{"no IPs", sys, Pod{Namespace: "shop", Labels: on, NamespaceLabels: on}, Decision{Reason: ReasonNoIPs}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.rules.Decide(tt.pod); got != tt.want {
				t.Errorf("Decide(%+v) = %+v, want %+v", tt.pod, got, tt.want)
			}
		})
	}
}
