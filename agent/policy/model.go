package policy

import (
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/labels"

	"aether.io/node/agent/podsource/manifests"
	"aether.io/node/api/istio/security"
	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/workload"
)

// ServiceMembers is what the model needs of the Service model: the
// Services map of each workload (it is the index's one Membership) and
// whether a workload is an endpoint of a Service (targetRefs).
type ServiceMembers interface {
	workload.Membership
	MemberOf(uid, namespace, name string) bool
}

// Model keeps the index's Authorization view equal to the
// AuthorizationPolicies it is given, and binds every workload to the
// selector- and targetRef-scoped ones (workload.PolicyBinding). It is the
// index's Membership, the Services part delegated to ServiceMembers.
type Model struct {
	root string
	idx  *workload.Index
	out  *workload.Writer
	svcs ServiceMembers
	log  *slog.Logger

	apply sync.Mutex    // one change translated and applied at a time
	gen   atomic.Uint64 // bumped by every change (Generation)

	mu       sync.RWMutex
	objs     map[string]*Object  // <ns>/<name>
	bound    map[string]*binding // selector- and targetRef-scoped policies
	warned   map[string]string   // key -> the warnings last logged
	podsByNS map[string]map[string]map[string]string
	podNS    map[string]string // uid -> namespace
	peers    map[string]*PeerObject
	peerOut  map[string]bool // keys of the PeerAuthentication translations served
}

// binding is how a WORKLOAD_SELECTOR policy selects workloads.
type binding struct {
	namespace string
	root      bool // in the root namespace: workloads of every namespace
	selector  labels.Selector
	services  []string // targetRefs to Services, by name (the policy's namespace)
}

var (
	_ workload.Membership    = (*Model)(nil)
	_ workload.PolicyBinding = (*Model)(nil)
)

// New returns a model writing into idx's Authorization view, with rootNS
// the mesh's root namespace, and makes it idx's Membership.
func New(rootNS string, idx *workload.Index, svcs ServiceMembers, log *slog.Logger) *Model {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Model{
		root: rootNS, idx: idx, out: idx.Authorizations().Writer(workload.AuthorizationSource), svcs: svcs, log: log,
		objs: map[string]*Object{}, bound: map[string]*binding{}, warned: map[string]string{},
		podsByNS: map[string]map[string]map[string]string{}, podNS: map[string]string{},
		peers: map[string]*PeerObject{}, peerOut: map[string]bool{},
	}
	idx.SetMembership(m)
	return m
}

// Services implements workload.Membership (the Service model's answer).
func (m *Model) Services(uid string) map[string]*workloadpb.PortList {
	if m.svcs == nil {
		return nil
	}
	return m.svcs.Services(uid)
}

// ObserveLabels records a workload's labels (workload.Config.ObserveLabels).
func (m *Model) ObserveLabels(uid, namespace string, l map[string]string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if old, ok := m.podNS[uid]; ok && old != namespace {
		delete(m.podsByNS[old], uid)
	}
	if m.podsByNS[namespace] == nil {
		m.podsByNS[namespace] = map[string]map[string]string{}
	}
	m.podsByNS[namespace][uid] = l
	m.podNS[uid] = namespace
}

// Forget implements workload.PolicyBinding.
func (m *Model) Forget(uid string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ns, ok := m.podNS[uid]; ok {
		delete(m.podsByNS[ns], uid)
		if len(m.podsByNS[ns]) == 0 {
			delete(m.podsByNS, ns)
		}
		delete(m.podNS, uid)
	}
}

// Policies implements workload.PolicyBinding: the keys of the selector-
// and targetRef-scoped policies that select uid, sorted.
func (m *Model) Policies(uid string) []string {
	m.mu.RLock()
	ns, ok := m.podNS[uid]
	var lbl map[string]string
	if ok {
		lbl = m.podsByNS[ns][uid]
	}
	var out, refs []string
	var refBindings []*binding
	for k, b := range m.bound {
		if !b.root && b.namespace != ns {
			continue
		}
		switch {
		case b.selector != nil:
			if ok && b.selector.Matches(labels.Set(lbl)) {
				out = append(out, k)
			}
		case len(b.services) > 0:
			refs, refBindings = append(refs, k), append(refBindings, b)
		}
	}
	if ok {
		out = append(out, peerBinding(m.root, ns, lbl, m.peers)...)
	}
	m.mu.RUnlock()
	// Service membership is the Service model's, asked without our lock.
	for i, b := range refBindings {
		for _, svc := range b.services {
			if m.svcs != nil && m.svcs.MemberOf(uid, b.namespace, svc) {
				out = append(out, refs[i])
				break
			}
		}
	}
	slices.Sort(out)
	return out
}

// Upsert sets a policy.
func (m *Model) Upsert(o *Object) { m.change(o.Key(), o) }

// Delete removes a policy.
func (m *Model) Delete(namespace, name string) { m.change(namespace+"/"+name, nil) }

// Replace makes the model hold exactly objs.
func (m *Model) Replace(objs []*Object) {
	keep := map[string]bool{}
	for _, o := range objs {
		keep[o.Key()] = true
	}
	m.mu.RLock()
	var gone []string
	for k := range m.objs {
		if !keep[k] {
			gone = append(gone, k)
		}
	}
	m.mu.RUnlock()
	for _, k := range gone {
		m.change(k, nil)
	}
	for _, o := range objs {
		m.Upsert(o)
	}
}

// Len returns the number of policies held.
func (m *Model) Len() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.objs)
}

// change applies one policy's new state (nil: deleted): its resource,
// and the bindings of the workloads it selected or selects.
func (m *Model) change(k string, o *Object) {
	m.apply.Lock()
	defer m.apply.Unlock()
	var tr Translation
	var b *binding
	if o != nil {
		tr = Translate(m.root, o)
		b = m.bindingOf(o, &tr)
	}
	m.mu.Lock()
	old := m.bound[k]
	if o == nil {
		delete(m.objs, k)
		delete(m.warned, k)
	} else {
		m.objs[k] = o
	}
	if b != nil {
		m.bound[k] = b
	} else {
		delete(m.bound, k)
	}
	refresh := m.affectedLocked(old, b)
	logWarnings := o != nil && m.warned[k] != strings.Join(tr.Warnings, "\n")
	if o != nil {
		m.warned[k] = strings.Join(tr.Warnings, "\n")
	}
	m.mu.Unlock()
	if logWarnings {
		for _, w := range tr.Warnings {
			m.log.Warn("authorization policy not enforced as written", "policy", k, "warning", w)
		}
	}
	if tr.Authorization == nil {
		m.out.Remove(k)
	} else if _, err := m.out.UpsertAuthorization(tr.Authorization); err != nil {
		m.log.Error("failed to serve authorization policy", "policy", k, "error", err.Error())
	}
	if len(refresh) > 0 {
		if _, err := m.idx.Refresh(refresh); err != nil {
			m.log.Error("failed to rebind workloads to authorization policies", "policy", k, "error", err.Error())
		}
	}
	m.gen.Add(1)
}

// Generation grows with every change: a snapshot writer compares it.
func (m *Model) Generation() uint64 { return m.gen.Load() }

// Snapshot returns the JSON of every AuthorizationPolicy and
// PeerAuthentication held, sorted by key (ParseObject and ParsePeerObject
// read them back).
func (m *Model) Snapshot() (policies, peers [][]byte) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, k := range slices.Sorted(maps.Keys(m.objs)) {
		if raw := m.objs[k].Raw; raw != nil {
			policies = append(policies, raw)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(m.peers)) {
		if raw := m.peers[k].Raw; raw != nil {
			peers = append(peers, raw)
		}
	}
	return policies, peers
}

// bindingOf is how o selects workloads when it is WORKLOAD_SELECTOR
// scoped; nil otherwise. A targetRef to anything but a Service is not
// enforced by the node proxy (it attaches to a waypoint or gateway).
func (m *Model) bindingOf(o *Object, tr *Translation) *binding {
	a := tr.Authorization
	if a == nil || a.GetScope().String() != "WORKLOAD_SELECTOR" {
		return nil
	}
	b := &binding{namespace: o.Namespace, root: o.Namespace == m.root}
	if ml := o.Spec.GetSelector().GetMatchLabels(); len(ml) > 0 && len(o.Spec.GetTargetRefs()) == 0 && o.Spec.GetTargetRef() == nil {
		b.selector = labels.SelectorFromSet(ml)
		return b
	}
	refs := o.Spec.GetTargetRefs()
	if r := o.Spec.GetTargetRef(); r != nil {
		refs = append(refs, r)
	}
	for _, r := range refs {
		if (r.GetGroup() == "" || r.GetGroup() == "core") && r.GetKind() == "Service" {
			b.services = append(b.services, r.GetName())
			continue
		}
		tr.Warnings = append(tr.Warnings, "authorization policy "+o.Key()+": targetRef "+r.GetGroup()+"/"+r.GetKind()+" "+r.GetName()+
			" attaches to a waypoint or gateway, not to workloads: the node proxy does not enforce it for that target")
	}
	b.root = false // targetRefs name Services of the policy's own namespace
	return b
}

// affectedLocked returns the uids whose binding may change when a policy
// goes from old to b.
func (m *Model) affectedLocked(old, b *binding) []string {
	var out []string
	for _, x := range []*binding{old, b} {
		if x == nil {
			continue
		}
		if x.root {
			for _, pods := range m.podsByNS {
				out = append(out, slices.Collect(maps.Keys(pods))...)
			}
			continue
		}
		out = append(out, slices.Collect(maps.Keys(m.podsByNS[x.namespace]))...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// ReplaceFrom makes the model hold the AuthorizationPolicies of a manifest
// directory (manifests.Dir). One that does not decode strictly is held
// failing closed; one that cannot be read at all is logged and skipped.
func (m *Model) ReplaceFrom(o manifests.Objects) {
	var objs []*Object
	for _, raw := range o.AuthorizationPolicies {
		obj, err := ParseObject(raw)
		if obj == nil {
			m.log.Error("failed to read authorization policy manifest", "error", err.Error())
			continue
		}
		objs = append(objs, obj)
	}
	m.Replace(objs)
	var peers []*PeerObject
	for _, raw := range o.PeerAuthentications {
		p, err := ParsePeerObject(raw)
		if err != nil {
			m.log.Error("failed to read peer authentication manifest; the level above applies", "error", err.Error())
			continue
		}
		peers = append(peers, p)
	}
	m.ReplacePeers(peers)
}

// UpsertPeer sets a PeerAuthentication.
func (m *Model) UpsertPeer(o *PeerObject) { m.changePeers(func() { m.peers[o.Key()] = o }) }

// DeletePeer removes a PeerAuthentication.
func (m *Model) DeletePeer(namespace, name string) {
	m.changePeers(func() { delete(m.peers, namespace+"/"+name) })
}

// ReplacePeers makes the model hold exactly objs.
func (m *Model) ReplacePeers(objs []*PeerObject) {
	m.changePeers(func() {
		m.peers = map[string]*PeerObject{}
		for _, o := range objs {
			m.peers[o.Key()] = o
		}
	})
}

// changePeers applies edit and serves what the PeerAuthentications become
// (the static strict policy, and each port-level translation), then
// rebinds every workload (a mesh-wide mode reaches all of them).
func (m *Model) changePeers(edit func()) {
	m.apply.Lock()
	defer m.apply.Unlock()
	m.mu.Lock()
	edit()
	want := map[string]*security.Authorization{}
	if len(m.peers) > 0 {
		ss := staticStrict(m.root)
		want[ss.Namespace+"/"+ss.Name] = ss
	}
	for _, o := range m.peers {
		if len(o.Spec.GetSelector().GetMatchLabels()) == 0 || o.Namespace == m.root {
			continue
		}
		mesh, nsWide, _ := peerLevels(m.root, o.Namespace, nil, m.peers)
		if a := convertPeer(o, mesh, nsWide); a != nil {
			want[a.Namespace+"/"+a.Name] = a
		}
	}
	var gone []string
	for k := range m.peerOut {
		if want[k] == nil {
			gone = append(gone, k)
			delete(m.peerOut, k)
		}
	}
	for k := range want {
		m.peerOut[k] = true
	}
	uids := slices.Collect(maps.Keys(m.podNS))
	m.mu.Unlock()
	for _, k := range gone {
		m.out.Remove(k)
	}
	defer m.gen.Add(1)
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if _, err := m.out.UpsertAuthorization(want[k]); err != nil {
			m.log.Error("failed to serve peer authentication", "policy", k, "error", err.Error())
		}
	}
	slices.Sort(uids)
	if _, err := m.idx.Refresh(uids); err != nil {
		m.log.Error("failed to rebind workloads to peer authentication", "error", err.Error())
	}
}
