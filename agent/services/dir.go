package services

import (
	"fmt"
	"slices"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"

	"aether.io/node/agent/podsource/manifests"
)

// ReplaceFrom makes the model hold the Services and EndpointSlices of a
// manifest directory (manifests.Dir), plus the EndpointSlices the
// EndpointSlice controller would write for its Services with a selector
// and no slice there (ControllerSlices): a demo needs no hand-written
// slice.
func (m *Model) ReplaceFrom(o manifests.Objects) {
	m.Replace(o.Services, append(slices.Clone(o.EndpointSlices), ControllerSlices(o)...))
}

// ControllerSlices returns the EndpointSlices the EndpointSlice controller
// would write for the objects' Services that have a selector and no slice
// among the objects: one per distinct set of resolved target ports, named
// <service>-manifest-<n>.
func ControllerSlices(o manifests.Objects) []*discoveryv1.EndpointSlice {
	has := map[string]bool{}
	for _, es := range o.EndpointSlices {
		has[key(es.Namespace, es.Labels[LabelServiceName])] = true
	}
	var out []*discoveryv1.EndpointSlice
	for _, svc := range o.Services {
		if len(svc.Spec.Selector) == 0 || has[key(svc.Namespace, svc.Name)] || svc.Spec.Type == corev1.ServiceTypeExternalName {
			continue
		}
		sel := labels.SelectorFromSet(svc.Spec.Selector)
		byPorts := map[string]*discoveryv1.EndpointSlice{}
		var order []string
		for _, p := range o.Pods {
			if p.Namespace != svc.Namespace || !sel.Matches(labels.Set(p.Labels)) {
				continue
			}
			ports := resolvePorts(svc, p)
			sig := fmt.Sprint(portSig(ports))
			es := byPorts[sig]
			if es == nil {
				es = &discoveryv1.EndpointSlice{
					ObjectMeta:  metav1.ObjectMeta{Namespace: svc.Namespace, Name: fmt.Sprintf("%s-manifest-%d", svc.Name, len(order)), Labels: map[string]string{LabelServiceName: svc.Name}},
					AddressType: discoveryv1.AddressTypeIPv4,
					Ports:       ports,
				}
				byPorts[sig] = es
				order = append(order, sig)
			}
			es.Endpoints = append(es.Endpoints, podEndpoint(p))
		}
		for _, sig := range order {
			out = append(out, byPorts[sig])
		}
	}
	return out
}

func portSig(ps []discoveryv1.EndpointPort) []string {
	var out []string
	for _, p := range ps {
		out = append(out, fmt.Sprintf("%s=%d", ptr.Deref(p.Name, ""), ptr.Deref(p.Port, 0)))
	}
	return out
}

// resolvePorts resolves the Service's TCP target ports for pod p: a number
// as is (unset: the service port), a name by the pod's container ports (a
// name the pod does not declare: the port is left out, as the controller
// does).
func resolvePorts(svc *corev1.Service, p *corev1.Pod) []discoveryv1.EndpointPort {
	var out []discoveryv1.EndpointPort
	for _, sp := range svc.Spec.Ports {
		if sp.Protocol != "" && sp.Protocol != corev1.ProtocolTCP {
			continue
		}
		port := sp.Port
		switch {
		case sp.TargetPort.StrVal != "":
			port = 0
			for _, c := range p.Spec.Containers {
				for _, cp := range c.Ports {
					if cp.Name == sp.TargetPort.StrVal && (cp.Protocol == "" || cp.Protocol == corev1.ProtocolTCP) {
						port = cp.ContainerPort
					}
				}
			}
		case sp.TargetPort.IntVal != 0:
			port = sp.TargetPort.IntVal
		}
		if port == 0 {
			continue
		}
		out = append(out, discoveryv1.EndpointPort{Name: ptr.To(sp.Name), Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolTCP)})
	}
	return out
}

// podEndpoint is p as an EndpointSlice endpoint.
func podEndpoint(p *corev1.Pod) discoveryv1.Endpoint {
	ready := p.DeletionTimestamp == nil
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionFalse {
			ready = false
		}
	}
	e := discoveryv1.Endpoint{
		Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(ready), Serving: ptr.To(ready || p.DeletionTimestamp != nil), Terminating: ptr.To(p.DeletionTimestamp != nil)},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: p.Namespace, Name: p.Name, UID: p.UID},
	}
	if p.Spec.NodeName != "" {
		e.NodeName = ptr.To(p.Spec.NodeName)
	}
	for _, ip := range p.Status.PodIPs {
		e.Addresses = append(e.Addresses, ip.IP)
	}
	if len(e.Addresses) == 0 && p.Status.PodIP != "" {
		e.Addresses = []string{p.Status.PodIP}
	}
	return e
}
