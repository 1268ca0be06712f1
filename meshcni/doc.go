// Package meshcni is aether-cni, the chained mesh CNI plugin: it reports a
// pod to aether-agent (AddPod / RemovePod / GetPod / ReportAddResult on the
// agent's unix socket), pins the pod's netns for the proxy, probes the
// proxy's readiness inside the pod, and installs the transparent-capture
// divert (see pkg/capture). cmd/aether-cni only wires it to skel.
package meshcni
