package pods

import (
	"context"
	"maps"
	"slices"
	"time"

	"aether.io/node/agent/podsource"
	"aether.io/node/agent/store"
	cniv1 "aether.io/node/api/aether/cni/v1"
)

// Handler returns the podsource.Handler that feeds pod changes into m.
func (m *Manager) Handler(ctx context.Context) podsource.Handler { return handler{m: m, ctx: ctx} }

type handler struct {
	m   *Manager
	ctx context.Context
}

func (h handler) OnPod(p *podsource.Pod) {
	if p.Terminating {
		h.m.MarkTerminating(h.ctx, p.Namespace, p.Name, p.UID, "deletion_timestamp")
		return
	}
	h.m.updatePod(h.ctx, p)
}

func (h handler) OnDelete(p *podsource.Pod) {
	h.m.MarkTerminating(h.ctx, p.Namespace, p.Name, p.UID, "deleted")
}

// MarkTerminating marks every record of the pod terminating: under mu
// (so no Register can follow; one in flight is corrected by its re-check)
// and withdrawn from the registry there (so neither a lease re-grant nor
// a retry of that Register puts it back meanwhile), then persisted, then
// deregistered. Records stay until RemovePod.
func (m *Manager) MarkTerminating(ctx context.Context, ns, name, uid, reason string) {
	m.mu.Lock()
	m.terminating[podIdentity(ns, name, uid)] = m.now()
	var marked []*entry
	for _, e := range m.entries {
		if e.removed || !matches(e.rec, ns, name, uid) {
			continue
		}
		if !e.rec.Pod.GetTerminating() {
			r := e.rec.Clone()
			r.Pod.Terminating = true
			e.rec = r
			marked = append(marked, e)
		} else if e.registered {
			marked = append(marked, e)
		}
		m.reg.Withdraw(e.key)
	}
	m.mu.Unlock()
	for _, e := range marked {
		if err := m.persist(ctx, e, nil); err != nil {
			m.log.Error("failed to persist terminating pod", "container_id", e.rec.Key(), "error", err.Error())
		}
		m.deregister(ctx, e)
		m.mu.Lock()
		m.observeLocked(e) // local xDS keeps the pod, UNHEALTHY, until RemovePod
		m.mu.Unlock()
		m.log.Info("pod terminating: endpoint deregistered", "namespace", ns, "name", name, "uid", uid,
			"container_id", e.key, "reason", reason)
	}
}

// updatePod copies changed labels, annotations and service account of a
// live pod into its records and re-registers them; it also fills the uid
// and the declared ports of a record written before those fields existed.
func (m *Manager) updatePod(ctx context.Context, p *podsource.Pod) {
	m.mu.Lock()
	var changed []*entry
	for _, e := range m.entries {
		if e.removed || e.rec.Pod.GetTerminating() || !matches(e.rec, p.Namespace, p.Name, p.UID) {
			continue
		}
		rp := e.rec.Pod
		if maps.Equal(rp.GetLabels(), p.Labels) && maps.Equal(rp.GetAnnotations(), p.Annotations) &&
			rp.GetServiceAccount() == p.ServiceAccount && (rp.GetUid() != "" || p.UID == "") && rp.GetDeclaredPorts() != nil {
			continue
		}
		r := e.rec.Clone()
		r.Pod.Labels, r.Pod.Annotations, r.Pod.ServiceAccount = p.Labels, p.Annotations, p.ServiceAccount
		if r.Pod.Uid == "" {
			r.Pod.Uid = p.UID
		}
		if r.Pod.DeclaredPorts == nil {
			// A record written before the field existed: container
			// ports are immutable, so the source's are the pod's.
			r.Pod.DeclaredPorts = &cniv1.DeclaredPorts{Tcp: p.DeclaredTCPPorts}
		}
		e.rec = r
		changed = append(changed, e)
	}
	m.mu.Unlock()
	for _, e := range changed {
		if err := m.persist(ctx, e, nil); err != nil {
			m.log.Error("failed to persist pod update", "container_id", e.key, "error", err.Error())
			continue
		}
		m.mu.Lock()
		registered, healthy := e.registered, e.healthy
		if !registered {
			m.observeLocked(e)
		}
		m.mu.Unlock()
		if registered {
			m.register(ctx, e, healthy)
		}
		m.log.Info("pod updated", "namespace", p.Namespace, "name", p.Name, "container_id", e.key)
	}
}

// Reconcile marks terminating every record whose pod the (synced) source
// no longer has: the pod was deleted while the agent was not watching.
func (m *Manager) Reconcile(ctx context.Context) {
	live := map[string]*podsource.Pod{}
	for _, p := range m.src.List() {
		live[p.ID()] = p
	}
	m.mu.Lock()
	type gone struct{ ns, name, uid string }
	var missing []gone
	for _, e := range m.entries {
		rp := e.rec.Pod
		if e.removed || rp.GetTerminating() {
			continue
		}
		p, ok := live[rp.GetNamespace()+"/"+rp.GetName()]
		if !ok || (rp.GetUid() != "" && p.UID != "" && p.UID != rp.GetUid()) {
			missing = append(missing, gone{rp.GetNamespace(), rp.GetName(), rp.GetUid()})
		}
	}
	m.mu.Unlock()
	for _, g := range missing {
		m.MarkTerminating(ctx, g.ns, g.name, g.uid, "missing_at_sync")
	}
	for _, p := range live {
		if p.Terminating {
			m.MarkTerminating(ctx, p.Namespace, p.Name, p.UID, "deletion_timestamp")
		} else {
			m.updatePod(ctx, p)
		}
	}
}

// LivenessTick retries the due failed deregistrations, probes every
// stored, live pod and (re-)registers the ones whose endpoint is missing
// from the registry or whose health changed, and sweeps this node's
// registry keys that no live record owns (ghosts). Every registry write
// runs outside mu and checks terminating under it (see register).
func (m *Manager) LivenessTick(ctx context.Context) {
	m.retryDeregistrations(ctx)
	type cand struct {
		e   *entry
		rec *store.Record
	}
	var cands []cand
	m.mu.Lock()
	for _, e := range m.entries {
		if liveLocked(e) {
			cands = append(cands, cand{e, e.rec})
		}
	}
	m.mu.Unlock()
	eps, err := m.reg.List(ctx)
	listed := err == nil
	present := map[string]bool{} // key -> registered health
	if listed {
		for _, ep := range eps {
			present[ep.Key] = ep.Healthy
		}
	} else {
		m.log.Warn("failed to list registry", "error", err.Error())
	}
	health := make([]bool, len(cands))
	for i, c := range cands {
		health[i] = m.prober.Healthy(c.rec)
	}
	reregistered := 0
	for i, c := range cands {
		e := c.e
		m.mu.Lock()
		h, found := present[e.key]
		// The registry holds the served health (UNCAPTURED is served
		// unhealthy; see endpoint).
		served := health[i] && !e.rec.Uncaptured
		skip := m.entries[e.key] != e || !liveLocked(e) || (e.registered && e.healthy == health[i] && found && h == served)
		m.mu.Unlock()
		if skip {
			continue
		}
		if m.register(ctx, e, health[i]) && listed && !found {
			reregistered++
		}
	}
	ghosts := 0
	if listed {
		ghosts = m.sweepGhosts(ctx, eps)
	}
	if reregistered > 0 || ghosts > 0 {
		m.metrics.RegistryReregistered.Add(float64(reregistered))
		m.metrics.RegistryGhostsDeleted.Add(float64(ghosts))
		m.log.Info("registry repaired", "reregistered", reregistered, "ghosts_deleted", ghosts)
	}
	m.mu.Lock()
	m.updateGaugesLocked()
	m.mu.Unlock()
}

func (m *Manager) updateGaugesLocked() {
	var stored, registered, terminating, uncaptured int
	for _, e := range m.entries {
		if e.removed || !e.persisted {
			continue
		}
		stored++
		if e.registered {
			registered++
		}
		if e.rec.Pod.GetTerminating() {
			terminating++
		}
		if e.rec.Uncaptured {
			uncaptured++
		}
	}
	g := m.metrics.Pods
	g.WithLabelValues("stored").Set(float64(stored))
	g.WithLabelValues("registered").Set(float64(registered))
	g.WithLabelValues("terminating").Set(float64(terminating))
	g.WithLabelValues("uncaptured").Set(float64(uncaptured))
	m.metrics.PendingDeregistrations.Set(float64(len(m.retries)))
}

// RunLiveness ticks every interval until ctx ends, and prunes terminating
// marks of pods without records, and kept DELs, after an hour.
func (m *Manager) RunLiveness(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.LivenessTick(ctx)
			m.pruneMarks(time.Hour)
		}
	}
}

func (m *Manager) pruneMarks(age time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	ids := map[string]bool{}
	for _, e := range m.entries {
		p := e.rec.Pod
		ids[podIdentity(p.GetNamespace(), p.GetName(), p.GetUid())] = true
	}
	for _, k := range slices.Collect(maps.Keys(m.terminating)) {
		if !ids[k] && m.now().Sub(m.terminating[k]) > age {
			delete(m.terminating, k)
		}
	}
	for k, r := range m.removals {
		if m.now().Sub(r.At) > age {
			delete(m.removals, k)
		}
	}
}
