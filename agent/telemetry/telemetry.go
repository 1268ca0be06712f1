// Package telemetry holds the agent's Prometheus metrics and its
// OpenTelemetry tracer setup.
package telemetry

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"aether.io/node/agent/services"
	"aether.io/node/agent/uds"
)

// Operation label values of aether.cni.operations.
const (
	OpAddPod         = "add_pod"
	OpRemovePod      = "remove_pod"
	OpReadinessProbe = "readiness_probe"
	OpCaptureDivert  = "capture_divert"
)

// Values of the socket label of PeerRejected.
const (
	SocketCNI         = "cni"
	SocketAdmin       = "admin"
	SocketWorkloadAPI = "workload_api"
)

// Result label values.
const (
	ResultSuccess = "success"
	ResultError   = "error"
	ResultIgnored = "ignored"
	// ResultUnknown counts a ReportAddResult for a container the agent has
	// no record of.
	ResultUnknown = "unknown_container"
)

// Metrics are the agent's metrics. aether.cni.operations is exported to
// Prometheus as aether_cni_operations_total.
type Metrics struct {
	// Registry holds every metric below; /metrics serves it.
	Registry *prometheus.Registry
	// Operations is aether.cni.operations{operation,result}.
	Operations *prometheus.CounterVec
	// Quarantined counts corrupt records moved aside on start.
	Quarantined prometheus.Counter
	// PeerRejected counts connections refused by the SO_PEERCRED uid check,
	// by socket (SocketCNI, SocketAdmin, SocketWorkloadAPI).
	PeerRejected *prometheus.CounterVec
	// WorkloadAPITokenRejected counts Workload API calls of an allowed uid
	// refused for their token, by reason (missing, invalid).
	WorkloadAPITokenRejected *prometheus.CounterVec
	// UDSRefusals counts refused UDS socket requests by reason.
	UDSRefusals *prometheus.CounterVec
	// PodLookupRetry counts pod-source lookups retried on a miss.
	PodLookupRetry prometheus.Counter
	// Pods gauges the stored records by state.
	Pods *prometheus.GaugeVec
	// PendingDeregistrations gauges the failed deregistrations waiting
	// for a retry.
	PendingDeregistrations prometheus.Gauge
	// RegistryGhostsDeleted counts this node's registry keys the ghost
	// sweep deleted because no live record owned them.
	RegistryGhostsDeleted prometheus.Counter
	// RegistryReregistered counts live records registered again because
	// their key was missing from the registry.
	RegistryReregistered prometheus.Counter
	// SVIDs gauges the X.509-SVIDs the embedded SPIFFE provider holds (one
	// per namespace/service account of the node's managed pods).
	SVIDs prometheus.Gauge
	// SVIDRotations counts SVIDs replaced at half of their lifetime.
	SVIDRotations prometheus.Counter
	// SVIDMintFailures counts SVIDs that could not be minted or rotated.
	SVIDMintFailures prometheus.Counter
	// CAReloads counts CA or trust bundle changes applied from the files.
	CAReloads prometheus.Counter
	// CAReloadFailures counts changed CA files that did not validate.
	CAReloadFailures prometheus.Counter
	// InboundPolicyInvalid counts pod listener builds whose inbound policy
	// annotation was invalid (the pod is served strict).
	InboundPolicyInvalid prometheus.Counter
	// ServiceUnresolvedTargetPorts counts endpoint ports the Service model
	// does not serve because their EndpointSlice resolves the Service
	// port's named targetPort to no port, by reason
	// (services.UnresolvedReasons).
	ServiceUnresolvedTargetPorts *prometheus.CounterVec
	// ServiceRecomputes counts the Service model's recomputes of a Service.
	ServiceRecomputes prometheus.Counter
	// ServiceUpdates counts the Service and EndpointSlice events the
	// informers delivered to the Service model.
	ServiceUpdates prometheus.Counter
	// CNIAddDuration observes each CNI ADD's phases as aether-cni reports
	// them (ReportAddResult's PluginTimings), by phase (CNIPhases).
	CNIAddDuration *prometheus.HistogramVec
}

// CNIPhases are the phase label values of aether_cni_add_duration_seconds:
// the PluginTimings fields that are durations.
var CNIPhases = []string{"total", "pre_call", "readiness_probe", "capture_divert"}

// NewMetrics registers every metric (with zero values for known labels) on
// a fresh registry, plus the Go and process collectors.
func NewMetrics() *Metrics {
	m := &Metrics{
		Registry: prometheus.NewRegistry(),
		Operations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_cni_operations_total",
			Help: "aether.cni.operations: CNI operations seen by the agent, by operation (add_pod, remove_pod, readiness_probe, capture_divert) and result.",
		}, []string{"operation", "result"}),
		Quarantined: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_store_quarantined_records_total",
			Help: "Corrupt pod records moved to quarantine on start.",
		}),
		PeerRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_agent_peer_rejected_total",
			Help: "Connections to an agent unix socket (cni, admin, workload_api) refused because the peer uid is not allowed.",
		}, []string{"socket"}),
		WorkloadAPITokenRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_agent_workload_api_token_rejected_total",
			Help: "Workload API calls refused because they lack the token aether-proxy reads from the token file (missing) or carry another one (invalid).",
		}, []string{"reason"}),
		UDSRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_agent_uds_refusals_total",
			Help: "UDS socket requests refused, by reason.",
		}, []string{"reason"}),
		PodLookupRetry: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_pod_lookup_retries_total",
			Help: "Pod source lookups retried because the pod was not found yet.",
		}),
		Pods: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "aether_agent_pods",
			Help: "Stored pod records by state (stored, registered, terminating, uncaptured).",
		}, []string{"state"}),
		PendingDeregistrations: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aether_agent_registry_pending_deregistrations",
			Help: "Failed endpoint deregistrations waiting for a retry (with backoff).",
		}),
		RegistryGhostsDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_registry_ghosts_deleted_total",
			Help: "This node's registry keys deleted by the liveness loop's ghost sweep because no live record owned them.",
		}),
		RegistryReregistered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_registry_reregistered_total",
			Help: "Live records registered again by the liveness loop because their key was missing from the registry.",
		}),
		SVIDs: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aether_agent_identity_svids",
			Help: "X.509-SVIDs held by the embedded SPIFFE provider (one per namespace/service account of this node's managed pods).",
		}),
		SVIDRotations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_identity_svid_rotations_total",
			Help: "X.509-SVIDs replaced at half of their lifetime.",
		}),
		SVIDMintFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_identity_svid_mint_failures_total",
			Help: "X.509-SVIDs that could not be minted or rotated (retried with backoff).",
		}),
		CAReloads: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_identity_ca_reloads_total",
			Help: "Changes of the signing CA or the trust bundle applied from --ca-cert, --ca-key and --ca-trust-bundle without a restart.",
		}),
		CAReloadFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_identity_ca_reload_failures_total",
			Help: "Changed CA files that did not validate (the CA in use is kept).",
		}),
		InboundPolicyInvalid: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_inbound_policy_invalid_total",
			Help: "Pod listener builds whose aether.io/inbound-policy annotation is neither permissive nor strict: the pod is served strict.",
		}),
		ServiceUnresolvedTargetPorts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_agent_service_unresolved_target_ports_total",
			Help: "Endpoint ports not served because the endpoint's EndpointSlice resolves the Service port's named targetPort to no port, counted once per endpoint and Service port when it becomes so (the Service, port and an example pod are in the agent's log line): not_declared (no port of that name: the pod declares no such container port), invalid (a number outside 1-65535). The only label is that reason: a per-Service label would grow with the cluster.",
		}, []string{"reason"}),
		ServiceRecomputes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_service_recomputes_total",
			Help: "Recomputes of one Service by the Service model: one per Service per batch of Service and EndpointSlice updates (updates arriving while a batch is applied are merged into the next).",
		}),
		ServiceUpdates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "aether_agent_service_updates_total",
			Help: "Service and EndpointSlice events (added, updated, deleted) the informers delivered to the Service model; against aether_agent_service_recomputes_total, how much a storm was merged.",
		}),
		CNIAddDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "aether_cni_add_duration_seconds",
			Help:    "CNI ADDs of mesh-managed pods as aether-cni timed them (ReportAddResult), by phase: total (the plugin's start to its report), pre_call (netconf, PID lookup, netns pin), readiness_probe (the proxy's capture listener in the pod netns), capture_divert (nftables and policy routing).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
		}, []string{"phase"}),
	}
	m.Registry.MustRegister(m.Operations, m.Quarantined, m.PeerRejected, m.WorkloadAPITokenRejected, m.UDSRefusals, m.PodLookupRetry, m.Pods,
		m.PendingDeregistrations, m.RegistryGhostsDeleted, m.RegistryReregistered,
		m.SVIDs, m.SVIDRotations, m.SVIDMintFailures, m.CAReloads, m.CAReloadFailures, m.InboundPolicyInvalid, m.CNIAddDuration,
		m.ServiceUnresolvedTargetPorts, m.ServiceRecomputes, m.ServiceUpdates,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, op := range []string{OpAddPod, OpRemovePod, OpReadinessProbe, OpCaptureDivert} {
		for _, r := range []string{ResultSuccess, ResultError} {
			m.Operations.WithLabelValues(op, r)
		}
	}
	m.Operations.WithLabelValues(OpAddPod, ResultIgnored)
	for _, p := range CNIPhases {
		m.CNIAddDuration.WithLabelValues(p)
	}
	for _, s := range []string{SocketCNI, SocketAdmin, SocketWorkloadAPI} {
		m.PeerRejected.WithLabelValues(s)
	}
	for _, r := range []string{"missing", "invalid"} {
		m.WorkloadAPITokenRejected.WithLabelValues(r)
	}
	for _, r := range uds.Reasons {
		m.UDSRefusals.WithLabelValues(r)
	}
	for _, r := range services.UnresolvedReasons {
		m.ServiceUnresolvedTargetPorts.WithLabelValues(r)
	}
	return m
}

// Services returns the Service model's counters (services.New).
func (m *Metrics) Services() services.Metrics {
	return services.Metrics{UnresolvedTargetPorts: m.ServiceUnresolvedTargetPorts, Recomputes: m.ServiceRecomputes, Updates: m.ServiceUpdates}
}
