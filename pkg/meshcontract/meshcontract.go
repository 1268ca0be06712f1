// Package meshcontract is the one place that fixes what aether-cni's capture
// divert and aether-proxy must agree on: the per-pod listener ports, the
// readiness endpoint, the socket mark that exempts the proxy's own upstream
// sockets from capture, the fwmark and route table of diverted packets, and
// the mark of the proxy's source-preserving inbound delivery.
// pkg/capture, xds/listener and proxy/dataplane take their defaults from
// here, so the two sides cannot drift. The ports stay clear of Istio's 150xx
// range so both meshes can share a node. It also fixes the UDS contract
// between the csi.aether.io driver and aether-agent (uds.go), and the
// sockets aether-agent serves to aether-proxy (sockets.go).
package meshcontract

const (
	// OutboundPort is the proxy's outbound listener on 127.0.0.1 in each pod;
	// it serves ReadinessPath.
	OutboundPort = 18081
	// CapturePort is where the proxy's transparent (IP_TRANSPARENT) TCP and
	// UDP listeners receive diverted outbound traffic.
	CapturePort = 18001
	// InboundPort is the proxy's inbound listener; it is never diverted.
	InboundPort = 18008
	// HBONEPort is every mesh pod's HBONE listener (Istio's port, for
	// interop): the proxy serves and dials it (proxy/hbone.DefaultPort) and
	// the capture never redirects it (pkg/capture.DefaultHBONEPort).
	HBONEPort = 15008
	// ReadinessPath is the readiness endpoint aether-cni probes: 200 only
	// while the pod's listeners are served, 503 while draining.
	ReadinessPath = "/aether/readyz"
	// DeliverMark is the SO_MARK on the proxy's inbound delivery sockets
	// that carry the client's address as source (IP_TRANSPARENT): the
	// divert saves it in the connection's conntrack mark, puts it back on
	// the app's replies, and an ip rule sends it to RouteTable, so the
	// replies to the foreign client address come back to the proxy's
	// socket over lo instead of leaving the pod.
	DeliverMark = 0xae7d
	// BypassMark is the SO_MARK on the proxy's own upstream sockets; packets
	// carrying it are never diverted.
	BypassMark = 0xae7e
	// DivertMark is the fwmark set on diverted packets; an ip rule sends it
	// to RouteTable.
	DivertMark = 0xae7f
	// RouteTable holds the local default routes (IPv4 and IPv6) on lo.
	RouteTable = 133
)
