package services

import (
	"cmp"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/workload"
)

// Model keeps an index's Services and memberships equal to the Services
// and EndpointSlices it is given (by an informer, or by a directory of
// manifests). It is the index's workload.Membership.
//
// Every change recomputes the one Service it concerns: its
// istio.workload.Service, the services map of each endpoint workload it
// gains or loses, and the workloads known only from its EndpointSlices.
// Locks: the model's state is read by the index (Services, with the
// index locked), so the model never calls the index while holding it;
// changes are serialised by their own lock, held while they are applied.
type Model struct {
	cfg  Config
	idx  *workload.Index
	svcs *workload.Writer // Services, into the Address view
	eps  *workload.Writer // workloads known only from an EndpointSlice
	log  *slog.Logger

	apply sync.Mutex    // one change computed and applied at a time
	gen   atomic.Uint64 // bumped by every change (Generation)

	mu       sync.RWMutex
	services map[string]*corev1.Service            // "ns/name"
	slices   map[string]*discoveryv1.EndpointSlice // "ns/slice name"
	bySvc    map[string]map[string]struct{}        // service key → its slices' keys
	served   map[string]string                     // service key → served ServiceName
	memberOf map[string]map[string]Endpoint        // workload uid → service key → the endpoint
	members  map[string]map[string]struct{}
	// sliceEPs are the pod endpoints each slice names, by uid (read with
	// its Service's ports); sliceSvc the Service they were read for.
	sliceEPs map[string]map[string]Endpoint
	sliceSvc map[string]string                          // service key → its member uids
	view     map[string]map[string]*workloadpb.PortList // uid → ServiceName → ports; replaced, never modified
}

var _ workload.Membership = (*Model)(nil)

// LabelServiceName is the EndpointSlice label naming its Service.
const LabelServiceName = discoveryv1.LabelServiceName

// New returns a model writing into idx (which must have an Address view:
// workload.NewIndex) and sets itself as idx's Membership.
func New(cfg Config, idx *workload.Index, log *slog.Logger) *Model {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Model{
		cfg: cfg, idx: idx, svcs: idx.Addresses().Writer(workload.ServiceSource), eps: idx.Writer(workload.EndpointSource), log: log,
		services: map[string]*corev1.Service{}, slices: map[string]*discoveryv1.EndpointSlice{},
		bySvc: map[string]map[string]struct{}{}, served: map[string]string{},
		memberOf: map[string]map[string]Endpoint{}, members: map[string]map[string]struct{}{}, sliceEPs: map[string]map[string]Endpoint{}, sliceSvc: map[string]string{}, view: map[string]map[string]*workloadpb.PortList{},
	}
	idx.SetMembership(m)
	return m
}

// Services implements workload.Membership.
func (m *Model) Services(uid string) map[string]*workloadpb.PortList {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.view[uid]
}

// Len returns the number of Services known (served or not).
func (m *Model) Len() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.services)
}

func key(namespace, name string) string { return namespace + "/" + name }

// UpsertService sets a Service.
func (m *Model) UpsertService(svc *corev1.Service) {
	m.change(key(svc.Namespace, svc.Name), "", func() { m.services[key(svc.Namespace, svc.Name)] = svc })
}

// DeleteService removes a Service (its EndpointSlices stay until they are
// deleted, as in the API).
func (m *Model) DeleteService(namespace, name string) {
	m.change(key(namespace, name), "", func() { delete(m.services, key(namespace, name)) })
}

// UpsertSlice sets an EndpointSlice; its Service is its
// kubernetes.io/service-name label.
func (m *Model) UpsertSlice(es *discoveryv1.EndpointSlice) {
	k := key(es.Namespace, es.Name)
	m.mu.RLock()
	old := m.slices[k]
	m.mu.RUnlock()
	if old != nil && old.Labels[LabelServiceName] != es.Labels[LabelServiceName] {
		m.DeleteSlice(es.Namespace, es.Name) // it moved to another Service
	}
	svc := es.Labels[LabelServiceName]
	if svc == "" {
		return // not a Service's slice
	}
	sk := key(es.Namespace, svc)
	m.change(sk, k, func() {
		m.slices[k] = es
		if m.bySvc[sk] == nil {
			m.bySvc[sk] = map[string]struct{}{}
		}
		m.bySvc[sk][k] = struct{}{}
	})
}

// DeleteSlice removes an EndpointSlice.
func (m *Model) DeleteSlice(namespace, name string) {
	k := key(namespace, name)
	m.mu.RLock()
	es := m.slices[k]
	m.mu.RUnlock()
	if es == nil {
		return
	}
	sk := key(namespace, es.Labels[LabelServiceName])
	m.change(sk, k, func() {
		delete(m.slices, k)
		delete(m.bySvc[sk], k)
		if len(m.bySvc[sk]) == 0 {
			delete(m.bySvc, sk)
		}
	})
}

// Replace makes the model hold exactly these Services and EndpointSlices
// (a directory rescan, an informer's relist): what is gone is deleted,
// what changed is set.
func (m *Model) Replace(svcs []*corev1.Service, ess []*discoveryv1.EndpointSlice) {
	keepSvc := map[string]bool{}
	for _, s := range svcs {
		keepSvc[key(s.Namespace, s.Name)] = true
	}
	keepES := map[string]bool{}
	for _, es := range ess {
		keepES[key(es.Namespace, es.Name)] = true
	}
	m.mu.RLock()
	var goneSvc []*corev1.Service
	var goneES []*discoveryv1.EndpointSlice
	for k, s := range m.services {
		if !keepSvc[k] {
			goneSvc = append(goneSvc, s)
		}
	}
	for k, es := range m.slices {
		if !keepES[k] {
			goneES = append(goneES, es)
		}
	}
	m.mu.RUnlock()
	for _, es := range goneES {
		m.DeleteSlice(es.Namespace, es.Name)
	}
	for _, s := range goneSvc {
		m.DeleteService(s.Namespace, s.Name)
	}
	for _, s := range svcs {
		m.UpsertService(s)
	}
	for _, es := range ess {
		m.UpsertSlice(es)
	}
}

// actions are what one change does to the index, computed under m.mu and
// applied without it.
type actions struct {
	upsert  *workloadpb.Service
	remove  [2]string // namespace, hostname of a Service no longer served
	stubs   map[string]*workloadpb.Workload
	unstub  []string
	refresh []string
}

// change applies edit to the model's state and recomputes Service sk
// (changed: the one EndpointSlice edit touched, "" for the Service).
func (m *Model) change(sk, changed string, edit func()) {
	m.apply.Lock()
	defer m.apply.Unlock()
	m.mu.Lock()
	edit()
	a := m.recomputeLocked(sk, changed)
	m.mu.Unlock()
	m.applyActions(sk, a)
	m.gen.Add(1)
}

// Generation grows with every change: a snapshot writer compares it.
func (m *Model) Generation() uint64 { return m.gen.Load() }

// Snapshot returns every Service and EndpointSlice the model holds (the
// trimmed objects, shared: do not modify them), sorted by key.
func (m *Model) Snapshot() ([]*corev1.Service, []*discoveryv1.EndpointSlice) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	svcs := make([]*corev1.Service, 0, len(m.services))
	for _, k := range slices.Sorted(maps.Keys(m.services)) {
		svcs = append(svcs, m.services[k])
	}
	ess := make([]*discoveryv1.EndpointSlice, 0, len(m.slices))
	for _, k := range slices.Sorted(maps.Keys(m.slices)) {
		ess = append(ess, m.slices[k])
	}
	return svcs, ess
}

// recomputeLocked rebuilds Service sk's resource and memberships. changed
// names the one EndpointSlice that changed ("" for a change of the
// Service itself): only that slice is read again and only the endpoints
// it had or has are compared, so one slice update of a Service of
// thousands of endpoints costs the slice, not the Service.
func (m *Model) recomputeLocked(sk, changed string) actions {
	var a actions
	svc := m.services[sk]
	var built *workloadpb.Service
	if svc != nil {
		built = BuildService(m.cfg, svc)
	}
	name := ""
	if built != nil {
		name = workload.ServiceName(built.GetNamespace(), built.GetHostname())
		a.upsert = built
	}
	servedBefore := m.served[sk]
	if servedBefore != "" && servedBefore != name {
		ns, host, _ := strings.Cut(servedBefore, "/")
		a.remove = [2]string{ns, host}
	}
	if name == "" {
		delete(m.served, sk)
	} else {
		m.served[sk] = name
	}
	full := changed == "" || name != servedBefore

	// The endpoints each slice names (by uid), read again for the changed
	// slice only (all of them on a Service change).
	candidates := map[string]struct{}{}
	reread := []string{changed}
	if full {
		reread = slices.Collect(maps.Keys(m.bySvc[sk]))
		for uid := range m.members[sk] {
			candidates[uid] = struct{}{}
		}
	}
	for _, esk := range reread {
		for uid := range m.sliceEPs[esk] {
			candidates[uid] = struct{}{}
		}
		es := m.slices[esk]
		if es == nil || svc == nil {
			delete(m.sliceEPs, esk)
			continue
		}
		eps := map[string]Endpoint{}
		for _, ep := range SliceEndpoints(svc, es) {
			uid := workload.UID(m.cfg.ClusterID, ep.Namespace, ep.Name)
			eps[uid] = ep
			candidates[uid] = struct{}{}
		}
		m.sliceEPs[esk] = eps
	}
	if full {
		// Slices of other Services (or none) no longer count for sk.
		for esk := range m.sliceEPs {
			if _, ok := m.bySvc[sk][esk]; !ok && m.sliceSvc[esk] == sk {
				delete(m.sliceEPs, esk)
			}
		}
	}
	for _, esk := range reread {
		if m.slices[esk] != nil {
			m.sliceSvc[esk] = sk
		} else {
			delete(m.sliceSvc, esk)
		}
	}

	affected := map[string]struct{}{}
	if m.members[sk] == nil {
		m.members[sk] = map[string]struct{}{}
	}
	svcSlices := slices.Sorted(maps.Keys(m.bySvc[sk]))
	for uid := range candidates {
		ep, ok := m.memberEndpointLocked(svcSlices, svc, built != nil, uid)
		old, had := m.memberOf[uid][sk]
		switch {
		case !ok && had:
			delete(m.memberOf[uid], sk)
			if len(m.memberOf[uid]) == 0 {
				delete(m.memberOf, uid)
			}
			delete(m.members[sk], uid)
			affected[uid] = struct{}{}
		case ok:
			if m.memberOf[uid] == nil {
				m.memberOf[uid] = map[string]Endpoint{}
			}
			if !had || !sameEndpoint(old, ep) || full {
				affected[uid] = struct{}{}
			}
			m.memberOf[uid][sk] = ep
			m.members[sk][uid] = struct{}{}
		}
	}
	if len(m.members[sk]) == 0 {
		delete(m.members, sk)
	}
	a.stubs = map[string]*workloadpb.Workload{}
	for uid := range affected {
		m.rebuildViewLocked(uid)
		a.refresh = append(a.refresh, uid)
		if stub := m.stubLocked(uid); stub != nil {
			a.stubs[uid] = stub
		} else {
			a.unstub = append(a.unstub, uid)
		}
	}
	slices.Sort(a.refresh)
	return a
}

// memberEndpointLocked is uid's endpoint of a Service, merged over the
// Service's slices (svcSlices, sorted; a pod may be in several), or false when it is not a
// member: the Service is not served, or no slice has it ready (every one
// when the Service publishes not-ready addresses).
func (m *Model) memberEndpointLocked(svcSlices []string, svc *corev1.Service, served bool, uid string) (Endpoint, bool) {
	if !served {
		return Endpoint{}, false
	}
	var out Endpoint
	found := false
	for _, esk := range svcSlices {
		ep, ok := m.sliceEPs[esk][uid]
		if !ok || (!ep.Ready && !svc.Spec.PublishNotReadyAddresses) {
			continue // not ready: no new connections (terminating ones included)
		}
		if found {
			out.Ports = mergePorts(out.Ports, ep.Ports)
			out.Addresses = mergeAddrs(out.Addresses, ep.Addresses)
			continue
		}
		out, found = ep, true
	}
	return out, found
}

// rebuildViewLocked replaces uid's services map from memberOf.
func (m *Model) rebuildViewLocked(uid string) {
	svcs := m.memberOf[uid]
	if len(svcs) == 0 {
		delete(m.view, uid)
		return
	}
	v := make(map[string]*workloadpb.PortList, len(svcs))
	for sk, ep := range svcs {
		if name := m.served[sk]; name != "" {
			v[name] = &workloadpb.PortList{Ports: ep.Ports}
		}
	}
	m.view[uid] = v
}

// stubLocked is the workload served for uid when only EndpointSlices know
// it (a pod outside the mesh, or one whose record this agent does not
// have yet): built from the first of its Services' endpoints that has
// addresses, with tunnel NONE; nil when none has an address.
func (m *Model) stubLocked(uid string) *workloadpb.Workload {
	svcs := m.memberOf[uid]
	for _, sk := range slices.Sorted(maps.Keys(svcs)) {
		ep := svcs[sk]
		if len(ep.Addresses) == 0 {
			continue
		}
		w := &workloadpb.Workload{
			Uid: uid, Name: ep.Name, Namespace: ep.Namespace, Node: ep.Node,
			Network: m.cfg.Network, ClusterId: m.cfg.ClusterID,
			WorkloadType: workloadpb.WorkloadType_POD, WorkloadName: ep.Name,
			CanonicalName: ep.Name, CanonicalRevision: "latest",
			TunnelProtocol: workloadpb.TunnelProtocol_NONE,
			Status:         workloadpb.WorkloadStatus_UNHEALTHY,
		}
		if ep.Ready {
			w.Status = workloadpb.WorkloadStatus_HEALTHY
		}
		for _, a := range ep.Addresses {
			w.Addresses = append(w.Addresses, a.AsSlice())
		}
		return w
	}
	return nil
}

// applyActions writes a change to the index; m.apply is held.
func (m *Model) applyActions(sk string, a actions) {
	if a.remove[1] != "" {
		m.svcs.RemoveService(a.remove[0], a.remove[1])
	}
	if a.upsert != nil {
		if _, err := m.svcs.UpsertService(a.upsert); err != nil {
			m.log.Error("failed to serve service", "service", sk, "error", err.Error())
		}
	}
	for _, uid := range slices.Sorted(maps.Keys(a.stubs)) {
		if _, err := m.eps.Upsert(stubKey(uid), a.stubs[uid]); err != nil {
			m.log.Error("failed to serve service endpoint", "service", sk, "workload", uid, "error", err.Error())
		}
	}
	for _, uid := range a.unstub {
		m.eps.Remove(stubKey(uid))
	}
	if _, err := m.idx.Refresh(a.refresh); err != nil {
		m.log.Error("failed to refresh service membership", "service", sk, "error", err.Error())
	}
}

// stubKey is the index key of a workload known only from EndpointSlices.
func stubKey(uid string) string { return "endpointslice/" + uid }

func mergePorts(a, b []*workloadpb.Port) []*workloadpb.Port {
	out := slices.Clone(a)
	for _, p := range b {
		if !slices.ContainsFunc(out, func(q *workloadpb.Port) bool { return q.ServicePort == p.ServicePort }) {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(x, y *workloadpb.Port) int { return cmp.Compare(x.ServicePort, y.ServicePort) })
	return out
}

func mergeAddrs(a, b []netip.Addr) []netip.Addr {
	out := slices.Clone(a)
	for _, x := range b {
		if !slices.Contains(out, x) {
			out = append(out, x)
		}
	}
	return out
}

// sameEndpoint reports whether a membership entry is unchanged.
func sameEndpoint(a, b Endpoint) bool {
	return a.Namespace == b.Namespace && a.Name == b.Name && a.Node == b.Node && a.Ready == b.Ready &&
		slices.Equal(a.Addresses, b.Addresses) &&
		slices.EqualFunc(a.Ports, b.Ports, func(x, y *workloadpb.Port) bool {
			return x.ServicePort == y.ServicePort && x.TargetPort == y.TargetPort
		})
}

// MemberOf reports whether the workload uid is an endpoint of the Service
// namespace/name (an AuthorizationPolicy's targetRefs bind through it).
// It must not be called with the model's lock held (it takes it).
func (m *Model) MemberOf(uid, namespace, name string) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	_, ok := m.memberOf[uid][key(namespace, name)]
	return ok
}
