// Package registry defines the endpoint registry the agent registers
// mesh-managed pods in, and that workload discovery (xDS) follows.
//
// Three backends implement Registry: an embedded single-node one (the
// binary's default), one that adds every other node's pods from the
// Kubernetes API (registry/kube, the chart's default) and one on etcd that
// spans nodes. Invariants shared by all and by their callers:
//   - a terminating pod is never (re-)registered: callers write in the order
//     lock → check → write → re-check — the writes of one key are ordered by
//     a per-key lock, terminating is checked under the same lock that marks
//     pods terminating, the registry call runs without that lock (a slow
//     backend must not block the caller's other work), and a pod that turned
//     terminating while its Register was in flight is deregistered again;
//   - a pod that turns terminating or is removed is withdrawn at once
//     (Withdraw, under the lock that marks it), before its Deregister, so
//     that a lease re-grant or a retry of a Register in flight cannot put it
//     back while the Deregister waits for the key's write lock;
//   - backends delete a deregistered endpoint at once, and callers retry a
//     failed Deregister until it succeeds and delete their node's keys that
//     no live record owns (agent/pods: the retry set and the ghost sweep);
//   - backends never hold their own lock across a network call.
package registry

import (
	"context"
	"net/netip"
)

// Endpoint is one mesh-managed pod as the registry holds it: everything
// workload discovery needs to build an istio.workload.Workload without
// another lookup.
type Endpoint struct {
	// Key identifies the endpoint: the pod's sandbox (container) ID.
	Key string `json:"key"`
	// Node is the name of the node the pod runs on.
	Node string `json:"node"`
	// Namespace, Name and UID identify the Kubernetes pod.
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
	// IPs are the pod's addresses (IPv4 and IPv6).
	IPs []netip.Addr `json:"ips"`
	// ServiceAccount is spec.serviceAccountName.
	ServiceAccount string `json:"service_account,omitempty"`
	// Labels are the pod's labels (canonical name/revision come from them).
	Labels map[string]string `json:"labels,omitempty"`
	// Owner is the pod's controlling owner reference, if any (for example
	// ReplicaSet/web-7d9f8c6b5 or Job/backup-28861440).
	Owner *Owner `json:"owner,omitempty"`
	// HostNetwork is true for host-network pods.
	HostNetwork bool `json:"host_network,omitempty"`
	// FixedName is true when the pod's name was not generated
	// (metadata.generateName empty): istiod then names the workload after
	// the pod, whatever Owner says. False from agents that predate the
	// field, which is what every controller-created pod has.
	FixedName bool `json:"fixed_name,omitempty"`
	// Healthy is the liveness verdict; an endpoint starts healthy when it is
	// registered by a successful AddPod and is marked unhealthy by liveness.
	Healthy bool `json:"healthy"`
	// Locality is the node's topology (region, zone, subzone labels).
	Locality Locality `json:"locality"`
}

// Owner is a controlling owner reference.
type Owner struct {
	// Kind is the owner's kind, for example ReplicaSet, Job, StatefulSet.
	Kind string `json:"kind"`
	// Name is the owner's name.
	Name string `json:"name"`
}

// Locality is where a node is, from its topology labels.
type Locality struct {
	Region  string `json:"region,omitempty"`
	Zone    string `json:"zone,omitempty"`
	Subzone string `json:"subzone,omitempty"`
}

// EventType says what happened to an endpoint.
type EventType int

const (
	// EventPut means the endpoint was registered or changed.
	EventPut EventType = iota
	// EventDelete means the endpoint was deregistered (or its node's lease
	// expired).
	EventDelete
)

// Event is one change of the registry's view.
type Event struct {
	// Type is Put or Delete.
	Type EventType
	// Key is the endpoint key.
	Key string
	// Endpoint is the new value for Put; for Delete it may be empty.
	Endpoint Endpoint
}

// Registry stores endpoints and tells followers what changed.
type Registry interface {
	// Register creates or replaces ep. It is idempotent.
	Register(ctx context.Context, ep Endpoint) error
	// Deregister removes the endpoint with key. An unknown key is not an
	// error.
	Deregister(ctx context.Context, key string) error
	// Withdraw tells the backend that key must not be written again on its
	// behalf: nothing it writes on its own (a shared backend's lease
	// re-grant) puts the key back, and a Register of the key in flight
	// makes no further attempt. It does no I/O and never blocks on the
	// network, so callers call it under the lock that marks a pod
	// terminating or removed; Deregister still deletes the key. A later
	// Register of the key (a live pod again) is not affected.
	Withdraw(key string)
	// List returns every endpoint the registry knows (for shared backends,
	// every node's).
	List(ctx context.Context) ([]Endpoint, error)
	// Watch sends the current content as Put events, then every change,
	// until ctx ends; then it closes the channel. A backend that loses its
	// connection resumes where it left off and never drops a change.
	Watch(ctx context.Context) (<-chan Event, error)
}
