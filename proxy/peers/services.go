package peers

import (
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"

	"aether.io/node/api/istio/workload"
)

// Services is aether-proxy's Service table: the istio.workload.Service
// resources (virtual IPs and ports) and the endpoint workloads that name them
// in their services map, so a captured connection to a VIP can be sent to a
// chosen endpoint. It is safe for concurrent use. Choose takes a read lock and
// reads an immutable per-Service snapshot; every change rebuilds only the
// snapshots of the Services it touches (O(endpoints of each)).
type Services struct {
	mu sync.RWMutex
	// byVIP maps a virtual IP and service port to its Service.
	byVIP map[vipKey]*service
	// byName maps <namespace>/<hostname> to its Service; a Service named
	// by endpoints before its own resource arrives has no VIPs yet.
	byName map[string]*service
	// members holds every workload that names at least one Service, or
	// whose locality a source lookup needs.
	members map[string]*member
	// byAddr maps a workload address (As16) to its member, for the source's
	// locality.
	byAddr map[[16]byte]*member
	// interned maps every locality string seen (per scope) to its id.
	interned map[string]uint32
	// strs and sets hold the members' repeated strings and services maps
	// once each.
	strs strs
	sets sets
	// skipped counts endpoint ports dropped at build time because neither
	// the endpoint nor the Service names a target port.
	skipped atomic.Uint64
}

type vipKey struct {
	addr [16]byte
	port uint16
}

// locality is where a workload runs, one interned id per
// LoadBalancing_Scope (index = scope number), so ranking compares integers.
type locality [7]uint32

type member struct {
	uid      string
	addrs    []netip.Addr
	healthy  bool
	hbone    bool
	identity string
	locality locality
	// services is the workload's services map, shared with every member
	// of the same map (nil: none).
	services map[string]*workload.PortList
	set      *svcSet
}

// Endpoint is one chosen backend of a Service.
type Endpoint struct {
	// UID is the endpoint workload's uid.
	UID string
	// Addr is the pod address (of the VIP's family) and target port.
	Addr netip.AddrPort
	// HBONE reports that the endpoint is in the mesh: tunnel to
	// Addr.Addr():<HBONE port> with CONNECT Addr, expecting Identity.
	HBONE bool
	// Identity is the endpoint's SPIFFE ID ("" when unknown).
	Identity string
	// Healthy is false only under the ALLOW_ALL health policy.
	Healthy bool
}

// target is one endpoint of a snapshot: its member (immutable once
// indexed) and the pod address and target port; Choose makes the
// Endpoint of the one it picks.
type target struct {
	m    *member
	addr netip.AddrPort
}

func (t *target) endpoint() Endpoint {
	return Endpoint{UID: t.m.uid, Addr: t.addr, HBONE: t.m.hbone, Identity: t.m.identity, Healthy: t.m.healthy}
}

// ServiceRef names a Service a connection was balanced through.
type ServiceRef struct {
	// Name and Namespace are the Kubernetes Service's.
	Name, Namespace string
	// Hostname is <name>.<namespace>.svc.<cluster domain>.
	Hostname string
}

// Verdict is what Choose decided.
type Verdict uint8

const (
	// NotService means the destination is no Service VIP and port; connect to
	// it as dialled.
	NotService Verdict = iota
	// Passthrough means the Service asks not to be balanced (load_balancing
	// mode PASSTHROUGH); connect to the address as dialled.
	Passthrough
	// NoEndpoint means the Service has no usable endpoint; refuse the
	// connection.
	NoEndpoint
	// Chosen means Endpoint holds the choice.
	Chosen
)

// String returns the verdict's name.
func (v Verdict) String() string {
	switch v {
	case NotService:
		return "not_service"
	case Passthrough:
		return "passthrough"
	case NoEndpoint:
		return "no_endpoint"
	case Chosen:
		return "chosen"
	}
	return "unknown"
}

type service struct {
	ref   ServiceRef
	key   string
	vips  []netip.Addr
	ports []*workload.Port
	mode  workload.LoadBalancing_Mode
	// prefs is the routing preference, most important first.
	prefs       []workload.LoadBalancing_Scope
	allowAll    bool
	passthrough bool
	members     map[string]struct{}
	// snap is the immutable endpoint set Choose reads.
	snap atomic.Pointer[snapshot]
}

// snapshot holds a Service's usable endpoints per service port and family.
type snapshot struct {
	v4, v6 map[uint16][]target
}

// NewServices returns an empty table.
func NewServices() *Services {
	return &Services{
		byVIP: map[vipKey]*service{}, byName: map[string]*service{},
		members: map[string]*member{}, byAddr: map[[16]byte]*member{}, interned: map[string]uint32{},
		strs: strs{}, sets: sets{},
	}
}

// ServiceKey is the resource name of a Service: <namespace>/<hostname>, the
// key endpoint workloads use in their services map.
func ServiceKey(s *workload.Service) string { return s.GetNamespace() + "/" + s.GetHostname() }

func (x *Services) serviceLocked(key string) *service {
	s := x.byName[key]
	if s == nil {
		s = &service{key: key, members: map[string]struct{}{}}
		s.snap.Store(&snapshot{})
		x.byName[key] = s
	}
	return s
}

// UpsertService adds or replaces a Service. Addresses that are not 4 or 16
// bytes are skipped.
func (x *Services) UpsertService(svc *workload.Service) {
	key := ServiceKey(svc)
	x.mu.Lock()
	defer x.mu.Unlock()
	s := x.serviceLocked(key)
	x.unindexVIPsLocked(s)
	s.ref = ServiceRef{Name: svc.GetName(), Namespace: svc.GetNamespace(), Hostname: svc.GetHostname()}
	s.ports = svc.GetPorts()
	lb := svc.GetLoadBalancing()
	s.mode, s.prefs = lb.GetMode(), lb.GetRoutingPreference()
	s.allowAll = lb.GetHealthPolicy() == workload.LoadBalancing_ALLOW_ALL
	s.passthrough = lb.GetMode() == workload.LoadBalancing_PASSTHROUGH
	s.vips = s.vips[:0]
	for _, na := range svc.GetAddresses() {
		a, ok := netip.AddrFromSlice(na.GetAddress())
		if !ok {
			continue
		}
		a = a.Unmap()
		s.vips = append(s.vips, a)
		for _, p := range s.ports {
			if p.GetServicePort() > 0 && p.GetServicePort() <= 65535 {
				x.byVIP[vipKey{addr: a.As16(), port: uint16(p.GetServicePort())}] = s
			}
		}
	}
	x.rebuildLocked(s)
}

func (x *Services) unindexVIPsLocked(s *service) {
	for _, a := range s.vips {
		for _, p := range s.ports {
			k := vipKey{addr: a.As16(), port: uint16(p.GetServicePort())}
			if x.byVIP[k] == s {
				delete(x.byVIP, k)
			}
		}
	}
}

// RemoveService drops the Service named key (<namespace>/<hostname>). Its
// endpoints keep their membership, so a Service that comes back finds them.
func (x *Services) RemoveService(key string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	s := x.byName[key]
	if s == nil {
		return
	}
	x.unindexVIPsLocked(s)
	s.vips, s.ports = nil, nil
	if len(s.members) == 0 {
		delete(x.byName, key)
		return
	}
	x.rebuildLocked(s)
}

// UpsertWorkload records w as an endpoint of every Service its services map
// names (and drops it from those it no longer names), and as a source whose
// locality a Service's routing preference compares.
func (x *Services) UpsertWorkload(w *workload.Workload) {
	m := memberOf(w)
	x.mu.Lock()
	defer x.mu.Unlock()
	m.locality = x.internLocked(w)
	m.identity = x.strs.hold(m.identity)
	m.set = x.sets.hold(w.GetServices())
	if m.set != nil {
		m.services = m.set.m
	}
	old := x.members[m.uid]
	touched := map[string]struct{}{}
	if old != nil {
		x.dropMemberLocked(old, touched)
	}
	x.members[m.uid] = m
	for _, a := range m.addrs {
		x.byAddr[a.As16()] = m
	}
	for key := range m.services {
		x.serviceLocked(key).members[m.uid] = struct{}{}
		touched[key] = struct{}{}
	}
	x.rebuildTouchedLocked(touched)
}

// RemoveWorkload drops the workload named uid from every Service.
func (x *Services) RemoveWorkload(uid string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	m := x.members[uid]
	if m == nil {
		return
	}
	touched := map[string]struct{}{}
	x.dropMemberLocked(m, touched)
	x.rebuildTouchedLocked(touched)
}

func (x *Services) dropMemberLocked(m *member, touched map[string]struct{}) {
	for _, a := range m.addrs {
		if x.byAddr[a.As16()] == m {
			delete(x.byAddr, a.As16())
		}
	}
	for key := range m.services {
		if s := x.byName[key]; s != nil {
			delete(s.members, m.uid)
			touched[key] = struct{}{}
		}
	}
	delete(x.members, m.uid)
	x.strs.drop(m.identity)
	x.sets.drop(m.set)
}

func (x *Services) rebuildTouchedLocked(touched map[string]struct{}) {
	for key := range touched {
		s := x.byName[key]
		if s == nil {
			continue
		}
		if len(s.members) == 0 && len(s.vips) == 0 {
			delete(x.byName, key)
			continue
		}
		x.rebuildLocked(s)
	}
}

// internLocked returns w's locality as interned ids. Ids are never freed:
// the set of nodes, zones, regions, clusters and networks a node's proxy
// hears of is small and bounded by the cluster's topology.
func (x *Services) internLocked(w *workload.Workload) locality {
	var l locality
	for scope, v := range map[workload.LoadBalancing_Scope]string{
		workload.LoadBalancing_REGION: w.GetLocality().GetRegion(), workload.LoadBalancing_ZONE: w.GetLocality().GetZone(),
		workload.LoadBalancing_SUBZONE: w.GetLocality().GetSubzone(), workload.LoadBalancing_NODE: w.GetNode(),
		workload.LoadBalancing_CLUSTER: w.GetClusterId(), workload.LoadBalancing_NETWORK: w.GetNetwork(),
	} {
		k := scope.String() + "\x00" + v
		id, ok := x.interned[k]
		if !ok {
			id = uint32(len(x.interned)) + 1
			x.interned[k] = id
		}
		l[scope] = id
	}
	return l
}

func memberOf(w *workload.Workload) *member {
	m := &member{
		uid: w.GetUid(), healthy: w.GetStatus() == workload.WorkloadStatus_HEALTHY,
		hbone: w.GetTunnelProtocol() == workload.TunnelProtocol_HBONE,
	}
	for _, b := range w.GetAddresses() {
		if a, ok := netip.AddrFromSlice(b); ok && (len(b) == 4 || len(b) == 16) {
			m.addrs = append(m.addrs, a.Unmap())
		}
	}
	m.identity = identityOf(w)
	return m
}

// rebuildLocked lays out s's endpoints per service port and family. An
// endpoint's target port is the one its own services entry maps the
// service port to (a named targetPort resolved for that pod), else the
// Service's numeric target port; with neither, the endpoint is skipped for
// that port and counted.
func (x *Services) rebuildLocked(s *service) {
	snap := &snapshot{v4: map[uint16][]target{}, v6: map[uint16][]target{}}
	for uid := range s.members {
		m := x.members[uid]
		if m == nil || (!m.healthy && !s.allowAll) {
			continue
		}
		own := m.services[s.key].GetPorts()
		for _, sp := range s.ports {
			tp := sp.GetTargetPort()
			for _, p := range own {
				if p.GetServicePort() == sp.GetServicePort() && p.GetTargetPort() != 0 {
					tp = p.GetTargetPort()
					break
				}
			}
			if tp == 0 || tp > 65535 || sp.GetServicePort() > 65535 {
				x.skipped.Add(1)
				continue
			}
			for _, a := range firstPerFamily(m.addrs) {
				e := target{m: m, addr: netip.AddrPortFrom(a, uint16(tp))}
				port, fam := uint16(sp.GetServicePort()), snap.v4
				if a.Is6() {
					fam = snap.v6
				}
				if fam[port] == nil {
					// Sized for every member: one allocation, no growth.
					fam[port] = make([]target, 0, len(s.members))
				}
				fam[port] = append(fam[port], e)
			}
		}
	}
	s.snap.Store(snap)
}

// firstPerFamily returns the first IPv4 and the first IPv6 address.
func firstPerFamily(addrs []netip.Addr) []netip.Addr {
	var out []netip.Addr
	var have4, have6 bool
	for _, a := range addrs {
		if a.Is4() && !have4 {
			have4 = true
			out = append(out, a)
		} else if a.Is6() && !have6 {
			have6 = true
			out = append(out, a)
		}
	}
	return out
}

// Choose balances a connection from src to dst. When dst is a Service VIP and
// port it returns Chosen and an endpoint of dst's family: healthy ones only
// (unless the Service allows all), ranked by the Service's routing
// preference against src's workload (FAILOVER: the endpoints matching the
// most leading scopes; STRICT: only endpoints matching every scope), chosen
// uniformly at random among the best, never exclude (the endpoint a failed
// first dial went to; pass the zero value otherwise), unless it is the only
// one. It does not allocate.
func (x *Services) Choose(src netip.Addr, dst netip.AddrPort, exclude netip.AddrPort) (Endpoint, ServiceRef, Verdict) {
	a := dst.Addr().Unmap()
	x.mu.RLock()
	s := x.byVIP[vipKey{addr: a.As16(), port: dst.Port()}]
	var srcLoc *locality
	if s != nil && len(s.prefs) > 0 {
		if m := x.byAddr[src.Unmap().As16()]; m != nil {
			srcLoc = &m.locality
		}
	}
	x.mu.RUnlock()
	if s == nil {
		return Endpoint{}, ServiceRef{}, NotService
	}
	if s.passthrough {
		return Endpoint{}, s.ref, Passthrough
	}
	snap := s.snap.Load()
	eps := snap.v4[dst.Port()]
	if a.Is6() {
		eps = snap.v6[dst.Port()]
	}
	e, ok := pick(eps, s.prefs, s.mode == workload.LoadBalancing_STRICT, srcLoc, exclude)
	if !ok {
		return Endpoint{}, s.ref, NoEndpoint
	}
	return e, s.ref, Chosen
}

// rank counts the leading scopes of prefs on which e matches src.
func rank(e *target, prefs []workload.LoadBalancing_Scope, src *locality) int {
	n := 0
	for _, p := range prefs {
		if p > 0 && int(p) < len(src) && e.m.locality[p] != src[p] {
			break
		}
		n++
	}
	return n
}

// pick chooses uniformly among the best-ranked endpoints, skipping exclude
// while another candidate exists. At most three passes over eps, no
// allocation.
func pick(eps []target, prefs []workload.LoadBalancing_Scope, strict bool, src *locality, exclude netip.AddrPort) (Endpoint, bool) {
	if len(eps) == 0 {
		return Endpoint{}, false
	}
	if len(prefs) == 0 || src == nil {
		if strict && len(prefs) > 0 {
			// A strict preference cannot be met for an unknown source.
			return Endpoint{}, false
		}
		return pickAmong(eps, nil, nil, 0, exclude)
	}
	best := -1
	for i := range eps {
		if r := rank(&eps[i], prefs, src); r > best {
			best = r
		}
	}
	if strict && best < len(prefs) {
		return Endpoint{}, false
	}
	return pickAmong(eps, prefs, src, best, exclude)
}

// pickAmong chooses uniformly among the endpoints of rank best (every
// endpoint when src is nil), avoiding exclude unless it is the only one.
func pickAmong(eps []target, prefs []workload.LoadBalancing_Scope, src *locality, best int, exclude netip.AddrPort) (Endpoint, bool) {
	if src == nil && !exclude.IsValid() {
		return eps[rand.IntN(len(eps))].endpoint(), true
	}
	eligible := func(e *target) bool { return src == nil || rank(e, prefs, src) == best }
	n, nx := 0, 0
	for i := range eps {
		if eligible(&eps[i]) {
			n++
			if eps[i].addr == exclude {
				nx++
			}
		}
	}
	skip := nx > 0 && n > nx
	if skip {
		n -= nx
	}
	if n == 0 {
		return Endpoint{}, false
	}
	k := rand.IntN(n)
	for i := range eps {
		if !eligible(&eps[i]) || (skip && eps[i].addr == exclude) {
			continue
		}
		if k == 0 {
			return eps[i].endpoint(), true
		}
		k--
	}
	return Endpoint{}, false
}

// SkippedEndpointPorts counts endpoint ports dropped because no target port
// could be resolved (a named targetPort the endpoint does not declare).
func (x *Services) SkippedEndpointPorts() uint64 { return x.skipped.Load() }

// Len is the number of Services with at least one VIP.
func (x *Services) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	n := 0
	for _, s := range x.byName {
		if len(s.vips) > 0 {
			n++
		}
	}
	return n
}

// ServiceOf returns the Service a connection to a workload's own address dst
// is reported under when it was not balanced through a VIP here (the
// destination side of a tunnel, a connection to a pod IP), as ztunnel
// guesses it for its inbound metrics: among the Services the workload at
// dst's address is an endpoint of (with a resource of their own), one with a
// port whose target port is dst's port, the Service's own or the endpoint's
// mapping of it (a named targetPort). When several match, the first by
// <namespace>/<hostname> wins, so the choice is stable. It does not
// allocate.
func (x *Services) ServiceOf(dst netip.AddrPort) (ServiceRef, bool) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	m := x.byAddr[dst.Addr().Unmap().As16()]
	if m == nil {
		return ServiceRef{}, false
	}
	var best *service
	for key, own := range m.services {
		s := x.byName[key]
		if s == nil || len(s.ports) == 0 || (best != nil && key >= best.key) {
			continue
		}
		if servesPort(s.ports, own.GetPorts(), uint32(dst.Port())) {
			best = s
		}
	}
	if best == nil {
		return ServiceRef{}, false
	}
	return best.ref, true
}

// servesPort reports whether one of a Service's ports targets port, by its
// own target port or by the endpoint's mapping of its service port.
func servesPort(ports, own []*workload.Port, port uint32) bool {
	for _, sp := range ports {
		if sp.GetTargetPort() == port {
			return true
		}
		for _, p := range own {
			if p.GetServicePort() == sp.GetServicePort() && p.GetTargetPort() == port {
				return true
			}
		}
	}
	return false
}
