// Package listener turns a mesh-managed pod record into the per-pod listener
// resources the agent serves to aether-proxy over ADS, and reads them back on
// the proxy side.
//
// The resources are standard envoy.config.listener.v3.Listener messages, so a
// real Envoy could take the same configuration: every address carries
// network_namespace_filepath (the pod's pinned netns), the capture listeners
// are transparent (IP_TRANSPARENT, the TPROXY divert of pkg/capture), and
// every generated Listener passes go-control-plane's ValidateAll.
//
// One pod gives up to four listeners, named "<prefix>/<container id>/<role>":
//
//	outbound    127.0.0.1:18081 (and [::1]:18081 when the pod has IPv6) TCP: readiness endpoint
//	capture     0.0.0.0:18001 (+ [::]:18001) TCP, transparent: diverted outbound connections
//	capture-udp 0.0.0.0:18001 (+ [::]:18001) UDP, transparent: diverted outbound datagrams
//	inbound     0.0.0.0:18008 (+ [::]:18008) TCP, transparent: the inbound listener
//
// The pod's identity travels in the listener metadata under the filter
// metadata key MetadataKey, so the proxy groups listeners per pod without
// parsing names; so do its UDS socket (uds_socket), its inbound policy
// (inbound_policy: permissive or strict) and the TCP ports its containers
// declare (declared_ports_known: true, with declared_tcp_ports the list,
// absent when the pod declares none). An agent that predates the ports
// sends neither key: the proxy then does not know them (see
// Spec.DeclaredPortsKnown).
package listener

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"aether.io/node/pkg/meshcontract"

	xdscore "github.com/cncf/xds/go/xds/core/v3"
	matcher "github.com/cncf/xds/go/xds/type/matcher/v3"
	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	route "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	router "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcm "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tcpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/tcp_proxy/v3"
	udpproxy "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/udp/udp_proxy/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// MetadataKey is the filter-metadata key under which a listener carries the
// identity of its pod.
const MetadataKey = "aether.io/pod"

// spiffeScheme starts every SPIFFE ID.
const spiffeScheme = "spiffe://"

// NamePrefix starts every listener name this package builds.
const NamePrefix = "aether"

// ReadyPath is the HTTP path of the readiness endpoint on the outbound
// listener; aether-cni's readiness probe GETs it from inside the pod netns.
const ReadyPath = meshcontract.ReadinessPath

// PassthroughCluster is the ORIGINAL_DST cluster a real Envoy would forward
// the capture and inbound listeners to (aether-proxy dials the original
// destination itself).
const PassthroughCluster = "aether_passthrough"

// Defaults of the listener ports, from the capture contract.
const (
	DefaultOutboundPort = meshcontract.OutboundPort
	DefaultCapturePort  = meshcontract.CapturePort
	DefaultInboundPort  = meshcontract.InboundPort
)

// Role says what a per-pod listener is for.
type Role string

// The roles of a pod's listeners.
const (
	// RoleOutbound is the loopback outbound listener; it serves the
	// readiness endpoint.
	RoleOutbound Role = "outbound"
	// RoleCapture is the transparent TCP capture listener.
	RoleCapture Role = "capture"
	// RoleCaptureUDP is the transparent UDP capture listener.
	RoleCaptureUDP Role = "capture-udp"
	// RoleInbound is the inbound listener.
	RoleInbound Role = "inbound"
)

// Roles lists every role in build order.
var Roles = []Role{RoleOutbound, RoleCapture, RoleCaptureUDP, RoleInbound}

// Ports are the per-pod listener ports. Zero fields take the defaults.
type Ports struct {
	Outbound uint16
	Capture  uint16
	Inbound  uint16
}

func (p Ports) withDefaults() Ports {
	if p.Outbound == 0 {
		p.Outbound = DefaultOutboundPort
	}
	if p.Capture == 0 {
		p.Capture = DefaultCapturePort
	}
	if p.Inbound == 0 {
		p.Inbound = DefaultInboundPort
	}
	return p
}

// Pod is the part of the agent's pod record the listeners are built from.
type Pod struct {
	// ContainerID is the pod sandbox's container id; it names the listeners.
	ContainerID string
	// Namespace and Name are the Kubernetes pod's.
	Namespace string
	Name      string
	// UID is the Kubernetes pod UID (may be empty).
	UID string
	// NetNSPath is the pinned network namespace path.
	NetNSPath string
	// IPs are the pod's addresses; an IPv6 address adds the IPv6 binds.
	IPs []netip.Addr
	// Ports are the listener ports (zero = defaults).
	Ports Ports
	// UDSSocket is the host path of the app's unix socket the agent
	// resolved from the pod's csi.aether.io volume (seed 000), where
	// inbound connections are delivered; "" delivers them over TCP.
	UDSSocket string
	// InboundPolicy is what the proxy does with a plaintext connection on
	// the inbound listener: meshcontract.InboundPolicyPermissive delivers
	// it to the app, meshcontract.InboundPolicyStrict resets it. The agent
	// decides it (pod annotation, else its default); "" is permissive.
	InboundPolicy string
	// SPIFFEID is the pod's SPIFFE identity
	// (spiffe://<trust-domain>/ns/<ns>/sa/<service-account>) when the agent
	// serves identities; the proxy then serves HBONE on the pod's :15008
	// with that identity. "" = no identity, no HBONE.
	SPIFFEID string
	// DeclaredPortsKnown says the agent knows the pod's declared container
	// ports; DeclaredTCPPorts are then the TCP ones (empty: it declares
	// none). aether-proxy's -hbone-declared-ports-only delivers HBONE
	// streams only to those. Unknown (a record written before the agent
	// recorded ports) sends nothing.
	DeclaredPortsKnown bool
	DeclaredTCPPorts   []uint16
}

// Validate reports a record listeners cannot be built from.
func (p Pod) Validate() error {
	switch {
	case p.ContainerID == "" || strings.Contains(p.ContainerID, "/"):
		return fmt.Errorf("container id %q must be non-empty and contain no '/'", p.ContainerID)
	case p.Namespace == "" || p.Name == "":
		return fmt.Errorf("pod namespace %q and name %q must be non-empty", p.Namespace, p.Name)
	case !strings.HasPrefix(p.NetNSPath, "/"):
		return fmt.Errorf("netns path %q must be absolute", p.NetNSPath)
	case len(p.IPs) == 0:
		return fmt.Errorf("pod %s/%s has no IPs: an unmanaged pod gets no listeners", p.Namespace, p.Name)
	case p.UDSSocket != "" && !strings.HasPrefix(p.UDSSocket, "/"):
		return fmt.Errorf("pod %s/%s UDS socket %q must be an absolute path", p.Namespace, p.Name, p.UDSSocket)
	case p.InboundPolicy != "" && !meshcontract.ValidInboundPolicy(p.InboundPolicy):
		return fmt.Errorf("pod %s/%s inbound policy %q must be %q or %q", p.Namespace, p.Name, p.InboundPolicy,
			meshcontract.InboundPolicyPermissive, meshcontract.InboundPolicyStrict)
	case p.SPIFFEID != "" && !strings.HasPrefix(p.SPIFFEID, spiffeScheme):
		return fmt.Errorf("pod %s/%s SPIFFE ID %q must start with %q", p.Namespace, p.Name, p.SPIFFEID, spiffeScheme)
	}
	for _, ip := range p.IPs {
		if !ip.IsValid() {
			return fmt.Errorf("pod %s/%s has an invalid IP", p.Namespace, p.Name)
		}
	}
	if !p.DeclaredPortsKnown && len(p.DeclaredTCPPorts) > 0 {
		return fmt.Errorf("pod %s/%s has declared ports %v but DeclaredPortsKnown is false", p.Namespace, p.Name, p.DeclaredTCPPorts)
	}
	if slices.Contains(p.DeclaredTCPPorts, 0) {
		return fmt.Errorf("pod %s/%s declared port 0: ports are 1-65535", p.Namespace, p.Name)
	}
	return nil
}

func (p Pod) hasIPv6() bool {
	return slices.ContainsFunc(p.IPs, func(a netip.Addr) bool { return a.Unmap().Is6() })
}

func (p Pod) hasIPv4() bool {
	return slices.ContainsFunc(p.IPs, func(a netip.Addr) bool { return a.Unmap().Is4() })
}

// ListenerName is the resource name of one of the pod's listeners.
func ListenerName(containerID string, r Role) string {
	return NamePrefix + "/" + containerID + "/" + string(r)
}

// Build returns the pod's listeners, in the order of Roles, each passing
// ValidateAll. The listeners share one Metadata message (the pod's
// identity): they are read-only once built.
func Build(p Pod) ([]*listenerv3.Listener, error) {
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("failed to build listeners for pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	ports := p.Ports.withDefaults()
	ips := make([]string, len(p.IPs))
	for i, ip := range p.IPs {
		ips[i] = ip.String()
	}
	// One Metadata for all of the pod's listeners: the agent keeps every
	// pod's listeners for as long as the pod lives, and a copy per listener
	// made this pointer-rich map of structpb values most of the heap the
	// GC marks on each cycle (agent/README.md, 'AddPod cost').
	meta := podMetadata(p, ips)
	out := make([]*listenerv3.Listener, 0, len(Roles))
	for _, r := range Roles {
		l, err := buildOne(p, ports, r, meta)
		if err != nil {
			return nil, err
		}
		if err := l.ValidateAll(); err != nil {
			return nil, fmt.Errorf("failed to validate listener %q: %w", l.GetName(), err)
		}
		out = append(out, l)
	}
	return out, nil
}

// podMetadata returns a new Metadata carrying the pod's identity, built
// directly (a reflective proto.Clone costs several times more). ips are
// the pod's addresses as strings.
func podMetadata(p Pod, ips []string) *core.Metadata {
	list := make([]*structpb.Value, len(ips))
	for i, ip := range ips {
		list[i] = structpb.NewStringValue(ip)
	}
	fields := map[string]*structpb.Value{
		"container_id": structpb.NewStringValue(p.ContainerID),
		"namespace":    structpb.NewStringValue(p.Namespace),
		"name":         structpb.NewStringValue(p.Name),
		"uid":          structpb.NewStringValue(p.UID),
		"ips":          structpb.NewListValue(&structpb.ListValue{Values: list}),
	}
	if p.UDSSocket != "" {
		fields["uds_socket"] = structpb.NewStringValue(p.UDSSocket)
	}
	if p.InboundPolicy != "" {
		fields["inbound_policy"] = structpb.NewStringValue(p.InboundPolicy)
	}
	if p.SPIFFEID != "" {
		fields["spiffe_id"] = structpb.NewStringValue(p.SPIFFEID)
	}
	if p.DeclaredPortsKnown {
		fields["declared_ports_known"] = structpb.NewBoolValue(true)
		if len(p.DeclaredTCPPorts) > 0 {
			ports := make([]*structpb.Value, len(p.DeclaredTCPPorts))
			for i, port := range p.DeclaredTCPPorts {
				ports[i] = structpb.NewNumberValue(float64(port))
			}
			fields["declared_tcp_ports"] = structpb.NewListValue(&structpb.ListValue{Values: ports})
		}
	}
	return &core.Metadata{FilterMetadata: map[string]*structpb.Struct{MetadataKey: {Fields: fields}}}
}

func sockAddr(ip string, port uint16, proto core.SocketAddress_Protocol, netns string) *core.Address {
	return &core.Address{Address: &core.Address_SocketAddress{SocketAddress: &core.SocketAddress{
		Protocol:                 proto,
		Address:                  ip,
		PortSpecifier:            &core.SocketAddress_PortValue{PortValue: uint32(port)},
		NetworkNamespaceFilepath: netns,
	}}}
}

func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		// Only a nil or unregistered message fails; every message here is a
		// registered, non-nil literal.
		panic(fmt.Sprintf("failed to wrap %T: %v", m, err))
	}
	return a
}

func tcpProxyChain(stat string) []*listenerv3.FilterChain {
	tp := &tcpproxy.TcpProxy{
		StatPrefix:       stat,
		ClusterSpecifier: &tcpproxy.TcpProxy_Cluster{Cluster: PassthroughCluster},
	}
	return []*listenerv3.FilterChain{{
		Filters: []*listenerv3.Filter{{
			Name:       "envoy.filters.network.tcp_proxy",
			ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(tp)},
		}},
	}}
}

func readinessChain(stat string) []*listenerv3.FilterChain {
	m := &hcm.HttpConnectionManager{
		StatPrefix: stat,
		RouteSpecifier: &hcm.HttpConnectionManager_RouteConfig{RouteConfig: &route.RouteConfiguration{
			Name: stat,
			VirtualHosts: []*route.VirtualHost{{
				Name:    "readiness",
				Domains: []string{"*"},
				Routes: []*route.Route{{
					Match: &route.RouteMatch{PathSpecifier: &route.RouteMatch_Path{Path: ReadyPath}},
					Action: &route.Route_DirectResponse{DirectResponse: &route.DirectResponseAction{
						Status: 200,
					}},
				}},
			}},
		}},
		HttpFilters: []*hcm.HttpFilter{{
			Name:       "envoy.filters.http.router",
			ConfigType: &hcm.HttpFilter_TypedConfig{TypedConfig: mustAny(&router.Router{})},
		}},
	}
	return []*listenerv3.FilterChain{{
		Filters: []*listenerv3.Filter{{
			Name:       "envoy.filters.network.http_connection_manager",
			ConfigType: &listenerv3.Filter_TypedConfig{TypedConfig: mustAny(m)},
		}},
	}}
}

func buildOne(p Pod, ports Ports, r Role, meta *core.Metadata) (*listenerv3.Listener, error) {
	name := ListenerName(p.ContainerID, r)
	stat := strings.ReplaceAll(name, "/", "_")
	var hosts []string
	var port uint16
	sockProto := core.SocketAddress_TCP
	switch r {
	case RoleOutbound:
		port = ports.Outbound
		if p.hasIPv4() {
			hosts = append(hosts, "127.0.0.1")
		}
		if p.hasIPv6() {
			hosts = append(hosts, "::1")
		}
	case RoleCapture, RoleCaptureUDP, RoleInbound:
		port = ports.Capture
		if r == RoleInbound {
			port = ports.Inbound
		}
		if r == RoleCaptureUDP {
			sockProto = core.SocketAddress_UDP
		}
		if p.hasIPv4() {
			hosts = append(hosts, "0.0.0.0")
		}
		if p.hasIPv6() {
			hosts = append(hosts, "::")
		}
	default:
		return nil, fmt.Errorf("unknown listener role %q", r)
	}
	l := &listenerv3.Listener{
		Name:     name,
		Address:  sockAddr(hosts[0], port, sockProto, p.NetNSPath),
		Metadata: meta,
	}
	for _, h := range hosts[1:] {
		l.AdditionalAddresses = append(l.AdditionalAddresses, &listenerv3.AdditionalAddress{
			Address: sockAddr(h, port, sockProto, p.NetNSPath),
		})
	}
	switch r {
	case RoleOutbound:
		l.FilterChains = readinessChain(stat)
	case RoleCapture:
		l.Transparent = wrapperspb.Bool(true)
		l.FilterChains = tcpProxyChain(stat)
	case RoleInbound:
		// Transparent: aether-cni's inbound redirect (capture
		// inbound_capture) TPROXYs plaintext inbound connections here,
		// and TPROXY hands packets only to IP_TRANSPARENT sockets.
		l.Transparent = wrapperspb.Bool(true)
		l.FilterChains = tcpProxyChain(stat)
	case RoleCaptureUDP:
		l.Transparent = wrapperspb.Bool(true)
		l.UdpListenerConfig = &listenerv3.UdpListenerConfig{}
		l.ListenerFilters = []*listenerv3.ListenerFilter{{
			Name: "envoy.filters.udp_listener.udp_proxy",
			ConfigType: &listenerv3.ListenerFilter_TypedConfig{TypedConfig: mustAny(&udpproxy.UdpProxyConfig{
				StatPrefix: stat,
				RouteSpecifier: &udpproxy.UdpProxyConfig_Matcher{Matcher: &matcher.Matcher{
					OnNoMatch: &matcher.Matcher_OnMatch{OnMatch: &matcher.Matcher_OnMatch_Action{Action: &xdscore.TypedExtensionConfig{
						Name:        "route",
						TypedConfig: mustAny(&udpproxy.Route{Cluster: PassthroughCluster}),
					}}},
				}},
			})},
		}}
	}
	return l, nil
}

// Bind is one socket a listener asks for.
type Bind struct {
	// Addr is the local address and port.
	Addr netip.AddrPort
	// UDP is set for a datagram socket, else TCP.
	UDP bool
}

// Spec is what the proxy needs from one Listener resource.
type Spec struct {
	// Name is the resource name.
	Name string
	// PodKey identifies the pod (its container id).
	PodKey string
	// Namespace and PodName are the pod's, for logs and metrics.
	Namespace string
	PodName   string
	// Role is the listener's role.
	Role Role
	// PodIPs are the pod's addresses (from the metadata).
	PodIPs []netip.Addr
	// UID is the pod's Kubernetes UID ("" from an agent that sent none):
	// the proxy delivers to a UDS socket only inside that pod's own socket
	// directory (meshcontract.PodSocketDir).
	UID string
	// UDSSocket is where inbound connections go instead of TCP ("" =
	// TCP): see Pod.UDSSocket.
	UDSSocket string
	// InboundPolicy is meshcontract.InboundPolicyPermissive or
	// meshcontract.InboundPolicyStrict: see Pod.InboundPolicy. Parse
	// reads an absent value (an agent that predates it) as permissive,
	// and a value it does not know as strict (fail safe).
	InboundPolicy string
	// SPIFFEID is the pod's SPIFFE identity ("" = none): see Pod.SPIFFEID.
	SPIFFEID string
	// DeclaredPortsKnown and DeclaredTCPPorts: see Pod. Parse reads a
	// listener without declared_ports_known (an agent that predates it) as
	// unknown, and declared_ports_known without declared_tcp_ports as a pod
	// that declares none.
	DeclaredPortsKnown bool
	DeclaredTCPPorts   []uint16
	// NetNSPath is the network namespace every bind lives in.
	NetNSPath string
	// Transparent asks for IP_TRANSPARENT sockets.
	Transparent bool
	// Binds are the sockets to open.
	Binds []Bind
}

// ErrNotOurs is returned by Parse for a listener this package did not build.
var ErrNotOurs = errors.New("listener carries no aether pod metadata")

// Parse reads a Listener built by Build back into a Spec. Every address must
// carry the same network_namespace_filepath.
func Parse(l *listenerv3.Listener) (Spec, error) {
	s := Spec{Name: l.GetName(), Transparent: l.GetTransparent().GetValue()}
	md := l.GetMetadata().GetFilterMetadata()[MetadataKey]
	if md == nil {
		return s, fmt.Errorf("failed to parse listener %q: %w", l.GetName(), ErrNotOurs)
	}
	f := md.GetFields()
	s.PodKey = f["container_id"].GetStringValue()
	s.Namespace = f["namespace"].GetStringValue()
	s.PodName = f["name"].GetStringValue()
	s.UID = f["uid"].GetStringValue()
	s.UDSSocket = f["uds_socket"].GetStringValue()
	switch s.InboundPolicy = f["inbound_policy"].GetStringValue(); {
	case s.InboundPolicy == "":
		s.InboundPolicy = meshcontract.InboundPolicyPermissive
	case !meshcontract.ValidInboundPolicy(s.InboundPolicy):
		s.InboundPolicy = meshcontract.InboundPolicyStrict
	}
	s.SPIFFEID = f["spiffe_id"].GetStringValue()
	if s.PodKey == "" {
		return s, fmt.Errorf("failed to parse listener %q: metadata %s has no container_id", l.GetName(), MetadataKey)
	}
	for _, v := range f["ips"].GetListValue().GetValues() {
		ip, err := netip.ParseAddr(v.GetStringValue())
		if err != nil {
			return s, fmt.Errorf("failed to parse listener %q pod IP %q: %w", l.GetName(), v.GetStringValue(), err)
		}
		s.PodIPs = append(s.PodIPs, ip)
	}
	if s.UDSSocket != "" && !strings.HasPrefix(s.UDSSocket, "/") {
		return s, fmt.Errorf("failed to parse listener %q: uds_socket %q is not an absolute path", l.GetName(), s.UDSSocket)
	}
	if s.SPIFFEID != "" && !strings.HasPrefix(s.SPIFFEID, spiffeScheme) {
		return s, fmt.Errorf("failed to parse listener %q: spiffe_id %q does not start with %q", l.GetName(), s.SPIFFEID, spiffeScheme)
	}
	if err := parseDeclaredPorts(f, &s); err != nil {
		return s, fmt.Errorf("failed to parse listener %q: %w", l.GetName(), err)
	}
	role := Role(l.GetName()[strings.LastIndex(l.GetName(), "/")+1:])
	if !slices.Contains(Roles, role) {
		return s, fmt.Errorf("failed to parse listener %q: role %q is not one of %v", l.GetName(), role, Roles)
	}
	s.Role = role
	addrs := []*core.Address{l.GetAddress()}
	for _, a := range l.GetAdditionalAddresses() {
		addrs = append(addrs, a.GetAddress())
	}
	for _, a := range addrs {
		sa := a.GetSocketAddress()
		if sa == nil {
			return s, fmt.Errorf("failed to parse listener %q: an address is not a socket address", l.GetName())
		}
		ip, err := netip.ParseAddr(sa.GetAddress())
		if err != nil {
			return s, fmt.Errorf("failed to parse listener %q address %q: %w", l.GetName(), sa.GetAddress(), err)
		}
		if sa.GetPortValue() == 0 || sa.GetPortValue() > 65535 {
			return s, fmt.Errorf("failed to parse listener %q: port %d is not 1-65535", l.GetName(), sa.GetPortValue())
		}
		if s.NetNSPath == "" {
			s.NetNSPath = sa.GetNetworkNamespaceFilepath()
		}
		if sa.GetNetworkNamespaceFilepath() == "" || sa.GetNetworkNamespaceFilepath() != s.NetNSPath {
			return s, fmt.Errorf("failed to parse listener %q: every address needs the same network_namespace_filepath, have %q and %q",
				l.GetName(), s.NetNSPath, sa.GetNetworkNamespaceFilepath())
		}
		s.Binds = append(s.Binds, Bind{
			Addr: netip.AddrPortFrom(ip, uint16(sa.GetPortValue())),
			UDP:  sa.GetProtocol() == core.SocketAddress_UDP,
		})
	}
	return s, nil
}

// parseDeclaredPorts reads declared_ports_known and declared_tcp_ports into
// s: each port a whole number 1-65535.
func parseDeclaredPorts(f map[string]*structpb.Value, s *Spec) error {
	known, ok := f["declared_ports_known"]
	if !ok {
		if _, ok := f["declared_tcp_ports"]; ok {
			return errors.New("declared_tcp_ports without declared_ports_known")
		}
		return nil
	}
	if _, isBool := known.GetKind().(*structpb.Value_BoolValue); !isBool || !known.GetBoolValue() {
		return fmt.Errorf("declared_ports_known is %v, want true", known.AsInterface())
	}
	s.DeclaredPortsKnown = true
	for _, v := range f["declared_tcp_ports"].GetListValue().GetValues() {
		n, isNum := v.GetKind().(*structpb.Value_NumberValue)
		if !isNum || n.NumberValue < 1 || n.NumberValue > 65535 || n.NumberValue != float64(uint16(n.NumberValue)) {
			return fmt.Errorf("declared_tcp_ports holds %v: ports are whole numbers 1-65535", v.AsInterface())
		}
		s.DeclaredTCPPorts = append(s.DeclaredTCPPorts, uint16(n.NumberValue))
	}
	return nil
}
