// Package adminapi is the agent's read-only admin API on its admin unix
// socket (HTTP, mode 0600, peers checked with SO_PEERCRED): the types and
// the client aetherctl uses. The server side is agent/adminapi/handler, so
// a client links nothing else of the agent:
//
//	GET /v1/pods                   every stored record
//	GET /v1/pods/{namespace}/{name} the records of one pod (404 if none,
//	                                with NotFound naming its last DEL)
package adminapi

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"
)

// DefaultSocket is the agent's default admin socket.
const DefaultSocket = "/run/aether/agent/admin.sock"

// Pod is one stored record as the admin API returns it.
type Pod struct {
	Namespace      string   `json:"namespace"`
	Name           string   `json:"name"`
	ContainerID    string   `json:"container_id"`
	UID            string   `json:"uid,omitempty"`
	IPs            []string `json:"ips"`
	NetworkNS      string   `json:"network_namespace"`
	ServiceAccount string   `json:"service_account,omitempty"`
	// SPIFFEID is the pod's SPIFFE ID (spiffe://<td>/ns/<ns>/sa/<sa>) when
	// the agent issues identities (--ca-cert); empty otherwise.
	SPIFFEID string `json:"spiffe_id,omitempty"`
	// Owner is the pod's controlling owner reference as recorded,
	// "<kind>/<name>" (for example ReplicaSet/web-5d4b8c); empty for a bare pod.
	Owner           string            `json:"owner,omitempty"`
	Labels          map[string]string `json:"labels,omitempty"`
	Managed         bool              `json:"managed"`
	Terminating     bool              `json:"terminating"`
	Registered      bool              `json:"registered"`
	Healthy         bool              `json:"healthy"`
	Uncaptured      bool              `json:"uncaptured"`
	UncapturedError string            `json:"uncaptured_error,omitempty"`
	UDSPath         string            `json:"uds_path,omitempty"`
	UDSRefusal      string            `json:"uds_refusal,omitempty"`
	Volumes         []string          `json:"volumes,omitempty"`
	UDSCSIVolume    string            `json:"uds_csi_volume,omitempty"`
	UDSCSIVolumes   uint32            `json:"uds_csi_volumes,omitempty"`
	// DeclaredPortsKnown says the record carries the pod's declared
	// container ports (false: a record written before the agent kept
	// them); DeclaredTCPPorts are the TCP ones, what aether-proxy's
	// -hbone-declared-ports-only delivers HBONE to.
	DeclaredPortsKnown bool     `json:"declared_ports_known,omitempty"`
	DeclaredTCPPorts   []uint32 `json:"declared_tcp_ports,omitempty"`
	// InboundPolicy is what the pod's proxy does with plaintext inbound
	// connections: permissive or strict (the pod's aether.io/inbound-policy
	// annotation, else the agent's --inbound-policy); empty from an agent
	// that predates it. InboundPolicyInvalid: the annotation is invalid
	// and the pod is served strict.
	InboundPolicy        string    `json:"inbound_policy,omitempty"`
	InboundPolicyInvalid bool      `json:"inbound_policy_invalid,omitempty"`
	AddedAt              time.Time `json:"added_at"`
	// EnrolledVia says which label made the pod mesh-managed:
	// "pod_label" (aether.io/managed: "true" on the pod),
	// "namespace_label" (on its namespace) or "namespace_ambient"
	// (istio.io/dataplane-mode: ambient on its namespace, with the agent's
	// --ambient-namespaces); empty from an agent that predates it. The pod
	// was enrolled at its CNI ADD, at AddedAt.
	EnrolledVia string `json:"enrolled_via,omitempty"`
	// LastTimings are the plugin's timings of the last ADD (AddPod's,
	// completed by ReportAddResult).
	LastTimings map[string]string `json:"last_timings,omitempty"`
	// LastDel is the pod's last DEL the agent kept (an earlier sandbox of
	// the same pod), if any.
	LastDel *Removal `json:"last_del,omitempty"`
}

// Removal is the last CNI DEL of a pod: the agent keeps it in memory for
// an hour (lost on restart), one per pod.
type Removal struct {
	ContainerID string    `json:"container_id"`
	At          time.Time `json:"at"`
	// Timings are the plugin's timings of that DEL (started, pre_call);
	// empty from a plugin that predates them.
	Timings map[string]string `json:"timings,omitempty"`
}

// NotFound is the body of a 404 answer for one pod: the agent holds no
// record of it, but may still know its last DEL.
type NotFound struct {
	Error   string   `json:"error"`
	LastDel *Removal `json:"last_del,omitempty"`
}

// NotFoundError is Pod's error when the agent has no record of the pod;
// it matches ErrNotFound (errors.Is).
type NotFoundError struct {
	// LastDel is the pod's last DEL, when the agent still knows it.
	LastDel *Removal
}

func (e *NotFoundError) Error() string { return ErrNotFound.Error() }

// Is makes errors.Is(err, ErrNotFound) hold.
func (e *NotFoundError) Is(target error) bool { return target == ErrNotFound }

// Client talks to the admin socket.
type Client struct {
	hc *http.Client
}

// NewClient returns a client of the admin socket at path.
func NewClient(path string) *Client {
	return &Client{hc: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		},
	}}}
}

// ErrNotFound is returned by Pod when the agent has no record of the pod.
var ErrNotFound = fmt.Errorf("no record")

// Pods lists every record.
func (c *Client) Pods(ctx context.Context) ([]Pod, error) {
	return c.get(ctx, "/v1/pods")
}

// Pod returns the records of namespace/name.
func (c *Client) Pod(ctx context.Context, namespace, name string) ([]Pod, error) {
	return c.get(ctx, "/v1/pods/"+url.PathEscape(namespace)+"/"+url.PathEscape(name))
}

func (c *Client) get(ctx context.Context, path string) ([]Pod, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://agent"+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("failed to query agent admin socket: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		// An agent that predates NotFound answers plain text: no LastDel.
		var nf NotFound
		_ = json.NewDecoder(io.LimitReader(resp.Body, 1<<16)).Decode(&nf)
		return nil, &NotFoundError{LastDel: nf.LastDel}
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("failed to query agent %s: %s: %s", path, resp.Status, b)
	}
	var out []Pod
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, fmt.Errorf("failed to decode agent answer to %s: %w", path, err)
	}
	return out, nil
}
