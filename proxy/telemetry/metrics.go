// Package telemetry holds aether-proxy's Prometheus metrics: per-connection
// TCP counters labelled with the workloads at both ends (looked up in the WDS
// index), plus listener and datagram counters.
package telemetry

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"aether.io/node/proxy/peers"
)

// Unknown is the label value of an end not found in the WDS index.
const Unknown = "unknown"

// PeerLabels are the labels of every aether_tcp_* series, in order.
var PeerLabels = []string{
	"direction",
	"source_workload", "source_workload_namespace", "source_canonical_name",
	"destination_workload", "destination_workload_namespace", "destination_canonical_name",
	"source_principal", "destination_principal",
}

// Metrics are the proxy's collectors, registered on their own registry.
type Metrics struct {
	// Registry holds every collector below (and the Go and process
	// collectors).
	Registry *prometheus.Registry

	opened   *prometheus.CounterVec
	closed   *prometheus.CounterVec
	sent     *prometheus.CounterVec
	received *prometheus.CounterVec
	duration *prometheus.HistogramVec
	failed   *prometheus.CounterVec
	udp      *prometheus.CounterVec
	inbound  *prometheus.CounterVec
	source   *prometheus.CounterVec
	limits   *prometheus.CounterVec
	outbound *prometheus.CounterVec
	pods     prometheus.Gauge
	policy   policyMetrics
}

// New returns the metrics on a fresh registry.
func New() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		opened: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_tcp_connections_opened_total",
			Help: "TCP connections accepted by a pod listener and proxied.",
		}, PeerLabels),
		closed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_tcp_connections_closed_total",
			Help: "Proxied TCP connections that ended.",
		}, PeerLabels),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_tcp_sent_bytes_total",
			Help: "Bytes sent to the source (the response direction, destination to source).",
		}, PeerLabels),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_tcp_received_bytes_total",
			Help: "Bytes received from the source (the request direction, source to destination).",
		}, PeerLabels),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "aether_tcp_connection_duration_seconds",
			Help:    "Lifetime of proxied TCP connections, accept to close.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, PeerLabels),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_tcp_connections_failed_total",
			Help: "Accepted TCP connections that could not be proxied, by reason.",
		}, []string{"reason"}),
		udp: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_udp_datagrams_total",
			Help: "Captured UDP datagrams by direction (outbound: to the original destination; reply: back to the source) and outcome.",
		}, []string{"direction", "outcome"}),
		inbound: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_inbound_deliveries_total",
			Help: "Inbound connections handed to the app, by how: uds (the pod's unix socket), tcp (the pod's address; no socket declared), uds_fallback (the socket was missing or refused: delivered over TCP instead), failed (no connection to the app).",
		}, []string{"via"}),
		source: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_inbound_source_total",
			Help: "Inbound TCP deliveries to the app by the source address it sees: preserved (the client's address, through the divert's deliver mark) or fallback (the pod's own address: the divert's deliver rule is missing, the families differ, or the source-preserving connect failed).",
		}, []string{"outcome"}),
		limits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_proxy_limit_hits_total",
			Help: "Limits the proxy enforced, by limit: pod_connections and node_connections (a TCP connection reset), pod_udp_flows and node_udp_flows (a UDP flow evicted or refused), tcp_idle (an idle TCP connection closed).",
		}, []string{"limit"}),
		outbound: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_outbound_connections_total",
			Help: "Captured TCP connections by path while HBONE is on: hbone (tunnelled over mTLS), hbone_failed (the tunnel could not be opened: the client was reset, never sent in plaintext), passthrough_not_hbone (destination not an HBONE workload in WDS: plain TCP), passthrough_no_identity (the source pod has no SPIFFE ID: plain TCP).",
		}, []string{"path"}),
		pods: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aether_proxy_pods_serving",
			Help: "Pods whose listeners are bound and served.",
		}),
	}
	m.policy = newPolicyMetrics()
	m.Registry.MustRegister(m.opened, m.closed, m.sent, m.received, m.duration, m.failed, m.udp, m.limits, m.inbound, m.source, m.outbound, m.pods,
		m.policy.denied, m.policy.dryRun,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func orUnknown(s string) string {
	if s == "" {
		return Unknown
	}
	return s
}

// Labels returns the label values of a plain (untunnelled) connection from
// src to dst: its principals are unknown.
func Labels(direction string, src, dst peers.Peer) []string {
	return TunnelLabels(direction, src, dst, "", "")
}

// TunnelLabels returns the label values of an HBONE connection from src to
// dst with the SPIFFE IDs of both ends: the one this proxy presented and the
// one it verified. Principals are identities, never per connection, so the
// cardinality stays that of the workloads.
func TunnelLabels(direction string, src, dst peers.Peer, srcPrincipal, dstPrincipal string) []string {
	return []string{
		direction,
		orUnknown(src.Workload), orUnknown(src.Namespace), orUnknown(src.CanonicalName),
		orUnknown(dst.Workload), orUnknown(dst.Namespace), orUnknown(dst.CanonicalName),
		orUnknown(srcPrincipal), orUnknown(dstPrincipal),
	}
}

// Conn is one proxied connection's telemetry. Received and Sent may be
// called from the connection's two copy goroutines concurrently.
type Conn struct {
	m        *Metrics
	labels   []string
	start    time.Time
	received prometheus.Counter
	sent     prometheus.Counter
}

// Open counts a new connection and returns its handle.
func (m *Metrics) Open(labels []string) *Conn {
	m.opened.WithLabelValues(labels...).Inc()
	return &Conn{
		m: m, labels: labels, start: time.Now(),
		received: m.received.WithLabelValues(labels...),
		sent:     m.sent.WithLabelValues(labels...),
	}
}

// Received adds n bytes received from the source.
func (c *Conn) Received(n int64) { c.received.Add(float64(n)) }

// Sent adds n bytes sent to the source.
func (c *Conn) Sent(n int64) { c.sent.Add(float64(n)) }

// Close counts the end of the connection and its duration.
func (c *Conn) Close() {
	c.m.closed.WithLabelValues(c.labels...).Inc()
	c.m.duration.WithLabelValues(c.labels...).Observe(time.Since(c.start).Seconds())
}

// Failed counts a connection that could not be proxied.
func (m *Metrics) Failed(reason string) { m.failed.WithLabelValues(reason).Inc() }

// Datagram counts a UDP datagram.
func (m *Metrics) Datagram(direction, outcome string) {
	m.udp.WithLabelValues(direction, outcome).Inc()
}

// Delivery values of aether_inbound_deliveries_total{via}.
const (
	ViaUDS         = "uds"
	ViaTCP         = "tcp"
	ViaUDSFallback = "uds_fallback"
	// ViaUDSRefused is a TCP delivery because the pod's UDS socket was
	// refused as unsafe (a link, not a socket, outside the pod's socket
	// dir, another owner).
	ViaUDSRefused = "uds_refused"
	ViaFailed     = "failed"
)

// Delivered counts one inbound delivery to the app.
func (m *Metrics) Delivered(via string) { m.inbound.WithLabelValues(via).Inc() }

// Values of aether_inbound_source_total{outcome}.
const (
	SourcePreserved = "preserved"
	SourceFallback  = "fallback"
)

// InboundSource counts one TCP delivery to the app by the source address
// it carries: SourcePreserved (the client's) or SourceFallback (the pod's).
func (m *Metrics) InboundSource(outcome string) { m.source.WithLabelValues(outcome).Inc() }

// Values of aether_proxy_limit_hits_total{limit}.
const (
	LimitPodConnections  = "pod_connections"
	LimitNodeConnections = "node_connections"
	LimitPodUDPFlows     = "pod_udp_flows"
	LimitNodeUDPFlows    = "node_udp_flows"
	LimitTCPIdle         = "tcp_idle"
)

// LimitHit counts one enforcement of limit.
func (m *Metrics) LimitHit(limit string) { m.limits.WithLabelValues(limit).Inc() }

// Outbound counts one captured TCP connection by the path it took: "hbone",
// "hbone_failed" (reset, never sent in plaintext), "passthrough_not_hbone"
// (the destination is not an HBONE workload in WDS) or
// "passthrough_no_identity" (the source pod has no SPIFFE ID). Only counted
// while HBONE is on.
func (m *Metrics) Outbound(path string) { m.outbound.WithLabelValues(path).Inc() }

// SetPodsServing sets the serving-pods gauge.
func (m *Metrics) SetPodsServing(n int) { m.pods.Set(float64(n)) }
