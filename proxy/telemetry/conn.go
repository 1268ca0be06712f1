package telemetry

import (
	"net/netip"
	"sync/atomic"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy/peers"
)

// Unknown is the label value Istio writes for what is not known (an end not
// in the WDS index, a principal not verified, no Service).
const Unknown = "unknown"

// IstioLabels are the labels of every istio_tcp_* series, in order: Istio's
// standard label set for TCP as ztunnel reports it (without its optional
// locality labels).
var IstioLabels = [...]string{
	"reporter",
	"source_workload", "source_canonical_service", "source_canonical_revision", "source_workload_namespace",
	"source_principal", "source_app", "source_version", "source_cluster",
	"destination_service", "destination_service_namespace", "destination_service_name",
	"destination_workload", "destination_canonical_service", "destination_canonical_revision", "destination_workload_namespace",
	"destination_principal", "destination_app", "destination_version", "destination_cluster",
	"request_protocol", "response_flags", "connection_security_policy",
}

// Values of the reporter label.
const (
	// ReporterSource is the client pod's outbound side (the capture
	// listener).
	ReporterSource = flowapi.ReporterSource
	// ReporterDestination is the server pod's inbound side (an HBONE
	// stream delivered to the app, plaintext on the inbound listener).
	ReporterDestination = flowapi.ReporterDestination
)

// Values of connection_security_policy.
const (
	// SecurityMutualTLS: the connection crossed the network in HBONE
	// (mutual TLS, both SPIFFE IDs verified).
	SecurityMutualTLS = "mutual_tls"
	// SecurityNone: plaintext TCP.
	SecurityNone = "none"
)

// Values of response_flags (Envoy's and ztunnel's).
const (
	// FlagNone is a connection that was proxied.
	FlagNone = "-"
	// FlagConnect is a connection whose upstream could not be reached
	// (ztunnel's ConnectionFailure).
	FlagConnect = "CONNECT"
	// FlagDeny is a connection a policy refused (ztunnel's
	// AuthorizationPolicyDenied).
	FlagDeny = "DENY"
	// FlagNoHealthyUpstream is a connection to a Service without a usable
	// endpoint (Envoy's UH).
	FlagNoHealthyUpstream = "UH"
	// FlagOverflow is a connection refused at a connection cap (Envoy's
	// UO, upstream overflow).
	FlagOverflow = "UO"
)

// Paths a connection took (the access log's path).
const (
	// PathHBONE: over mutual TLS in an HBONE tunnel.
	PathHBONE = "hbone"
	// PathPlaintext: plain TCP to a destination the proxy knows (a mesh
	// workload or a Service endpoint it chose).
	PathPlaintext = "plaintext"
	// PathPassthrough: plain TCP to the original destination as dialled,
	// which is no workload the proxy knows.
	PathPassthrough = "passthrough"
	// PathUDS: delivered to the destination pod's unix socket.
	PathUDS = "uds"
)

// CloseReason says how a connection ended (the access log's reason).
type CloseReason uint8

// Close reasons (End collects them). The zero value is none yet.
const (
	reasonNone CloseReason = iota
	// ReasonClientClosed: the source end finished first (FIN), then the
	// other way ended too.
	ReasonClientClosed
	// ReasonServerClosed: the destination end finished first.
	ReasonServerClosed
	// ReasonReset: an error or a reset on either side.
	ReasonReset
	// ReasonConnectFailed: the upstream (the app, the HBONE peer, a
	// Service endpoint) refused or could not be reached.
	ReasonConnectFailed
	// ReasonNoEndpoint: a Service without a usable endpoint.
	ReasonNoEndpoint
	// ReasonLimit: refused at a connection cap (the access log's limit
	// says which).
	ReasonLimit
	// ReasonDenied: refused by a policy (the access log's policy says
	// which).
	ReasonDenied
	// ReasonIdleTimeout: closed by -tcp-idle-timeout.
	ReasonIdleTimeout
	// ReasonDrainDeadline: still open when its pod's drain (removal,
	// SIGTERM) ran out of time.
	ReasonDrainDeadline
	// ReasonPodClosed: its pod closed at once (netns gone, proxy stopped).
	ReasonPodClosed
	// ReasonMisdirected: not for a workload (a loop to the proxy's own
	// port, an inbound destination that is not the pod's): reset.
	ReasonMisdirected
)

var reasonNames = [...]string{
	reasonNone: "closed", ReasonClientClosed: "client_closed", ReasonServerClosed: "server_closed",
	ReasonReset: "reset", ReasonConnectFailed: "connect_failed", ReasonNoEndpoint: "no_endpoint",
	ReasonLimit: "limit", ReasonDenied: "denied", ReasonIdleTimeout: "idle_timeout",
	ReasonDrainDeadline: "drain_deadline", ReasonPodClosed: "pod_closed", ReasonMisdirected: "misdirected",
}

// String returns the reason as the access log writes it.
func (r CloseReason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unknown"
}

// Clean reports a connection that ended normally (either end closed it);
// the others are what -access-log=errors writes.
func (r CloseReason) Clean() bool { return r == ReasonClientClosed || r == ReasonServerClosed }

// Flag is the response_flags value a connection ending so is closed with.
func (r CloseReason) Flag() string {
	switch r {
	case ReasonConnectFailed:
		return FlagConnect
	case ReasonNoEndpoint:
		return FlagNoHealthyUpstream
	case ReasonLimit:
		return FlagOverflow
	case ReasonDenied:
		return FlagDeny
	}
	return FlagNone
}

// End collects how a connection ended, from the goroutines that see it: the
// first forced reason (an error, an idle timeout, a drain, the pod closing:
// Force) wins over the first clean end (the end whose EOF came first:
// Finished), so a reset after a half-close is a reset, and the reset an idle
// timeout causes is an idle timeout. Safe for concurrent use.
type End struct{ forced, first atomic.Uint32 }

// Force records r unless a forced reason is recorded already.
func (e *End) Force(r CloseReason) { e.forced.CompareAndSwap(0, uint32(r)) }

// Finished records the clean end r (ReasonClientClosed or
// ReasonServerClosed) unless one is recorded already.
func (e *End) Finished(r CloseReason) { e.first.CompareAndSwap(0, uint32(r)) }

// Reason returns the forced reason, else the first clean end, else def.
func (e *End) Reason(def CloseReason) CloseReason {
	if r := CloseReason(e.forced.Load()); r != reasonNone {
		return r
	}
	if r := CloseReason(e.first.Load()); r != reasonNone {
		return r
	}
	return def
}

// ConnInfo describes one connection as one side reports it.
type ConnInfo struct {
	// Reporter is ReporterSource or ReporterDestination.
	Reporter string
	// Src is the client's address; Dst the original destination (the
	// HBONE target, never :15008; the chosen endpoint of a Service).
	Src, Dst netip.AddrPort
	// Source and Destination are the WDS workloads at both ends (zero:
	// unknown).
	Source, Destination peers.Peer
	// SourcePrincipal is the source's SPIFFE ID when mutual TLS proves it
	// (the one this proxy presented, or the one it verified); "" for
	// plaintext. The destination's principal is the verified server SVID
	// (DestinationPrincipal) or, as ztunnel reports it, the destination
	// workload's identity in WDS.
	SourcePrincipal, DestinationPrincipal string
	// Service is the Service the connection was balanced through or, at
	// the destination, the one its workload serves the port for
	// (peers.Services.ServiceOf); zero: none.
	Service peers.ServiceRef
	// MTLS reports HBONE (connection_security_policy mutual_tls).
	MTLS bool
	// Path is one of the Path* values.
	Path string
	// PolicyDecision is the authorization decision at the destination:
	// PolicyAllow (an ALLOW policy matched), PolicyDeny, or "" for
	// PolicyNone (no policy decided; a ReasonDenied refusal without one is
	// PolicyDeny).
	PolicyDecision string
	// Policy names the policy that decided (an AuthorizationPolicy's key,
	// or a built-in rule: PolicyInboundStrict, PolicyDeclaredPortsOnly);
	// "" when none did.
	Policy string
	// PolicyReason is the authorization's reason (proxy/authz: ALLOW or
	// DENY matched, no ALLOW matched, no policy); "" without one.
	PolicyReason string
	// PolicyDryRun names a dry-run policy that would have changed the
	// decision (never enforced); "" when none.
	PolicyDryRun string
	// Limit names the cap a ReasonLimit refusal hit.
	Limit string
}

// key returns the istio_tcp_* label values of the connection, closed with
// flags.
func (i *ConnInfo) key(flags string) labelKey {
	security := SecurityNone
	if i.MTLS {
		security = SecurityMutualTLS
	}
	src, dst := &i.Source, &i.Destination
	dstPrincipal := i.DestinationPrincipal
	if dstPrincipal == "" {
		dstPrincipal = dst.Identity
	}
	return labelKey{
		i.Reporter,
		orUnknown(src.Workload), orUnknown(src.CanonicalName), orUnknown(src.CanonicalRevision), orUnknown(src.Namespace),
		orUnknown(i.SourcePrincipal), orUnknown(src.CanonicalName), orUnknown(src.CanonicalRevision), orUnknown(src.Cluster),
		orUnknown(i.Service.Hostname), orUnknown(i.Service.Namespace), orUnknown(i.Service.Name),
		orUnknown(dst.Workload), orUnknown(dst.CanonicalName), orUnknown(dst.CanonicalRevision), orUnknown(dst.Namespace),
		orUnknown(dstPrincipal), orUnknown(dst.CanonicalName), orUnknown(dst.CanonicalRevision), orUnknown(dst.Cluster),
		"tcp", flags, security,
	}
}

func orUnknown(s string) string {
	if s == "" {
		return Unknown
	}
	return s
}

// Conn is one proxied connection's telemetry: its istio_tcp_* counters, its
// access-log line and its flow events. Received and Sent may be called from the
// connection's two copy goroutines concurrently; Close once, at the end.
type Conn struct {
	m      *Metrics
	info   ConnInfo
	start  time.Time
	series *seriesEntry // the counters of the connection's label set
	// rx and tx are the connection's own byte counts (the access log's).
	rx, tx atomic.Int64
	// logged: the access log keeps this connection's lines (sampled at
	// Open).
	logged bool
	// denial is set when a policy refused the connection after it opened
	// (Deny).
	denial atomic.Pointer[denial]
}

// denial is the policy that refused an established connection.
type denial struct{ policy, reason string }

// Deny records that policy (with its reason) now refuses the established
// connection: its close, which the caller then causes, is reported with
// policy_decision deny and that policy (the caller's End gives
// ReasonDenied).
func (c *Conn) Deny(policy, reason string) { c.denial.Store(&denial{policy: policy, reason: reason}) }

// Open counts a new connection and returns its handle.
func (m *Metrics) Open(info ConnInfo) *Conn { return m.open(info, true) }

// open is Open; announce publishes the open to the flows (a refusal only
// publishes its close).
func (m *Metrics) open(info ConnInfo, announce bool) *Conn {
	k := info.key(FlagNone)
	e := m.istio.entry(&k, famOpened|famSent|famReceived)
	e.opened.Add(1)
	c := &Conn{m: m, info: info, start: time.Now(), series: e, logged: m.log.sample()}
	if c.logged {
		m.log.opened(&c.info, c.start)
	}
	if announce && m.flows.active() {
		m.flows.publish(&c.info, c.start, time.Time{}, 0, 0, reasonNone, nil)
	}
	return c
}

// Received adds n bytes received from the source (towards the
// destination).
func (c *Conn) Received(n int64) {
	c.rx.Add(n)
	c.series.received.Add(uint64(n))
}

// Sent adds n bytes sent to the source (from the destination).
func (c *Conn) Sent(n int64) {
	c.tx.Add(n)
	c.series.sent.Add(uint64(n))
}

// Close counts the end of the connection (closed with reason's
// response_flags) and its duration, and offers it to the access log and
// the flows, with err (nil for a clean end) as its error.
func (c *Conn) Close(reason CloseReason, err error) {
	e := c.series
	if f := reason.Flag(); f != FlagNone {
		k := c.info.key(f)
		e = c.m.istio.entry(&k, famClosed)
	} else if e.families.Load()&famClosed == 0 {
		e.families.Or(famClosed)
	}
	e.closed.Add(1)
	end := time.Now()
	c.m.duration.WithLabelValues(c.info.Reporter).Observe(end.Sub(c.start).Seconds())
	flowing := c.m.flows.active()
	if !c.logged && !flowing {
		return
	}
	info := &c.info
	if d := c.denial.Load(); d != nil {
		denied := c.info
		denied.PolicyDecision, denied.Policy, denied.PolicyReason = PolicyDeny, d.policy, d.reason
		info = &denied
	}
	rx, tx := c.rx.Load(), c.tx.Load()
	if c.logged {
		c.m.log.write(info, c.start, end, rx, tx, reason, err)
	}
	if flowing {
		c.m.flows.publish(info, c.start, end, rx, tx, reason, err)
	}
}

// Refused counts a connection that ended before any byte was proxied (a
// cap, a policy, an upstream that could not be reached): opened and closed
// at once with reason's response_flags, and offered to the access log and
// (its close only) to the flows.
func (m *Metrics) Refused(info ConnInfo, reason CloseReason, err error) {
	m.open(info, false).Close(reason, err)
}

// Misdirected offers a connection that was reset because it was for no
// workload (ReasonMisdirected) to the access log and the flows only: it is
// in no istio_tcp_* series (ztunnel logs such connections without
// metrics).
func (m *Metrics) Misdirected(info ConnInfo, err error) {
	logged, flowing := m.log.sample(), m.flows.active()
	if !logged && !flowing {
		return
	}
	now := time.Now()
	if logged {
		m.log.write(&info, now, now, 0, 0, ReasonMisdirected, err)
	}
	if flowing {
		m.flows.publish(&info, now, now, 0, 0, ReasonMisdirected, err)
	}
}
