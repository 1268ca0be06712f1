// Package services is the agent's Service model: it turns Kubernetes
// Services and EndpointSlices into what workload discovery serves for
// them, exactly as istiod's ambient controller would: an
// istio.workload.Service per Service with a virtual IP (or headless), each
// endpoint Workload's services map, and, for an endpoint that is not in
// the mesh, a workload known from its EndpointSlice alone (tunnel NONE, so
// a client's proxy connects to it directly). See README.md.
package services

import (
	"net/netip"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"k8s.io/utils/ptr"

	workloadpb "aether.io/node/api/istio/workload"
)

// AnnotationTrafficDistribution is Istio's annotation that sets a Service's
// traffic distribution where spec.trafficDistribution is unset (or not
// supported by the cluster's Kubernetes).
const AnnotationTrafficDistribution = "networking.istio.io/traffic-distribution"

// Config is the cluster-wide part of what the model builds.
type Config struct {
	// ClusterID is the cluster name, the first segment of every workload
	// uid (workload.UID). Required.
	ClusterID string
	// ClusterDomain is the DNS domain Service hostnames end in
	// (<name>.<namespace>.svc.<domain>); default cluster.local.
	ClusterDomain string
	// Network is the network the addresses belong to (empty: default).
	Network string
}

// Hostname is the Service's DNS name: <name>.<namespace>.svc.<domain>.
func (c Config) Hostname(namespace, name string) string {
	d := c.ClusterDomain
	if d == "" {
		d = "cluster.local"
	}
	return name + "." + namespace + ".svc." + d
}

// BuildService returns the istio.workload.Service served for svc, or nil
// for a Service that is not served: ExternalName (a DNS alias, no
// endpoints). A headless Service (clusterIP None) is served without
// addresses: it only names its endpoints.
func BuildService(cfg Config, svc *corev1.Service) *workloadpb.Service {
	if svc.Spec.Type == corev1.ServiceTypeExternalName {
		return nil
	}
	out := &workloadpb.Service{
		Name:      svc.Name,
		Namespace: svc.Namespace,
		Hostname:  cfg.Hostname(svc.Namespace, svc.Name),
	}
	ips := svc.Spec.ClusterIPs
	if len(ips) == 0 && svc.Spec.ClusterIP != "" {
		ips = []string{svc.Spec.ClusterIP}
	}
	v4, v6 := false, false
	for _, s := range ips {
		a, err := netip.ParseAddr(s)
		if err != nil { // "None" (headless) or garbage: no VIP
			continue
		}
		a = a.Unmap()
		v4, v6 = v4 || a.Is4(), v6 || a.Is6()
		out.Addresses = append(out.Addresses, &workloadpb.NetworkAddress{Network: cfg.Network, Address: a.AsSlice()})
	}
	switch {
	case v4 && v6:
		out.IpFamilies = workloadpb.IPFamilies_DUAL
	case v4:
		out.IpFamilies = workloadpb.IPFamilies_IPV4_ONLY
	case v6:
		out.IpFamilies = workloadpb.IPFamilies_IPV6_ONLY
	}
	for _, p := range svc.Spec.Ports {
		if p.Protocol != "" && p.Protocol != corev1.ProtocolTCP {
			continue // the mesh carries TCP only
		}
		port := &workloadpb.Port{ServicePort: uint32(p.Port), AppProtocol: appProtocol(p)}
		if p.TargetPort.IntVal != 0 && p.TargetPort.StrVal == "" {
			port.TargetPort = uint32(p.TargetPort.IntVal)
		} else if p.TargetPort.StrVal == "" {
			port.TargetPort = uint32(p.Port) // unset: the service port
		}
		out.Ports = append(out.Ports, port)
	}
	out.LoadBalancing = loadBalancing(svc)
	return out
}

// appProtocol maps a port's appProtocol (or, as Istio, its name prefix) to
// ztunnel's enum.
func appProtocol(p corev1.ServicePort) workloadpb.AppProtocol {
	proto := ""
	if p.AppProtocol != nil {
		proto = strings.ToLower(*p.AppProtocol)
	} else if i := strings.IndexByte(p.Name, '-'); i > 0 {
		proto = strings.ToLower(p.Name[:i])
	} else {
		proto = strings.ToLower(p.Name)
	}
	switch proto {
	case "http", "http1", "http11":
		return workloadpb.AppProtocol_HTTP11
	case "http2", "h2c", "kubernetes.io/h2c":
		return workloadpb.AppProtocol_HTTP2
	case "grpc":
		return workloadpb.AppProtocol_GRPC
	}
	return workloadpb.AppProtocol_UNKNOWN
}

// loadBalancing maps the Service's traffic distribution and
// publishNotReadyAddresses as istiod's ambient Service builder does:
// PreferSameZone (or PreferClose) ranks endpoints by network, region and
// zone; PreferSameNode down to the node; both fall back to farther ones
// (FAILOVER). publishNotReadyAddresses allows unhealthy endpoints.
func loadBalancing(svc *corev1.Service) *workloadpb.LoadBalancing {
	td := svc.Annotations[AnnotationTrafficDistribution]
	if svc.Spec.TrafficDistribution != nil {
		td = *svc.Spec.TrafficDistribution
	}
	var lb *workloadpb.LoadBalancing
	switch td {
	case corev1.ServiceTrafficDistributionPreferSameZone, corev1.ServiceTrafficDistributionPreferClose:
		lb = &workloadpb.LoadBalancing{Mode: workloadpb.LoadBalancing_FAILOVER, RoutingPreference: []workloadpb.LoadBalancing_Scope{
			workloadpb.LoadBalancing_NETWORK, workloadpb.LoadBalancing_REGION, workloadpb.LoadBalancing_ZONE,
		}}
	case corev1.ServiceTrafficDistributionPreferSameNode:
		lb = &workloadpb.LoadBalancing{Mode: workloadpb.LoadBalancing_FAILOVER, RoutingPreference: []workloadpb.LoadBalancing_Scope{
			workloadpb.LoadBalancing_NETWORK, workloadpb.LoadBalancing_REGION, workloadpb.LoadBalancing_ZONE,
			workloadpb.LoadBalancing_SUBZONE, workloadpb.LoadBalancing_NODE,
		}}
	}
	if svc.Spec.PublishNotReadyAddresses {
		if lb == nil {
			lb = &workloadpb.LoadBalancing{}
		}
		lb.HealthPolicy = workloadpb.LoadBalancing_ALLOW_ALL
	}
	return lb
}

// Endpoint is one pod an EndpointSlice names, as the model keeps it.
type Endpoint struct {
	// Namespace and Name are the pod's (the slice's targetRef).
	Namespace, Name string
	// Node is the endpoint's nodeName.
	Node string
	// Addresses are the endpoint's IPs.
	Addresses []netip.Addr
	// Ready is the endpoint's ready condition (unset: ready).
	Ready bool
	// Ports are the Service's TCP ports this endpoint serves, the target
	// port resolved for it (the slice's port of the same name).
	Ports []*workloadpb.Port
}

// Reasons an endpoint's port is left unresolved (Unresolved.Reason, the
// reason label of aether_agent_service_unresolved_target_ports_total).
const (
	// ReasonNotDeclared: the EndpointSlice gives no port of the Service
	// port's name (the EndpointSlice controller leaves out a named
	// targetPort the pod declares no container port for), or one without a
	// number.
	ReasonNotDeclared = "not_declared"
	// ReasonInvalid: the EndpointSlice gives a port number outside 1-65535.
	ReasonInvalid = "invalid"
)

// UnresolvedReasons are every Unresolved.Reason value.
var UnresolvedReasons = []string{ReasonNotDeclared, ReasonInvalid}

// Unresolved is a Service port with a named targetPort that an
// EndpointSlice resolves to no usable port: its endpoints are not served
// for that port (they keep the Service's other ports).
type Unresolved struct {
	// ServicePort is the Service's port, TargetPort its targetPort's name.
	ServicePort uint32
	TargetPort  string
	// Reason is ReasonNotDeclared or ReasonInvalid.
	Reason string
}

// SliceEndpoints returns the pod endpoints of an EndpointSlice of svc:
// only endpoints whose targetRef is a Pod (others have no workload); each
// with the Service's ports it serves, matched by port name, the target
// port being the slice's (resolved per endpoint by the EndpointSlice
// controller, so a named targetPort is resolved per pod). A slice port
// without a number in 1-65535 is never served as a target port: a numeric
// targetPort then falls back to the Service's number (as the consumers
// do), and a named one is unresolved: the second result lists those, and
// the endpoints are served without that port.
func SliceEndpoints(svc *corev1.Service, es *discoveryv1.EndpointSlice) ([]Endpoint, []Unresolved) {
	if es.AddressType == discoveryv1.AddressTypeFQDN {
		return nil, nil
	}
	var ports []*workloadpb.Port
	var unresolved []Unresolved
	for _, p := range svc.Spec.Ports {
		if p.Protocol != "" && p.Protocol != corev1.ProtocolTCP {
			continue // the mesh carries TCP only
		}
		reason := ReasonNotDeclared
		for _, sp := range es.Ports {
			if ptr.Deref(sp.Name, "") != p.Name || (sp.Protocol != nil && *sp.Protocol != corev1.ProtocolTCP) || sp.Port == nil {
				continue
			}
			if n := *sp.Port; n < 1 || n > 65535 {
				reason = ReasonInvalid
				continue
			}
			ports = append(ports, &workloadpb.Port{ServicePort: uint32(p.Port), TargetPort: uint32(*sp.Port)})
			reason = ""
			break
		}
		if reason != "" && p.TargetPort.StrVal != "" {
			unresolved = append(unresolved, Unresolved{ServicePort: uint32(p.Port), TargetPort: p.TargetPort.StrVal, Reason: reason})
		}
	}
	slices.SortFunc(ports, func(a, b *workloadpb.Port) int { return int(a.ServicePort) - int(b.ServicePort) })
	var out []Endpoint
	for _, e := range es.Endpoints {
		if e.TargetRef == nil || e.TargetRef.Kind != "Pod" || e.TargetRef.Name == "" {
			continue
		}
		ep := Endpoint{
			Namespace: e.TargetRef.Namespace, Name: e.TargetRef.Name,
			Ready: e.Conditions.Ready == nil || *e.Conditions.Ready,
			Ports: ports,
		}
		if ep.Namespace == "" {
			ep.Namespace = es.Namespace
		}
		if e.NodeName != nil {
			ep.Node = *e.NodeName
		}
		for _, s := range e.Addresses {
			if a, err := netip.ParseAddr(s); err == nil {
				ep.Addresses = append(ep.Addresses, a.Unmap())
			}
		}
		out = append(out, ep)
	}
	if len(out) == 0 {
		unresolved = nil // no endpoint is left without the port
	}
	return out, unresolved
}
