package pods

import (
	"context"

	"aether.io/node/registry"
)

// SetLocality makes l the node's known locality (the agent read its Node
// after starting without it): every record that carries another one is
// stored again with l, and every registered endpoint and observed record
// is published again with it. A locality already known and equal is a
// no-op.
func (m *Manager) SetLocality(ctx context.Context, l registry.Locality) {
	m.mu.Lock()
	if !m.localityUnknown && m.locality == l {
		m.mu.Unlock()
		return
	}
	m.locality, m.localityUnknown = l, false
	var es []*entry
	var health []bool
	for _, e := range m.entries {
		if liveLocked(e) && e.registered {
			es = append(es, e)
			health = append(health, e.healthy)
			continue
		}
		// Not registered: published through the observer only (the
		// liveness loop registers what is live).
		m.observeLocked(e)
	}
	m.mu.Unlock()
	m.stampLocality(ctx)
	// register publishes to the registry and, once it succeeds, to the
	// observer; a failure is repaired by the liveness loop like any other.
	m.registerAll(ctx, es, health)
	m.log.Info("node locality set", "region", l.Region, "zone", l.Zone, "subzone", l.Subzone, "pods", len(es))
}

// stampLocality stores again, replayParallel at a time, every record whose
// locality is not the node's known one. Nothing while it is unknown.
func (m *Manager) stampLocality(ctx context.Context) {
	m.mu.Lock()
	if m.localityUnknown {
		m.mu.Unlock()
		return
	}
	l := m.locality
	var stale []*entry
	for _, e := range m.entries {
		if !e.removed && e.persisted && e.rec.Locality != l {
			stale = append(stale, e)
		}
	}
	m.mu.Unlock()
	inParallel(stale, func(_ int, e *entry) {
		m.mu.Lock()
		if e.removed || e.rec.Locality == l {
			m.mu.Unlock()
			return
		}
		rec := e.rec.Clone()
		rec.Locality = l
		e.rec = rec
		m.mu.Unlock()
		if err := m.persist(ctx, e, nil); err != nil {
			m.log.Warn("failed to store the node locality with a pod record", "container_id", e.key, "error", err.Error())
		}
	})
}
