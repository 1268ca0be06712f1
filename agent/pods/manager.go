// Package pods is the agent's pod lifecycle: the managed decision, durable
// records, endpoint registration, terminating pods and the liveness loop.
//
// Invariants (see agent/README.md):
//   - persist before register: an endpoint is registered only for a record
//     that is durably stored;
//   - never re-register a terminating pod: every registry write follows
//     lock → check → write → re-check: the key's write lock orders the
//     writes of one key; the check of the record's terminating flag runs
//     under mu, the same lock under which the pod watch marks pods
//     terminating; the write runs without mu (a slow registry never blocks
//     AddPod, RemovePod or the admin API); a record that turned terminating
//     or was removed while its Register was in flight is deregistered again;
//   - failed deregistrations are retried with backoff until they succeed,
//     and the liveness loop's ghost sweep deletes this node's keys without
//     a live record (after a restart the retry set is gone; the sweep finds
//     the same keys);
//   - replay before serve: Replay loads every record before the CNI socket
//     is opened.
package pods

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	"aether.io/node/agent/telemetry"
	"aether.io/node/agent/uds"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/pkg/enrolment"
	"aether.io/node/registry"
)

// ManagedLabel marks a mesh-managed pod, or a namespace whose pods are,
// when its value is "true" (pkg/enrolment has the rules).
const ManagedLabel = enrolment.ManagedLabel

// ErrPodUnavailable means the pod source did not know the pod within the
// request's deadline (the plugin maps it to CNI code 11, try again later).
var ErrPodUnavailable = errors.New("pod not known to the pod source yet")

// ErrPodUIDMismatch means the pod source's pod of the request's
// namespace/name has another uid than the request's, even after fetching
// it again: the source has not caught up with a delete and re-create of
// the same name (the plugin maps it to CNI code 11, try again later).
var ErrPodUIDMismatch = errors.New("pod source has another pod of this name")

// ErrPodOtherNode means the pod source's pod is not scheduled to this node
// (its spec.nodeName names another node, or none yet): the agent never
// records it, registers its endpoint or mints its SVID. A sandbox for it on
// this node is not the pod's (the plugin fails the ADD; no retry helps).
var ErrPodOtherNode = errors.New("pod is not scheduled to this node")

// Config configures a Manager.
type Config struct {
	// Node is this node's name.
	Node string
	// Locality is this node's topology.
	Locality registry.Locality
	// LocalityUnknown says the agent could not read Locality (its Node,
	// with the API server down): each endpoint then carries the locality
	// stored with its record (store.Record.Locality) until SetLocality.
	LocalityUnknown bool
	// Enrolment are the rules that decide which pods are managed (system
	// namespaces, the Istio ambient namespace alias).
	Enrolment enrolment.Rules
	// UDSRoot is the CSI driver's socket root (<uds-csi-root>).
	UDSRoot string
	// PodWait bounds pod lookups of requests without a deadline.
	PodWait time.Duration
	// Observer, if set, is told about every durable record (at replay and
	// after each AddPod is persisted) and every removal (RemovePod), for
	// example to serve per-pod xDS resources that live until RemovePod.
	Observer Observer
}

// Observer follows the stored records. Its methods may run under the
// lifecycle lock: they must not block or call back into the Manager.
type Observer interface {
	// RecordStored is called with a record that is durable (at replay, after
	// AddPod persisted it, and whenever its registration or health changes;
	// the same content may come more than once). ep is the record as an
	// endpoint; ep.Healthy is true only while the pod is registered, live
	// and not terminating.
	RecordStored(rec *store.Record, ep registry.Endpoint)
	// RecordRemoved is called once the record with key is deleted.
	RecordRemoved(key string)
}

// Preparer is an Observer that can do RecordStored's work ahead of time:
// AddPod calls Prepare with the record it has just queued for its commit,
// outside every lock, while the commit syncs, so building the pod's
// resources overlaps the disk write instead of following it. Prepare must
// publish nothing: the record is not durable yet (its write may still
// fail), and RecordStored, called once it is, publishes.
type Preparer interface {
	Prepare(rec *store.Record)
}

// Prober says whether a stored pod is alive.
type Prober interface {
	Healthy(rec *store.Record) bool
}

// NetnsProber calls a pod healthy while its network namespace path exists.
type NetnsProber struct{}

// Healthy stats the record's network namespace.
func (NetnsProber) Healthy(rec *store.Record) bool {
	_, err := os.Stat(rec.Pod.GetNetworkNamespace())
	return err == nil
}

// Manager owns the pod records. Build it with New.
type Manager struct {
	cfg   Config
	store *store.Store
	reg   registry.Registry
	src   podsource.Source
	// namespaces are src's namespace labels, nil when src has none: then
	// only the pod label enrols.
	namespaces podsource.Namespaces
	log        *slog.Logger
	metrics    *telemetry.Metrics
	prober     Prober
	now        func() time.Time

	mu          sync.Mutex // the lifecycle lock; never held across a registry or store call
	entries     map[string]*entry
	terminating map[string]time.Time // pod identity -> when marked
	removals    map[string]Removal   // namespace/name -> last DEL
	retries     map[string]*retry    // container ID -> failed deregistration to retry

	writes keyLocks // orders the registry writes of each key

	// locality is the node's topology, known unless localityUnknown (from
	// Config, then SetLocality); both under mu.
	locality        registry.Locality
	localityUnknown bool
}

// maxRemovals bounds the DEL timings kept in memory (one per pod); the
// oldest goes first, and pruneMarks drops any older than an hour.
const maxRemovals = 4096

// Removal is the last CNI DEL (RemovePod) of a pod the agent held a record
// of. It lives in memory only (the record itself is gone), so it is lost
// when the agent restarts.
type Removal struct {
	// ContainerID is the sandbox the DEL removed.
	ContainerID string
	// At is when the agent handled it.
	At time.Time
	// Timings are the plugin's timings of that DEL; nil from a plugin that
	// predates RemovePodRequest.plugin_timings.
	Timings *cniv1.PluginTimings
}

type entry struct {
	key        string     // the container ID, never changes
	wmu        sync.Mutex // orders this record's writes
	rec        *store.Record
	persisted  bool
	registered bool
	// unsure: a Register of the key failed, so the registry may still hold
	// it (the previous value, which the etcd backend keeps and re-writes
	// after a lease loss, or a write etcd applies late); a terminating or
	// removed record deregisters it all the same.
	unsure  bool
	healthy bool
	removed bool
}

// New builds a Manager; it does no I/O.
func New(cfg Config, st *store.Store, reg registry.Registry, src podsource.Source, prober Prober, m *telemetry.Metrics, log *slog.Logger) *Manager {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if prober == nil {
		prober = NetnsProber{}
	}
	if m == nil {
		m = telemetry.NewMetrics()
	}
	if cfg.PodWait <= 0 {
		cfg.PodWait = 5 * time.Second
	}
	namespaces, _ := src.(podsource.Namespaces)
	return &Manager{
		cfg: cfg, store: st, reg: reg, src: src, namespaces: namespaces, log: log, metrics: m, prober: prober, now: time.Now,
		entries: map[string]*entry{}, terminating: map[string]time.Time{}, removals: map[string]Removal{},
		retries: map[string]*retry{}, locality: cfg.Locality, localityUnknown: cfg.LocalityUnknown,
	}
}

func podIdentity(ns, name, uid string) string { return ns + "/" + name + "/" + uid }

// isTerminatingLocked reports whether the watch marked this pod terminating.
func (m *Manager) isTerminatingLocked(ns, name, uid string) bool {
	if _, ok := m.terminating[podIdentity(ns, name, uid)]; ok {
		return true
	}
	if uid == "" {
		for k := range m.terminating {
			if len(k) > len(ns)+len(name)+2 && k[:len(ns)+len(name)+2] == ns+"/"+name+"/" {
				return true
			}
		}
	}
	return false
}

func matches(rec *store.Record, ns, name, uid string) bool {
	p := rec.Pod
	if p.GetNamespace() != ns || p.GetName() != name {
		return false
	}
	return uid == "" || p.GetUid() == "" || p.GetUid() == uid
}

// Replay loads every stored record and registers the ones that are not
// terminating (outside mu, replayParallel at a time, within one
// writeTimeout: the liveness loop registers whatever failed) and sets the
// aether_agent_pods gauges. Call it before serving.
func (m *Manager) Replay(ctx context.Context) (int, error) {
	recs, err := m.store.List()
	if err != nil {
		return 0, fmt.Errorf("failed to replay records: %w", err)
	}
	var live []*entry
	var health []bool
	m.mu.Lock()
	for _, r := range recs {
		e := &entry{key: r.Key(), rec: r, persisted: true}
		m.entries[e.key] = e
		if r.Pod.GetTerminating() {
			m.terminating[podIdentity(r.Pod.GetNamespace(), r.Pod.GetName(), r.Pod.GetUid())] = m.now()
			continue
		}
		m.checkUDS(r)
		live = append(live, e)
		health = append(health, m.prober.Healthy(r))
	}
	m.mu.Unlock()
	m.registerAll(ctx, live, health)
	m.mu.Lock()
	for _, e := range m.entries {
		m.observeLocked(e)
	}
	// The gauges show the replayed records at once, not from the first
	// liveness tick (which, with the API server down, may be long after
	// the agent serves them).
	m.updateGaugesLocked()
	m.mu.Unlock()
	// Records written before they carried the locality (or under another
	// one) get the node's, so a later restart without the API server
	// serves it.
	m.stampLocality(ctx)
	m.log.Info("replayed pod records", "records", len(recs))
	return len(recs), nil
}

// observeLocked tells the observer e's current state.
func (m *Manager) observeLocked(e *entry) {
	if m.cfg.Observer == nil || e.removed || !e.persisted {
		return
	}
	live := e.registered && e.healthy && !e.rec.Pod.GetTerminating()
	m.cfg.Observer.RecordStored(e.rec, m.endpoint(e.rec, live))
}

// decide applies the enrolment rules to p with its namespace's labels as
// the source knows them; a namespace the source does not know (yet) counts
// as unlabelled.
func (m *Manager) decide(p *podsource.Pod, hasIPs bool) enrolment.Decision {
	var nsLabels map[string]string
	if m.namespaces != nil {
		nsLabels, _ = m.namespaces.NamespaceLabels(p.Namespace)
	}
	return m.cfg.Enrolment.Decide(enrolment.Pod{
		Namespace: p.Namespace, Labels: p.Labels, NamespaceLabels: nsLabels, HostNetwork: p.HostNetwork, HasIPs: hasIPs,
	})
}

// lookupContext bounds the pod lookups of one AddPod: ctx's deadline, but
// no later than PodWait from now, and a little before the caller's deadline
// so it gets Unavailable, not DeadlineExceeded.
func (m *Manager) lookupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	deadline, ok := ctx.Deadline()
	if !ok || time.Until(deadline) > m.cfg.PodWait {
		deadline = m.now().Add(m.cfg.PodWait)
	}
	margin := min(time.Until(deadline)/10, 250*time.Millisecond)
	return context.WithDeadline(ctx, deadline.Add(-margin))
}

// lookup asks the source for the pod until it is found or lctx ends.
func (m *Manager) lookup(lctx context.Context, ns, name string) (*podsource.Pod, error) {
	backoff := 10 * time.Millisecond
	for {
		p, err := m.src.Get(lctx, ns, name)
		if err == nil {
			return p, nil
		}
		if !errors.Is(err, podsource.ErrNotFound) {
			m.log.Warn("pod lookup failed", "namespace", ns, "name", name, "error", err.Error())
		}
		m.metrics.PodLookupRetry.Inc()
		t := time.NewTimer(backoff)
		select {
		case <-lctx.Done():
			t.Stop()
			return nil, fmt.Errorf("failed to find pod %s/%s: %w (last error: %w)", ns, name, ErrPodUnavailable, err)
		case <-t.C:
		}
		backoff = min(backoff*2, 500*time.Millisecond)
	}
}

// samePod makes sure p is the pod whose sandbox the runtime is adding.
// When the request carries a uid (K8S_POD_UID) and the source's pod has
// another, the source's cache lags behind a delete and re-create of the
// same name: the pod is fetched once more from the source's authority
// (bounded by lctx) and refused with ErrPodUIDMismatch if it is still
// not that uid. A request without uid, or a source pod without one,
// keeps p.
func (m *Manager) samePod(lctx context.Context, uid string, p *podsource.Pod) (*podsource.Pod, error) {
	if uid == "" || p.UID == "" || p.UID == uid {
		return p, nil
	}
	m.log.Info("pod source holds another pod of this name; fetching it again", "namespace", p.Namespace, "name", p.Name,
		"uid", uid, "source_uid", p.UID)
	f, err := m.src.Fetch(lctx, p.Namespace, p.Name)
	switch {
	case err == nil && f.UID == uid:
		return f, nil
	case err == nil:
		return nil, fmt.Errorf("failed to match pod %s/%s: %w: the sandbox is for uid %q, the pod source has uid %q (cached) and %q (fetched)",
			p.Namespace, p.Name, ErrPodUIDMismatch, uid, p.UID, f.UID)
	default:
		return nil, fmt.Errorf("failed to match pod %s/%s: %w: the sandbox is for uid %q, the pod source has uid %q (cached) and fetching it again failed: %w",
			p.Namespace, p.Name, ErrPodUIDMismatch, uid, p.UID, err)
	}
}

// AddPod handles CNI ADD. in must be valid (the server validates it).
// timings are the plugin's (AddPodRequest.plugin_timings; nil from a plugin
// that predates them): a managed pod's record keeps them as its last ADD
// timings until ReportAddResult completes them.
func (m *Manager) AddPod(ctx context.Context, in *cniv1.CNIPod, timings *cniv1.PluginTimings) (cniv1.AddPodResponse_Result, error) {
	res, err := m.addPod(ctx, in, timings)
	switch {
	case err != nil:
		m.metrics.Operations.WithLabelValues(telemetry.OpAddPod, telemetry.ResultError).Inc()
	case res == cniv1.AddPodResponse_RESULT_IGNORED:
		m.metrics.Operations.WithLabelValues(telemetry.OpAddPod, telemetry.ResultIgnored).Inc()
	default:
		m.metrics.Operations.WithLabelValues(telemetry.OpAddPod, telemetry.ResultSuccess).Inc()
	}
	return res, err
}

// addPod is AddPod's steps: admit the pod (or ignore or refuse it), build
// its record, put the record in the pod's entry, persist it (a failure
// undoes the put) and announce the pod (observe and register it).
func (m *Manager) addPod(ctx context.Context, in *cniv1.CNIPod, timings *cniv1.PluginTimings) (cniv1.AddPodResponse_Result, error) {
	ns, name, key := in.GetNamespace(), in.GetName(), in.GetContainerId()
	log := m.log.With("namespace", ns, "name", name, "container_id", key)
	p, via, res, err := m.admit(ctx, in, log)
	if p == nil {
		return res, err
	}
	rec := m.newRecord(in, p, timings)
	rec.EnrolledVia = string(via)
	e, restore := m.putEntry(key, rec, p)
	var prepare func(*store.Record)
	if p, ok := m.cfg.Observer.(Preparer); ok {
		prepare = p.Prepare
	}
	if err := m.persist(ctx, e, prepare); err != nil {
		restore()
		log.Error("failed to persist pod record", "error", err.Error())
		return cniv1.AddPodResponse_RESULT_ERROR, err
	}
	m.checkUDS(rec)
	m.announce(ctx, e, log)
	return cniv1.AddPodResponse_RESULT_SUCCESS, nil
}

// admit is AddPod's first step: the source's pod for in and the label that
// enrols it, or nil with the result for a pod that is not added:
// RESULT_IGNORED for a pod the enrolment rules leave out (a system
// namespace or no IPs, decided without a lookup; host network, opted out,
// not labelled); RESULT_ERROR (and why) for one the source cannot find in
// time, of another uid or scheduled to another node. It changes nothing, so
// it has nothing to undo.
func (m *Manager) admit(ctx context.Context, in *cniv1.CNIPod, log *slog.Logger) (*podsource.Pod, enrolment.Via, cniv1.AddPodResponse_Result, error) {
	ns, name := in.GetNamespace(), in.GetName()
	if m.cfg.Enrolment.IsSystemNamespace(ns) {
		log.Debug("pod ignored", "reason", string(enrolment.ReasonSystemNamespace))
		return nil, "", cniv1.AddPodResponse_RESULT_IGNORED, nil
	}
	if len(in.GetIps()) == 0 {
		log.Debug("pod ignored", "reason", string(enrolment.ReasonNoIPs))
		return nil, "", cniv1.AddPodResponse_RESULT_IGNORED, nil
	}
	lctx, cancel := m.lookupContext(ctx)
	defer cancel()
	p, err := m.lookup(lctx, ns, name)
	if err != nil {
		return nil, "", cniv1.AddPodResponse_RESULT_ERROR, err
	}
	// Never take a deleted pod's uid (or its terminating mark) for a new
	// sandbox of the same name.
	if p, err = m.samePod(lctx, in.GetUid(), p); err != nil {
		log.Warn("pod refused: uid mismatch", "error", err.Error())
		return nil, "", cniv1.AddPodResponse_RESULT_ERROR, err
	}
	// Only a pod scheduled here: the kube source's GET on a cache miss
	// answers for any node's pod (the manifests source keeps only this
	// node's, and gives a manifest without nodeName this node's name).
	if p.NodeName != m.cfg.Node {
		err := fmt.Errorf("failed to add pod %s/%s: %w: its spec.nodeName is %q, this node is %q", ns, name, ErrPodOtherNode, p.NodeName, m.cfg.Node)
		log.Warn("pod refused: not scheduled to this node", "node_name", p.NodeName, "node", m.cfg.Node, "uid", p.UID)
		return nil, "", cniv1.AddPodResponse_RESULT_ERROR, err
	}
	d := m.decide(p, true)
	if !d.Managed {
		log.Debug("pod ignored", "reason", string(d.Reason))
		return nil, "", cniv1.AddPodResponse_RESULT_IGNORED, nil
	}
	return p, d.Via, cniv1.AddPodResponse_RESULT_SUCCESS, nil
}

// newRecord is the record of the pod the runtime adds: in, completed with
// what the source knows of p (labels, annotations, service account, uid,
// ports, volumes), and the plugin's timings. It changes nothing, so it has
// nothing to undo.
func (m *Manager) newRecord(in *cniv1.CNIPod, p *podsource.Pod, timings *cniv1.PluginTimings) *store.Record {
	pod := proto.Clone(in).(*cniv1.CNIPod)
	pod.Labels = p.Labels
	pod.Annotations = p.Annotations
	pod.ServiceAccount = p.ServiceAccount
	pod.Uid = p.UID
	pod.Terminating = p.Terminating
	pod.DeclaredPorts = &cniv1.DeclaredPorts{Tcp: p.DeclaredTCPPorts}
	pod.Volumes = p.Volumes
	pod.UdsCsiVolume = p.UDSCSIVolume
	pod.UdsCsiVolumes = p.UDSCSIVolumes
	rec := &store.Record{Pod: pod, Node: m.cfg.Node, Owner: p.Owner, HostNetwork: p.HostNetwork, FixedName: p.FixedName, AddedAt: m.now().UTC()}
	if timings != nil {
		rec.LastTimings = proto.Clone(timings).(*cniv1.PluginTimings)
	}
	return rec
}

// putEntry makes rec the record of key's entry (a new one for a first
// ADD), keeping what a re-ADD must not lose of the record it replaces
// (when it was added, its uncaptured state, its timings, a terminating
// mark and the last locality known), and marks the pod terminating as the
// source or this manager knows it. restore is its undo, for a record that
// could not be persisted: it takes a new entry out again, or puts the
// previous record back while rec is still the entry's.
func (m *Manager) putEntry(key string, rec *store.Record, p *podsource.Pod) (e *entry, restore func()) {
	pod := rec.Pod
	ns, name := pod.GetNamespace(), pod.GetName()
	m.mu.Lock()
	defer m.mu.Unlock()
	e, had := m.entries[key]
	var prev *store.Record
	if !had {
		e = &entry{key: key}
		m.entries[key] = e
	} else {
		prev = e.rec
		rec.AddedAt = prev.AddedAt
		rec.Uncaptured, rec.UncapturedError = prev.Uncaptured, prev.UncapturedError
		if rec.LastTimings == nil {
			rec.LastTimings = prev.LastTimings
		}
		if prev.Pod.GetTerminating() && matches(prev, ns, name, p.UID) {
			pod.Terminating = true // never cleared by a re-ADD
		}
	}
	if p.Terminating {
		m.terminating[podIdentity(ns, name, p.UID)] = m.now()
	}
	if m.isTerminatingLocked(ns, name, p.UID) {
		pod.Terminating = true
	}
	rec.Locality = m.locality
	if m.localityUnknown && prev != nil {
		rec.Locality = prev.Locality // the last one known
	}
	e.rec = rec
	return e, func() {
		m.mu.Lock()
		if !had && m.entries[key] == e {
			delete(m.entries, key)
		} else if had && prev != nil && e.rec == rec {
			e.rec = prev
		}
		m.mu.Unlock()
	}
}

// announce is AddPod's last step, after the record is persisted: the
// observer learns the entry (unless it was removed meanwhile) and the pod
// is registered (register checks terminating and removed itself; the
// liveness loop retries a registration that failed). Nothing is undone
// after it: the ADD has succeeded.
func (m *Manager) announce(ctx context.Context, e *entry, log *slog.Logger) {
	m.mu.Lock()
	if !e.removed {
		m.observeLocked(e)
	}
	m.mu.Unlock()
	m.register(ctx, e, true) // checks terminating and removed itself
	m.mu.Lock()
	terminating, registered := e.rec.Pod.GetTerminating(), e.registered
	m.mu.Unlock()
	log.Info("pod added", "terminating", terminating, "registered", registered)
}

// persist writes e's current record; writes of one record are ordered by
// e.wmu, and each takes its snapshot under mu, so the last write carries
// the latest state. While the commit syncs, prepare (if any) gets the
// snapshot (see Preparer).
func (m *Manager) persist(ctx context.Context, e *entry, prepare func(*store.Record)) error {
	e.wmu.Lock()
	defer e.wmu.Unlock()
	m.mu.Lock()
	if e.removed {
		m.mu.Unlock()
		return nil
	}
	snap := e.rec.Clone()
	m.mu.Unlock()
	wait := m.store.PutAsync(context.WithoutCancel(ctx), snap)
	if prepare != nil {
		prepare(snap)
	}
	if err := wait(); err != nil {
		return err
	}
	m.mu.Lock()
	e.persisted = true
	m.mu.Unlock()
	return nil
}

// endpoint is r's endpoint; mu is held.
func (m *Manager) endpoint(r *store.Record, healthy bool) registry.Endpoint {
	p := r.Pod
	ep := registry.Endpoint{
		Key: r.Key(), Node: r.Node, Namespace: p.GetNamespace(), Name: p.GetName(), UID: p.GetUid(),
		ServiceAccount: p.GetServiceAccount(), Labels: p.GetLabels(), Owner: r.Owner, HostNetwork: r.HostNetwork, FixedName: r.FixedName,
		// An UNCAPTURED pod runs outside the mesh: it is served UNHEALTHY
		// (no traffic is routed to it) until a later ADD captures it.
		Healthy: healthy && !r.Uncaptured, Locality: m.locality,
	}
	if m.localityUnknown {
		ep.Locality = r.Locality
	}
	if ep.Node == "" {
		ep.Node = m.cfg.Node
	}
	for _, s := range p.GetIps() {
		if a, err := netip.ParseAddr(s); err == nil {
			ep.IPs = append(ep.IPs, a)
		}
	}
	return ep
}

func (m *Manager) checkUDS(r *store.Record) {
	if _, asked, err := uds.Resolve(m.cfg.UDSRoot, r.Pod); asked && err != nil {
		var re *uds.RefusalError
		if errors.As(err, &re) {
			m.metrics.UDSRefusals.WithLabelValues(re.Reason).Inc()
			m.log.Warn("uds socket refused", "namespace", r.Pod.GetNamespace(), "name", r.Pod.GetName(),
				"container_id", r.Key(), "reason", re.Reason, "error", re.Detail)
		}
	}
}

// RemovePod handles CNI DEL: the record is deleted first (the only failure
// that fails the DEL), then the endpoint is deregistered (a failed
// deregistration is retried by the liveness loop). Unknown containers
// succeed. timings are the plugin's
// (RemovePodRequest.plugin_timings; nil from a plugin that predates them):
// they are kept as the pod's last DEL (LastRemoval) when the agent held a
// record of the container, or already holds a DEL of that pod (a retried
// DEL); DELs of pods the agent never managed are not kept.
func (m *Manager) RemovePod(ctx context.Context, ns, name, key string, timings *cniv1.PluginTimings) (cniv1.RemovePodResponse_Result, error) {
	m.mu.Lock()
	e := m.entries[key]
	if _, known := m.removals[ns+"/"+name]; e != nil || known {
		m.keepRemovalLocked(ns, name, key, timings)
	}
	m.mu.Unlock()
	if e == nil {
		m.metrics.Operations.WithLabelValues(telemetry.OpRemovePod, telemetry.ResultSuccess).Inc()
		m.log.Debug("remove of unknown container", "namespace", ns, "name", name, "container_id", key)
		return cniv1.RemovePodResponse_RESULT_SUCCESS, nil
	}
	e.wmu.Lock()
	defer e.wmu.Unlock()
	if err := m.store.Delete(context.WithoutCancel(ctx), key); err != nil {
		m.metrics.Operations.WithLabelValues(telemetry.OpRemovePod, telemetry.ResultError).Inc()
		return cniv1.RemovePodResponse_RESULT_ERROR, fmt.Errorf("failed to delete record %q: %w", key, err)
	}
	m.mu.Lock()
	e.removed = true
	if m.entries[key] == e {
		delete(m.entries, key)
		m.reg.Withdraw(key) // see MarkTerminating
	}
	if m.cfg.Observer != nil {
		m.cfg.Observer.RecordRemoved(key)
	}
	// Terminating marks outlive the record (a late ADD of the same pod from
	// a lagging source must not register it); pruneMarks ages them out.
	r := e.rec.Pod
	m.mu.Unlock()
	m.deregister(ctx, e)
	if r.GetNamespace() != ns || r.GetName() != name {
		m.log.Warn("remove named another pod than the record", "container_id", key, "namespace", ns, "name", name,
			"record_namespace", r.GetNamespace(), "record_name", r.GetName())
	}
	m.metrics.Operations.WithLabelValues(telemetry.OpRemovePod, telemetry.ResultSuccess).Inc()
	m.log.Info("pod removed", "namespace", ns, "name", name, "container_id", key)
	return cniv1.RemovePodResponse_RESULT_SUCCESS, nil
}

// ReportAddResult records the plugin's data-plane outcome on the record.
// It returns false for an unknown container.
func (m *Manager) ReportAddResult(ctx context.Context, req *cniv1.ReportAddResultRequest) (bool, error) {
	t := req.GetTimings()
	if t.GetReadinessProbe() != nil || t.GetReadinessProbeError() != "" {
		m.metrics.Operations.WithLabelValues(telemetry.OpReadinessProbe, resultOf(t.GetReadinessProbeError())).Inc()
	}
	if t.GetCaptureDivert() != nil || t.GetCaptureDivertError() != "" {
		m.metrics.Operations.WithLabelValues(telemetry.OpCaptureDivert, resultOf(t.GetCaptureDivertError())).Inc()
	}
	key := req.GetContainerId()
	m.mu.Lock()
	e := m.entries[key]
	if e == nil || e.removed {
		m.mu.Unlock()
		m.metrics.Operations.WithLabelValues("report_add_result", telemetry.ResultUnknown).Inc()
		m.log.Info("add result for unknown container", "namespace", req.GetNamespace(), "name", req.GetName(), "container_id", key)
		return false, nil
	}
	rec := e.rec.Clone()
	if t != nil {
		rec.LastTimings = proto.Clone(t).(*cniv1.PluginTimings)
	}
	wasUncaptured := e.rec.Uncaptured
	rec.Uncaptured = t.GetCaptureDivertError() != ""
	rec.UncapturedError = t.GetCaptureDivertError()
	e.rec = rec
	m.mu.Unlock()
	if rec.Uncaptured {
		m.log.Warn("pod running UNCAPTURED", "namespace", rec.Pod.GetNamespace(), "name", rec.Pod.GetName(),
			"container_id", key, "uid", rec.Pod.GetUid(), "error", rec.UncapturedError)
	}
	if err := m.persist(ctx, e, nil); err != nil {
		return true, fmt.Errorf("failed to persist add result of %q: %w", key, err)
	}
	if rec.Uncaptured != wasUncaptured {
		// Health as served changed (UNCAPTURED is served UNHEALTHY): tell
		// the local xDS at once and republish the endpoint. A failed
		// registry write is retried by the liveness loop.
		m.mu.Lock()
		registered, healthy := e.registered, e.healthy
		if !e.removed {
			m.observeLocked(e)
		}
		m.mu.Unlock()
		if registered {
			m.register(ctx, e, healthy)
		}
	}
	return true, nil
}

// keepRemovalLocked records the last DEL of ns/name; mu is held.
func (m *Manager) keepRemovalLocked(ns, name, key string, timings *cniv1.PluginTimings) {
	id := ns + "/" + name
	if _, ok := m.removals[id]; !ok && len(m.removals) >= maxRemovals {
		oldest := ""
		for k, r := range m.removals {
			if oldest == "" || r.At.Before(m.removals[oldest].At) {
				oldest = k
			}
		}
		delete(m.removals, oldest)
	}
	r := Removal{ContainerID: key, At: m.now().UTC()}
	if timings != nil {
		r.Timings = proto.Clone(timings).(*cniv1.PluginTimings)
	}
	m.removals[id] = r
}

// LastRemoval returns the last DEL of namespace/name the agent kept (see
// RemovePod), whether or not the pod still has records.
func (m *Manager) LastRemoval(ns, name string) (Removal, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.removalLocked(ns, name)
}

// removalLocked returns a copy of the kept DEL of ns/name; mu is held.
func (m *Manager) removalLocked(ns, name string) (Removal, bool) {
	r, ok := m.removals[ns+"/"+name]
	if ok && r.Timings != nil {
		r.Timings = proto.Clone(r.Timings).(*cniv1.PluginTimings)
	}
	return r, ok
}

func resultOf(errText string) string {
	if errText != "" {
		return telemetry.ResultError
	}
	return telemetry.ResultSuccess
}

// PodState is a read-only view of one record.
type PodState struct {
	Record     *store.Record
	Registered bool
	Healthy    bool
	// UDSPath is the resolved socket path, UDSRefusal the reason it was
	// refused; both empty when the pod asks for no UDS socket.
	UDSPath    string
	UDSRefusal string
	// LastRemoval is the pod's (namespace/name) last kept DEL, if any: the
	// DEL of an earlier sandbox of the same pod.
	LastRemoval *Removal
}

func (m *Manager) stateLocked(e *entry) PodState {
	s := PodState{Record: e.rec.Clone(), Registered: e.registered, Healthy: e.healthy}
	if r, ok := m.removalLocked(e.rec.Pod.GetNamespace(), e.rec.Pod.GetName()); ok {
		s.LastRemoval = &r
	}
	if p, asked, err := uds.Resolve(m.cfg.UDSRoot, e.rec.Pod); asked {
		var re *uds.RefusalError
		if errors.As(err, &re) {
			s.UDSRefusal = re.Reason
		}
		s.UDSPath = p
	}
	return s
}

// Get returns the durable record of a container.
func (m *Manager) Get(key string) (PodState, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entries[key]
	if e == nil || !e.persisted || e.removed {
		return PodState{}, false
	}
	return m.stateLocked(e), true
}

// List returns every durable record, sorted by namespace, name, container.
func (m *Manager) List() []PodState {
	m.mu.Lock()
	out := make([]PodState, 0, len(m.entries))
	for _, e := range m.entries {
		if e.persisted && !e.removed {
			out = append(out, m.stateLocked(e))
		}
	}
	m.mu.Unlock()
	slices.SortFunc(out, func(a, b PodState) int {
		pa, pb := a.Record.Pod, b.Record.Pod
		if c := compare(pa.GetNamespace(), pb.GetNamespace()); c != 0 {
			return c
		}
		if c := compare(pa.GetName(), pb.GetName()); c != 0 {
			return c
		}
		return compare(pa.GetContainerId(), pb.GetContainerId())
	})
	return out
}

func compare(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
