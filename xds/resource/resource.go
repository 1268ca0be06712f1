// Package resource names the xDS resource types aether-node serves and
// consumes, in one neutral place (the shape of go-control-plane's
// pkg/resource/v3): the agent's servers, aether-proxy, aetherctl and the
// tests refer to these constants instead of spelling the type URLs.
package resource

const (
	// WorkloadType is istio.workload.Workload, served by xds/workload
	// (workload discovery, WDS) and consumed by aether-proxy and aetherctl.
	WorkloadType = "type.googleapis.com/istio.workload.Workload"
	// AddressType is istio.workload.Address (a Workload or a Service),
	// what ztunnel subscribes to; aether-proxy takes Services from it.
	AddressType = "type.googleapis.com/istio.workload.Address"
	// AuthorizationType is istio.security.Authorization, L4 authorization
	// policies as ztunnel consumes them, served by xds/workload beside
	// the Addresses and enforced by aether-proxy (proxy/authz).
	AuthorizationType = "type.googleapis.com/istio.security.Authorization"
	// ListenerType is envoy.config.listener.v3.Listener, built by
	// xds/listener and consumed by aether-proxy.
	ListenerType = "type.googleapis.com/envoy.config.listener.v3.Listener"
)
