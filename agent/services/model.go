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

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/workload"
)

// Model keeps an index's Services and memberships equal to the Services
// and EndpointSlices it is given (by an informer, or by a directory of
// manifests). It is the index's workload.Membership.
//
// Changes come in batches (Apply; Upsert* and Delete* are batches of
// one): each Service a batch concerns is recomputed once, however many of
// its EndpointSlices changed: its istio.workload.Service, the services map
// of each endpoint workload it gains or loses, and the workloads known
// only from its EndpointSlices. Locks: the model's state is read by the
// index (Services, with the index locked), so the model never calls the
// index while holding it; batches are serialised by their own lock, held
// while they are applied.
type Model struct {
	cfg  Config
	idx  *workload.Index
	svcs *workload.Writer // Services, into the Address view
	eps  *workload.Writer // workloads known only from an EndpointSlice
	met  Metrics
	log  *slog.Logger

	apply sync.Mutex    // one batch computed and applied at a time
	gen   atomic.Uint64 // bumped by every batch that changes something (Generation)

	mu       sync.RWMutex
	services map[string]*corev1.Service            // "ns/name"
	slices   map[string]*discoveryv1.EndpointSlice // "ns/slice name"
	bySvc    map[string]map[string]struct{}        // service key → its slices' keys
	served   map[string]string                     // service key → served ServiceName
	memberOf map[string]memberships                // workload uid → its Services' endpoints
	members  map[string]map[string]struct{}
	// sliceEPs are the pod endpoints each slice names, by uid (read with
	// its Service's ports); sliceSvc the Service they were read for.
	sliceEPs map[string]map[string]Endpoint
	sliceSvc map[string]string // slice key → the service key it was read for
	// unresolved are, per slice (read for sliceSvc), its Service's named
	// target ports it resolves to no port; only slices that have some.
	unresolved map[string]map[unresolvedKey]string // → reason
}

// unresolvedKey is a Service port and the name of its targetPort.
type unresolvedKey struct {
	port   uint32
	target string
}

// Metrics are the model's counters, registered by the agent
// (agent/telemetry); a nil field is not counted.
type Metrics struct {
	// UnresolvedTargetPorts counts, by reason (UnresolvedReasons), the
	// endpoint ports not served because the endpoint's EndpointSlice
	// resolves a Service port's named targetPort to no port: once per
	// endpoint, Service port and target name when it becomes unresolved.
	UnresolvedTargetPorts *prometheus.CounterVec
	// Recomputes counts Service recomputes: one per Service per batch.
	Recomputes prometheus.Counter
	// Updates counts the Service and EndpointSlice events the informers
	// delivered (added, updated, deleted): against Recomputes, how much
	// a storm was merged.
	Updates prometheus.Counter
}

var _ workload.Membership = (*Model)(nil)

// LabelServiceName is the EndpointSlice label naming its Service.
const LabelServiceName = discoveryv1.LabelServiceName

// New returns a model writing into idx (which must have an Address view:
// workload.NewIndex) and sets itself as idx's Membership; met's counters
// may be nil.
func New(cfg Config, idx *workload.Index, met Metrics, log *slog.Logger) *Model {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Model{
		cfg: cfg, idx: idx, svcs: idx.Addresses().Writer(workload.ServiceSource), eps: idx.Writer(workload.EndpointSource), met: met, log: log,
		services: map[string]*corev1.Service{}, slices: map[string]*discoveryv1.EndpointSlice{},
		bySvc: map[string]map[string]struct{}{}, served: map[string]string{},
		memberOf: map[string]memberships{}, members: map[string]map[string]struct{}{}, sliceEPs: map[string]map[string]Endpoint{}, sliceSvc: map[string]string{},
		unresolved: map[string]map[unresolvedKey]string{},
	}
	idx.SetMembership(m)
	return m
}

// Services implements workload.Membership: uid's services map, built from
// its memberships at each call (the index asks once per marshal and keeps
// only the bytes, so no map is kept per workload).
func (m *Model) Services(uid string) map[string]*workloadpb.PortList {
	m.mu.RLock()
	defer m.mu.RUnlock()
	svcs := m.memberOf[uid]
	if len(svcs) == 0 {
		return nil
	}
	v := make(map[string]*workloadpb.PortList, len(svcs))
	for _, ms := range svcs {
		if name := m.served[ms.svc]; name != "" {
			v[name] = &workloadpb.PortList{Ports: ms.ep.Ports}
		}
	}
	return v
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
	m.Apply(Batch{Services: map[string]*corev1.Service{key(svc.Namespace, svc.Name): svc}})
}

// DeleteService removes a Service (its EndpointSlices stay until they are
// deleted, as in the API).
func (m *Model) DeleteService(namespace, name string) {
	m.Apply(Batch{Services: map[string]*corev1.Service{key(namespace, name): nil}})
}

// UpsertSlice sets an EndpointSlice; its Service is its
// kubernetes.io/service-name label.
func (m *Model) UpsertSlice(es *discoveryv1.EndpointSlice) {
	m.Apply(Batch{Slices: map[string]*discoveryv1.EndpointSlice{key(es.Namespace, es.Name): es}})
}

// DeleteSlice removes an EndpointSlice.
func (m *Model) DeleteSlice(namespace, name string) {
	m.Apply(Batch{Slices: map[string]*discoveryv1.EndpointSlice{key(namespace, name): nil}})
}

// Batch is a set of changes the model applies together (Apply): the last
// state of each Service and EndpointSlice it names, by "namespace/name",
// nil for one deleted. Each Service the batch concerns is recomputed once,
// however many of its slices changed. Objects are shared, not copied: do
// not modify them.
type Batch struct {
	Services map[string]*corev1.Service
	Slices   map[string]*discoveryv1.EndpointSlice
}

// Len is the number of objects the batch names.
func (b Batch) Len() int { return len(b.Services) + len(b.Slices) }

// Apply applies a batch: it sets (or deletes) each object, then
// recomputes each Service whose object or EndpointSlices changed, once.
// An object the model already holds (the same pointer, as an informer's
// relist hands back) changes nothing.
func (m *Model) Apply(b Batch) { m.applyBatch(b, false) }

// Replace makes the model hold exactly these Services and EndpointSlices
// (a directory rescan, an informer's relist), in one batch: what is gone
// is deleted, what changed is set.
func (m *Model) Replace(svcs []*corev1.Service, ess []*discoveryv1.EndpointSlice) {
	b := Batch{Services: make(map[string]*corev1.Service, len(svcs)), Slices: make(map[string]*discoveryv1.EndpointSlice, len(ess))}
	for _, s := range svcs {
		b.Services[key(s.Namespace, s.Name)] = s
	}
	for _, es := range ess {
		b.Slices[key(es.Namespace, es.Name)] = es
	}
	m.applyBatch(b, true)
}

// dirt is what a batch changed of one Service: the Service itself (or a
// slice moved away from it: full), and which of its slices.
type dirt struct {
	full   bool
	slices map[string]struct{}
}

type dirtSet map[string]*dirt

func (d dirtSet) mark(sk, slice string) {
	e := d[sk]
	if e == nil {
		e = &dirt{slices: map[string]struct{}{}}
		d[sk] = e
	}
	if slice == "" {
		e.full = true
	} else {
		e.slices[slice] = struct{}{}
	}
}

// applyBatch applies b (replace: and deletes what b does not name), then
// recomputes each Service it changed, one at a time (the index may read
// the model between two).
func (m *Model) applyBatch(b Batch, replace bool) {
	m.apply.Lock()
	defer m.apply.Unlock()
	dirty := dirtSet{}
	m.mu.Lock()
	if replace {
		for k := range m.services {
			if _, ok := b.Services[k]; !ok {
				m.editServiceLocked(k, nil, dirty)
			}
		}
		for k := range m.slices {
			if _, ok := b.Slices[k]; !ok {
				m.editSliceLocked(k, nil, dirty)
			}
		}
	}
	for k, svc := range b.Services {
		m.editServiceLocked(k, svc, dirty)
	}
	for k, es := range b.Slices {
		m.editSliceLocked(k, es, dirty)
	}
	m.mu.Unlock()
	if len(dirty) == 0 {
		return
	}
	m.gen.Add(1)
	for _, sk := range slices.Sorted(maps.Keys(dirty)) {
		m.mu.Lock()
		a := m.recomputeLocked(sk, dirty[sk])
		m.mu.Unlock()
		m.applyActions(sk, a)
		if m.met.Recomputes != nil {
			m.met.Recomputes.Inc()
		}
	}
}

// editServiceLocked sets (nil: deletes) the Service k.
func (m *Model) editServiceLocked(k string, svc *corev1.Service, dirty dirtSet) {
	cur, had := m.services[k]
	switch {
	case svc == nil && !had, svc != nil && cur == svc:
		return
	case svc == nil:
		delete(m.services, k)
	default:
		m.services[k] = svc
	}
	dirty.mark(k, "")
}

// editSliceLocked sets (nil: deletes) the EndpointSlice k. A slice
// without the kubernetes.io/service-name label is not kept; one whose
// label changed leaves its previous Service, which is recomputed in full.
func (m *Model) editSliceLocked(k string, es *discoveryv1.EndpointSlice, dirty dirtSet) {
	old := m.slices[k]
	if old != nil && old == es {
		return
	}
	sk := ""
	if es != nil && es.Labels[LabelServiceName] != "" {
		sk = key(es.Namespace, es.Labels[LabelServiceName])
	}
	if old != nil {
		osk := key(old.Namespace, old.Labels[LabelServiceName])
		if osk != sk {
			delete(m.slices, k)
			delete(m.bySvc[osk], k)
			if len(m.bySvc[osk]) == 0 {
				delete(m.bySvc, osk)
			}
			dirty.mark(osk, k)
			if sk != "" {
				// It moved: the other Service may read it first and
				// replace what the model knew of its endpoints.
				dirty.mark(osk, "")
			}
		}
	}
	if sk == "" {
		return // deleted, or not a Service's slice
	}
	m.slices[k] = es
	if m.bySvc[sk] == nil {
		m.bySvc[sk] = map[string]struct{}{}
	}
	m.bySvc[sk][k] = struct{}{}
	dirty.mark(sk, k)
}

// actions are what one change does to the index, computed under m.mu and
// applied without it.
type actions struct {
	upsert  *workloadpb.Service
	remove  [2]string           // namespace, hostname of a Service no longer served
	stubs   map[string]Endpoint // uid → the endpoint its stub is built from
	unstub  []string
	refresh []string
	// unresolved are the endpoint ports newly left unresolved, to count
	// and log.
	unresolved []newlyUnresolved
}

// newlyUnresolved is one Service port of one slice that some endpoints
// newly miss.
type newlyUnresolved struct {
	Unresolved
	slice     string
	endpoints int
	example   string // one of the endpoints, namespace/name
}

// Generation grows with every batch that changes an object: a snapshot
// writer compares it.
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

// recomputeLocked rebuilds Service sk's resource and memberships. d
// names the EndpointSlices that changed: only those are read again and
// only the endpoints they had or have are compared, so one slice update
// of a Service of thousands of endpoints costs the slice, not the
// Service. A change of the Service itself (d.full) reads every slice.
func (m *Model) recomputeLocked(sk string, d *dirt) actions {
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
	full := d.full || name != servedBefore

	// The endpoints each slice names (by uid), read again for the changed
	// slices only (all of them on a Service change).
	candidates := map[string]struct{}{}
	reread := d.slices
	if full {
		reread = maps.Clone(d.slices)
		for esk := range m.bySvc[sk] {
			reread[esk] = struct{}{}
		}
		for uid := range m.members[sk] {
			candidates[uid] = struct{}{}
		}
	}
	for _, esk := range slices.Sorted(maps.Keys(reread)) {
		for uid := range m.sliceEPs[esk] {
			candidates[uid] = struct{}{}
		}
		_, mine := m.bySvc[sk][esk]
		es := m.slices[esk]
		if !mine || es == nil || svc == nil {
			// Deleted, moved to another Service (which may have read it
			// already), or its Service is gone.
			if owner, ok := m.sliceSvc[esk]; !ok || owner == sk {
				delete(m.sliceEPs, esk)
				delete(m.unresolved, esk)
				delete(m.sliceSvc, esk)
				if mine && es != nil {
					m.sliceSvc[esk] = sk
				}
			}
			continue
		}
		read, unresolved := SliceEndpoints(svc, es)
		eps := make(map[string]Endpoint, len(read))
		for _, ep := range read {
			uid := workload.UID(m.cfg.ClusterID, ep.Namespace, ep.Name)
			eps[uid] = ep
			candidates[uid] = struct{}{}
		}
		a.unresolved = append(a.unresolved, m.noteUnresolvedLocked(sk, esk, eps, unresolved)...)
		m.sliceEPs[esk] = eps
		m.sliceSvc[esk] = sk
	}

	affected := map[string]struct{}{}
	if m.members[sk] == nil {
		m.members[sk] = map[string]struct{}{}
	}
	svcSlices := slices.Sorted(maps.Keys(m.bySvc[sk]))
	for uid := range candidates {
		ep, ok := m.memberEndpointLocked(svcSlices, svc, built != nil, uid)
		old, had := m.memberOf[uid].get(sk)
		switch {
		case !ok && had:
			if rest := m.memberOf[uid].without(sk); len(rest) > 0 {
				m.memberOf[uid] = rest
			} else {
				delete(m.memberOf, uid)
			}
			delete(m.members[sk], uid)
			affected[uid] = struct{}{}
		case ok:
			if !had || !sameEndpoint(old, ep) || full {
				affected[uid] = struct{}{}
			}
			m.memberOf[uid] = m.memberOf[uid].with(sk, ep)
			m.members[sk][uid] = struct{}{}
		}
	}
	if len(m.members[sk]) == 0 {
		delete(m.members, sk)
	}
	a.stubs = map[string]Endpoint{}
	for uid := range affected {
		a.refresh = append(a.refresh, uid)
		if ep, ok := m.stubLocked(uid); ok {
			a.stubs[uid] = ep
		} else {
			a.unstub = append(a.unstub, uid)
		}
	}
	slices.Sort(a.refresh)
	return a
}

// noteUnresolvedLocked records the target ports slice esk (read for sk,
// its endpoints eps) leaves unresolved and returns those some endpoints
// newly miss: an endpoint that already missed the port in this slice's
// previous reading is not counted again, so a storm of updates of an
// unchanged problem counts and logs it once.
func (m *Model) noteUnresolvedLocked(sk, esk string, eps map[string]Endpoint, now []Unresolved) []newlyUnresolved {
	var before map[unresolvedKey]string
	var had map[string]Endpoint
	if m.sliceSvc[esk] == sk {
		before, had = m.unresolved[esk], m.sliceEPs[esk]
	}
	if len(now) == 0 {
		delete(m.unresolved, esk)
		return nil
	}
	cur := make(map[unresolvedKey]string, len(now))
	var out []newlyUnresolved
	for _, u := range now {
		k := unresolvedKey{port: u.ServicePort, target: u.TargetPort}
		cur[k] = u.Reason
		n := newlyUnresolved{Unresolved: u, slice: esk}
		for _, uid := range slices.Sorted(maps.Keys(eps)) {
			if _, was := had[uid]; was && before[k] == u.Reason {
				continue
			}
			if n.endpoints == 0 {
				n.example = eps[uid].Namespace + "/" + eps[uid].Name
			}
			n.endpoints++
		}
		if n.endpoints > 0 {
			out = append(out, n)
		}
	}
	m.unresolved[esk] = cur
	return out
}

// reportUnresolved counts and logs (one line per Service port, slice and
// reason) the endpoint ports a recompute of sk newly left unresolved.
func (m *Model) reportUnresolved(sk string, us []newlyUnresolved) {
	for _, u := range us {
		if m.met.UnresolvedTargetPorts != nil {
			m.met.UnresolvedTargetPorts.WithLabelValues(u.Reason).Add(float64(u.endpoints))
		}
		why := "the EndpointSlice gives no port of that name: the pods declare no container port named so"
		if u.Reason == ReasonInvalid {
			why = "the EndpointSlice gives a port number outside 1-65535"
		}
		m.log.Warn("service port not served on some endpoints: its named targetPort is unresolved",
			"service", sk, "port", u.ServicePort, "target_port", u.TargetPort, "reason", u.Reason, "detail", why,
			"endpointslice", u.slice, "endpoints", u.endpoints, "example", u.example)
	}
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

// stubLocked is the endpoint the workload served for uid when only
// EndpointSlices know it (a pod outside the mesh, or one whose record
// this agent does not have yet) is built from (stub): the first of its
// Services' endpoints that has addresses; false when none has one.
func (m *Model) stubLocked(uid string) (Endpoint, bool) {
	for _, ms := range m.memberOf[uid] {
		if len(ms.ep.Addresses) > 0 {
			return ms.ep, true
		}
	}
	return Endpoint{}, false
}

// stub is the workload served for uid when only EndpointSlices know it,
// built from its endpoint ep, with tunnel NONE. The index builds it only
// when it is to be served (Writer.UpsertLazy): while the pod's record
// holds the uid, the stub costs its endpoint, not a marshalled resource.
func (m *Model) stub(uid string, ep Endpoint) *workloadpb.Workload {
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

// applyActions writes a change to the index; m.apply is held.
func (m *Model) applyActions(sk string, a actions) {
	m.reportUnresolved(sk, a.unresolved)
	if a.remove[1] != "" {
		m.svcs.RemoveService(a.remove[0], a.remove[1])
	}
	if a.upsert != nil {
		if _, err := m.svcs.UpsertService(a.upsert); err != nil {
			m.log.Error("failed to serve service", "service", sk, "error", err.Error())
		}
	}
	for _, uid := range slices.Sorted(maps.Keys(a.stubs)) {
		ep := a.stubs[uid]
		if _, err := m.eps.UpsertLazy(stubKey(uid), func() *workloadpb.Workload { return m.stub(uid, ep) }); err != nil {
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

// memberships are a workload's endpoints of its Services, sorted by
// service key: a pod is in one Service or a few, and a slice of them is a
// tenth of a small map's size (a map of one entry allocates a group of
// eight: ~1 KB per endpoint at 100,000 endpoints).
type memberships []membership

type membership struct {
	svc string // service key
	ep  Endpoint
}

func (ms memberships) find(sk string) (int, bool) {
	return slices.BinarySearchFunc(ms, sk, func(m membership, sk string) int { return strings.Compare(m.svc, sk) })
}

// get returns the endpoint of Service sk.
func (ms memberships) get(sk string) (Endpoint, bool) {
	if i, ok := ms.find(sk); ok {
		return ms[i].ep, true
	}
	return Endpoint{}, false
}

// with sets the endpoint of Service sk (in place when it has one).
func (ms memberships) with(sk string, ep Endpoint) memberships {
	i, ok := ms.find(sk)
	if ok {
		ms[i].ep = ep
		return ms
	}
	return slices.Insert(ms, i, membership{svc: sk, ep: ep})
}

// without drops Service sk.
func (ms memberships) without(sk string) memberships {
	if i, ok := ms.find(sk); ok {
		return slices.Delete(ms, i, i+1)
	}
	return ms
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
	_, ok := m.memberOf[uid].get(key(namespace, name))
	return ok
}
