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
	byAddr map[string]*indexed // string(raw 4 or 16 bytes) -> its workload
	byUID  map[string]*indexed // uid -> its workload
	// strs holds the strings many workloads repeat once each.
	strs strs
}

// indexed is one workload: its peer (repeated strings held in strs) and
// the addresses it is indexed under, each a length byte (4 or 16) and
// the raw bytes, one after the other: byAddr's keys are substrings of it
// (one allocation per workload, none per address).
type indexed struct {
	peer  Peer
	addrs string
}

// eachAddr calls fn with each address key of e.addrs.
func (e *indexed) eachAddr(fn func(string)) {
	for a := e.addrs; len(a) > 0; {
		n := int(a[0])
		fn(a[1 : 1+n])
		a = a[1+n:]
	}
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{byAddr: map[string]*indexed{}, byUID: map[string]*indexed{}, strs: strs{}}
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
	e := x.byUID[uid]
	if e == nil {
		return
	}
	e.eachAddr(func(a string) {
		if x.byAddr[a] == e {
			delete(x.byAddr, a)
		}
	})
	delete(x.byUID, uid)
	for _, s := range e.peer.shared() {
		x.strs.drop(*s)
	}
	if e.peer.Workload != e.peer.Name {
		x.strs.drop(e.peer.Workload)
	}
}

// shared are the fields of p many workloads repeat (held in strs); the
// workload name too unless it is the pod's own name (a bare pod, a
// StatefulSet's), which it then shares.
func (p *Peer) shared() [5]*string {
	return [5]*string{&p.Namespace, &p.CanonicalName, &p.CanonicalRevision, &p.Cluster, &p.Identity}
}

// Upsert indexes w under each of its addresses, replacing what its uid had.
// Addresses that are not 4 or 16 bytes are skipped.
func (x *Index) Upsert(w *workload.Workload) {
	e := &indexed{peer: peerOf(w)}
	var addrs []byte
	for _, a := range w.GetAddresses() {
		if len(a) == 4 || len(a) == 16 {
			addrs = append(append(addrs, byte(len(a))), a...)
		}
	}
	e.addrs = string(addrs)
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, s := range e.peer.shared() {
		*s = x.strs.hold(*s)
	}
	if p := &e.peer; p.Workload == p.Name {
		p.Workload = p.Name
	} else {
		p.Workload = x.strs.hold(p.Workload)
	}
	x.removeLocked(e.peer.UID)
	e.eachAddr(func(a string) { x.byAddr[a] = e })
	x.byUID[e.peer.UID] = e
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
	e := x.byAddr[k]
	x.mu.RUnlock()
	if e == nil {
		return Peer{}, false
	}
	return e.peer, true
}

// Len is the number of indexed workloads.
func (x *Index) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.byUID)
}
