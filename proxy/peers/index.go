// Package peers is aether-proxy's WDS index: the istio.workload.Workload
// resources the agent serves, keyed by their raw 4- or 16-byte addresses, so
// each proxied connection can be labelled with the workloads at both ends,
// and its Service table (Services): istio.workload.Service VIPs and the
// endpoint workloads naming them, so a captured connection to a VIP goes to
// a chosen endpoint.
package peers

import (
	"net/netip"
	"sync"

	"aether.io/node/api/istio/workload"
	"aether.io/node/pkg/meshcontract"
)

// Peer is the metadata a connection end is labelled with. The zero value
// means "unknown".
type Peer struct {
	// UID is the workload uid (the resource name).
	UID string
	// Workload is the workload name (workload_name, else the pod name).
	Workload string
	// Namespace is the workload's namespace.
	Namespace string
	// Name is the workload's own name (the pod name).
	Name string
	// CanonicalName is the canonical service name
	// (service.istio.io/canonical-name, else app.kubernetes.io/name, app,
	// the workload name: the agent's builder).
	CanonicalName string
	// CanonicalRevision is the canonical revision
	// (service.istio.io/canonical-revision, else
	// app.kubernetes.io/version, version, "latest").
	CanonicalRevision string
	// Cluster is the workload's cluster_id.
	Cluster string
	// HBONE reports tunnel_protocol: HBONE: the workload's proxy serves
	// HBONE on its :15008.
	HBONE bool
	// Identity is the workload's SPIFFE ID,
	// spiffe://<trust_domain>/ns/<namespace>/sa/<service_account> (the
	// service account defaults to "default"); "" when the record names no
	// trust domain.
	Identity string
	// Policies are the keys of the selector-scoped authorization policies
	// the workload is bound to (authorization_policies); shared, read-only.
	Policies []string
}

// Index maps raw address bytes to workloads. It is safe for concurrent use;
// lookups take a read lock only.
type Index struct {
	mu     sync.RWMutex
	byAddr map[string]Peer     // string(raw 4 or 16 bytes) -> peer
	byUID  map[string][][]byte // uid -> the addresses it was indexed under
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{byAddr: map[string]Peer{}, byUID: map[string][][]byte{}}
}

func peerOf(w *workload.Workload) Peer {
	name := w.GetWorkloadName()
	if name == "" {
		name = w.GetName()
	}
	p := Peer{
		UID: w.GetUid(), Workload: name, Name: w.GetName(), Namespace: w.GetNamespace(),
		CanonicalName: w.GetCanonicalName(), CanonicalRevision: w.GetCanonicalRevision(), Cluster: w.GetClusterId(),
		HBONE:    w.GetTunnelProtocol() == workload.TunnelProtocol_HBONE,
		Policies: w.GetAuthorizationPolicies(),
	}
	p.Identity = identityOf(w)
	return p
}

// identityOf returns w's SPIFFE ID (the service account defaults to
// "default"), or "" when the record names no trust domain or namespace.
func identityOf(w *workload.Workload) string {
	td := w.GetTrustDomain()
	if td == "" || w.GetNamespace() == "" {
		return ""
	}
	sa := w.GetServiceAccount()
	if sa == "" {
		sa = "default"
	}
	return meshcontract.SPIFFEID(td, w.GetNamespace(), sa)
}

func (x *Index) removeLocked(uid string) {
	for _, a := range x.byUID[uid] {
		if x.byAddr[string(a)].UID == uid {
			delete(x.byAddr, string(a))
		}
	}
	delete(x.byUID, uid)
}

// Upsert indexes w under each of its addresses, replacing what its uid had.
// Addresses that are not 4 or 16 bytes are skipped.
func (x *Index) Upsert(w *workload.Workload) {
	p := peerOf(w)
	x.mu.Lock()
	defer x.mu.Unlock()
	x.removeLocked(p.UID)
	var kept [][]byte
	for _, a := range w.GetAddresses() {
		if len(a) != 4 && len(a) != 16 {
			continue
		}
		k := append([]byte(nil), a...)
		x.byAddr[string(k)] = p
		kept = append(kept, k)
	}
	x.byUID[p.UID] = kept
}

// Remove drops the workload named uid.
func (x *Index) Remove(uid string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.removeLocked(uid)
}

// Lookup returns the workload holding addr. An IPv4-mapped IPv6 address is
// looked up as IPv4.
func (x *Index) Lookup(addr netip.Addr) (Peer, bool) {
	addr = addr.Unmap()
	var k string
	if addr.Is4() {
		b := addr.As4()
		k = string(b[:])
	} else {
		b := addr.As16()
		k = string(b[:])
	}
	x.mu.RLock()
	p, ok := x.byAddr[k]
	x.mu.RUnlock()
	return p, ok
}

// Len is the number of indexed workloads.
func (x *Index) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.byUID)
}
