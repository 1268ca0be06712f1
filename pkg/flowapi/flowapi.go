// Package flowapi is the contract of aether-proxy's flows socket, the live
// stream of the node's connection events that `aetherctl flows` follows:
// the request, the messages and the client. The server is proxy/flowserver
// (its events come from proxy/telemetry's Flows hub), so a client links
// nothing of the proxy.
//
// The socket is a unix stream socket, mode 0600 in a directory no other
// user may write (pkg/unixsock), and the server checks each peer's uid
// (SO_PEERCRED) against its allow list (root only by default). On it:
//
//  1. the client writes one Request as a JSON line (every filter is
//     optional; together they must all match);
//  2. the server answers one Message line: TypeSubscribed (with its queue
//     bound), or TypeError with a Detail (peer uid not allowed, invalid
//     request, too many subscribers) and closes;
//  3. then it streams one Message per line (NDJSON): TypeOpened and
//     TypeClosed carry an Event, TypeDropped the number of events dropped
//     for this client since the previous notice, until either end closes.
//
// Events are filtered before they are queued, so what a filter leaves out
// costs the client no queue space. A client that reads more slowly than
// connections come loses events (counted, and reported in-band), never
// slows a connection.
package flowapi

import (
	"errors"
	"fmt"
	"strings"
)

// DefaultSocketDir is the directory of aether-proxy's flows socket: its
// own, neither the agent's (meshcontract.AgentSocketDir) nor the one the
// agent serves the proxy from (meshcontract.ProxySocketDir), and no pod's.
const DefaultSocketDir = "/run/aether/proxy-flows"

// DefaultSocket is aether-proxy's default -flows-socket, which aetherctl
// flows reads.
const DefaultSocket = DefaultSocketDir + "/flows.sock"

// MaxRequestBytes bounds the request line.
const MaxRequestBytes = 4096

// Values of Request.Reporter and Event.Reporter (Istio's reporter label).
const (
	// ReporterSource is the client pod's outbound side.
	ReporterSource = "source"
	// ReporterDestination is the server pod's inbound side.
	ReporterDestination = "destination"
)

// Request is the subscription a client asks for: the events matching every
// filter set.
type Request struct {
	// Pod is <namespace>/<name>: events with that pod at either end.
	Pod string `json:"pod,omitempty"`
	// Namespace: events with a workload of that namespace at either end.
	Namespace string `json:"namespace,omitempty"`
	// Denied: only the connections a policy refused (policy_decision deny,
	// or reason denied); an opened event never matches.
	Denied bool `json:"denied,omitempty"`
	// Service is a Service's hostname (dst_service) or its
	// <namespace>/<name>: events of connections through it.
	Service string `json:"service,omitempty"`
	// Reporter is ReporterSource or ReporterDestination: one side's events.
	Reporter string `json:"reporter,omitempty"`
}

// Validate checks the request's filters; its errors name the bad value.
func (r Request) Validate() error {
	if r.Pod != "" {
		if _, _, err := SplitPod(r.Pod); err != nil {
			return err
		}
	}
	if _, _, ok := splitRef(r.Service); !ok && strings.Contains(r.Service, "/") {
		return fmt.Errorf("invalid service %q: want a hostname or <namespace>/<name>", r.Service)
	}
	switch r.Reporter {
	case "", ReporterSource, ReporterDestination:
	default:
		return fmt.Errorf("invalid reporter %q: want %s or %s", r.Reporter, ReporterSource, ReporterDestination)
	}
	return nil
}

// SplitPod splits <namespace>/<name>.
func SplitPod(s string) (namespace, name string, err error) {
	ns, name, ok := splitRef(s)
	if !ok {
		return "", "", fmt.Errorf("invalid pod %q: want <namespace>/<name>", s)
	}
	return ns, name, nil
}

// splitRef splits <namespace>/<name>, both non-empty.
func splitRef(s string) (namespace, name string, ok bool) {
	ns, name, ok := strings.Cut(s, "/")
	return ns, name, ok && ns != "" && name != "" && !strings.Contains(name, "/")
}

// Message types.
const (
	// TypeSubscribed is the server's answer to a valid request: events
	// follow. Queue is the bound of the client's queue.
	TypeSubscribed = "subscribed"
	// TypeError refuses the request (Detail says why); the server closes.
	TypeError = "error"
	// TypeOpened is a connection that opened: an Event without end, bytes
	// or reason.
	TypeOpened = "opened"
	// TypeClosed is a connection that ended, or was refused: the full
	// Event.
	TypeClosed = "closed"
	// TypeDropped says Dropped events matching the request were left out
	// since the previous notice because the client's queue was full.
	TypeDropped = "dropped"
)

// Message is one line the server writes. Event's fields are inlined, so an
// event line is a flat object: {"type":"closed","reporter":"source",...}.
type Message struct {
	Type string `json:"type"`
	*Event
	// Dropped is the count of a TypeDropped notice.
	Dropped uint64 `json:"dropped,omitempty"`
	// Queue is the queue bound of a TypeSubscribed answer.
	Queue int `json:"queue,omitempty"`
	// Detail is why a TypeError refused the request.
	Detail string `json:"detail,omitempty"`
}

// Event is one connection as one side of the proxy reports it: exactly the
// fields of aether-proxy's access log, in its order (proxy/telemetry writes
// each access-log line from an Event: the two cannot differ). Empty strings
// and zeros where a value is not known; an opened event has no end time,
// bytes, reason or response flags.
type Event struct {
	// Reporter is ReporterSource or ReporterDestination.
	Reporter string `json:"reporter"`
	// StartTime and EndTime are RFC 3339 in UTC with nanoseconds; EndTime
	// is empty in an opened event.
	StartTime string `json:"start_time"`
	EndTime   string `json:"end_time"`
	// DurationMS is EndTime - StartTime in milliseconds (microsecond
	// precision).
	DurationMS float64 `json:"duration_ms"`
	// SrcAddr is the client's address; SrcWorkload, SrcPod and
	// SrcNamespace its workload in the WDS index; SrcPrincipal its SPIFFE
	// ID when mutual TLS proved it.
	SrcAddr      string `json:"src_addr"`
	SrcWorkload  string `json:"src_workload"`
	SrcPod       string `json:"src_pod"`
	SrcNamespace string `json:"src_namespace"`
	SrcPrincipal string `json:"src_principal"`
	// DstAddr is the original destination (the chosen endpoint of a
	// Service); the rest as for the source.
	DstAddr      string `json:"dst_addr"`
	DstWorkload  string `json:"dst_workload"`
	DstPod       string `json:"dst_pod"`
	DstNamespace string `json:"dst_namespace"`
	DstPrincipal string `json:"dst_principal"`
	// DstService is the hostname of the Service the connection went
	// through.
	DstService string `json:"dst_service"`
	// BytesToDst and BytesToSrc are the bytes proxied each way.
	BytesToDst int64 `json:"bytes_to_dst"`
	BytesToSrc int64 `json:"bytes_to_src"`
	// Path is hbone, plaintext, passthrough or uds; Security mutual_tls or
	// none.
	Path     string `json:"path"`
	Security string `json:"security"`
	// PolicyDecision is allow, deny or none; Policy the policy that
	// decided; PolicyReason the authorization's reason; PolicyDryRun a
	// dry-run policy that would have decided otherwise.
	PolicyDecision string `json:"policy_decision"`
	Policy         string `json:"policy"`
	PolicyReason   string `json:"policy_reason"`
	PolicyDryRun   string `json:"policy_dry_run"`
	// Reason is how the connection ended (client_closed, server_closed,
	// reset, connect_failed, no_endpoint, limit, denied, idle_timeout,
	// drain_deadline, pod_closed, misdirected); Limit the cap a limit
	// refusal hit; ResponseFlags Envoy's (-, CONNECT, DENY, UH, UO).
	Reason        string `json:"reason"`
	Limit         string `json:"limit"`
	ResponseFlags string `json:"response_flags"`
	// Error is the error the connection ended with; empty for a clean end.
	Error string `json:"error"`
}

// ErrNoSocket is Subscribe's error when nothing serves the socket.
var ErrNoSocket = errors.New("no flows socket")

// RefusedError is Subscribe's error when the server refused the request.
type RefusedError struct {
	// Detail is the server's reason.
	Detail string
}

func (e *RefusedError) Error() string { return "aether-proxy refused the subscription: " + e.Detail }
