// Package telemetry holds aether-proxy's Prometheus metrics and its access
// log: Istio's TCP metrics (istio_tcp_*, labelled as Istio labels them, the
// workloads at both ends looked up in the WDS index), reported by the source
// side and by the destination side of every connection; one access-log line
// per connection (AccessLog); and the proxy's own aether_* series for what
// Istio has no series for (limits, capture, refusals by reason, outbound
// paths, inbound deliveries, HBONE).
package telemetry

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics are the proxy's collectors, registered on their own registry.
type Metrics struct {
	// Registry holds every collector below (and the Go and process
	// collectors).
	Registry *prometheus.Registry

	istio    *istioSeries
	duration *prometheus.HistogramVec
	failed   *prometheus.CounterVec
	udp      *prometheus.CounterVec
	inbound  *prometheus.CounterVec
	source   *prometheus.CounterVec
	limits   *prometheus.CounterVec
	outbound *prometheus.CounterVec
	pods     prometheus.Gauge
	log      *AccessLog
	policy   policyMetrics
	flows    *Flows
}

// New returns the metrics on a fresh registry, without an access log.
func New() *Metrics { return NewWithAccessLog(nil) }

// NewWithAccessLog returns the metrics on a fresh registry; every
// connection's end is also offered to log (nil: no access log).
func NewWithAccessLog(log *AccessLog) *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		log:      log,
		istio:    newIstioSeries(),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "aether_tcp_connection_duration_seconds",
			Help:    "Lifetime of proxied TCP connections, accept to close, by reporter (Istio has no TCP duration series).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"reporter"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_tcp_connections_failed_total",
			Help: "Accepted TCP connections that could not be proxied, by reason (Istio's series carry only response_flags).",
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
	if log != nil {
		m.Registry.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "aether_proxy_access_log_dropped_total",
			Help: "Access-log lines dropped because stdout did not drain (1 MiB held while a write was under way).",
		}, func() float64 { return float64(log.Dropped()) }))
	}
	// Known limits start at zero, so a limit that was never hit is a 0
	// on a dashboard, not "no data".
	for _, l := range []string{LimitPodConnections, LimitNodeConnections, LimitPodUDPFlows, LimitNodeUDPFlows, LimitTCPIdle} {
		m.limits.WithLabelValues(l)
	}
	m.policy = newPolicyMetrics()
	m.flows = newFlows(m.Registry)
	m.Registry.MustRegister(m.istio, m.duration, m.failed, m.udp, m.limits, m.inbound, m.source, m.outbound, m.pods,
		m.policy.denied, m.policy.dryRun,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Flows returns the hub of the connection events the flows socket
// streams.
func (m *Metrics) Flows() *Flows { return m.flows }

// FlushAccessLog writes the access log's held lines (AccessLog.Flush).
func (m *Metrics) FlushAccessLog() { m.log.Flush() }

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
