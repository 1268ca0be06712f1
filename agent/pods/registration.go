package pods

import (
	"context"
	"sync"
	"time"

	"aether.io/node/registry"
)

// writeTimeout bounds one registry write (and Replay's registrations all
// together).
const writeTimeout = 5 * time.Second

// replayParallel is how many registrations Replay runs at once.
const replayParallel = 16

// Backoff of the retries of failed deregistrations.
const (
	retryMinBackoff = time.Second
	retryMaxBackoff = 2 * time.Minute
)

// keyLocks orders the registry writes of one endpoint key: every Register
// and Deregister of a key runs holding its lock (and never mu), so writes
// of one key reach the registry in the order they were decided, while
// writes of other keys, AddPod, RemovePod and the admin API go on. Waiting
// for a key's lock honours the waiter's context: a CNI call never waits out
// a background write of its key (up to writeTimeout while etcd is away)
// past its own deadline.
type keyLocks struct {
	mu    sync.Mutex
	locks map[string]*keyLock
}

type keyLock struct {
	held chan struct{} // one slot: the lock
	refs int
}

// lock takes key's write lock and returns its release, or ctx's error if
// ctx ends first.
func (k *keyLocks) lock(ctx context.Context, key string) (unlock func(), err error) {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyLock{}
	}
	l := k.locks[key]
	if l == nil {
		l = &keyLock{held: make(chan struct{}, 1)}
		k.locks[key] = l
	}
	l.refs++
	k.mu.Unlock()
	release := func() {
		k.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
	unlock = func() { <-l.held; release() }
	select { // a free lock is taken even with ctx done: the write decides
	case l.held <- struct{}{}:
		return unlock, nil
	default:
	}
	select {
	case l.held <- struct{}{}:
		return unlock, nil
	case <-ctx.Done():
		release()
		return nil, ctx.Err()
	}
}

// retry is a failed deregistration waiting for its next attempt.
type retry struct {
	next    time.Time
	backoff time.Duration
}

// writeContext is the context of one registry write: not cancelled with
// the request that caused it, bounded by writeTimeout and, when ctx has a
// deadline (a CNI call), by that deadline less a margin, so a slow registry
// never makes AddPod or RemovePod miss their deadline. What such a write
// could not finish, the liveness loop completes: an unregistered live
// record is registered on the next tick, a failed deregistration joins the
// retry set. The margin is a quarter of what is left, at most a second:
// the rest of the call (the record, the reply, the plugin's read) must fit
// in it on a loaded node too (a tenth, at most 250 ms, was too thin at load
// 10: an AddPod during an etcd outage missed aether-cni's 2 s deadline).
func writeContext(ctx context.Context) (context.Context, context.CancelFunc) {
	d := writeTimeout
	if dl, ok := ctx.Deadline(); ok {
		left := time.Until(dl)
		d = min(d, left-min(left/4, time.Second))
	}
	return context.WithTimeout(context.WithoutCancel(ctx), d)
}

// liveLocked reports whether e may be registered: durable, not removed and
// not terminating. mu is held.
func liveLocked(e *entry) bool {
	return e != nil && !e.removed && e.persisted && !e.rec.Pod.GetTerminating()
}

// register publishes e's endpoint with the given health and reports
// whether it is registered afterwards. It follows lock → check → write →
// re-check (agent/README.md, invariant 2).
func (m *Manager) register(ctx context.Context, e *entry, healthy bool) bool {
	wctx, cancel := writeContext(ctx)
	defer cancel()
	return m.registerWith(wctx, e, healthy)
}

// registerWith is register with the write's context already made:
//   - lock: the key's write lock orders this write with every other of the key;
//   - check: under mu, a removed, not yet durable or terminating record is
//     not registered (mu is the lock the pod watch marks terminating under);
//   - write: Register runs without mu;
//   - re-check: under mu again, a record that turned terminating or was
//     removed while the write was in flight gets a corrective Deregister
//     (its own deregistration may have run before this write landed).
func (m *Manager) registerWith(wctx context.Context, e *entry, healthy bool) bool {
	unlock, err := m.writes.lock(wctx, e.key)
	if err != nil {
		// Another write of the key outlived this one's budget; the
		// liveness loop registers what is still missing.
		m.log.Warn("registration deferred to the liveness loop: another write of the key is in flight",
			"container_id", e.key, "error", err.Error())
		return false
	}
	defer unlock()
	m.mu.Lock()
	if !liveLocked(e) {
		m.mu.Unlock()
		return false
	}
	ep := m.endpoint(e.rec, healthy)
	// This write supersedes a pending deregistration of the key (a
	// container re-added after a DEL whose deregistration failed).
	m.cancelRetryLocked(e.key)
	m.mu.Unlock()

	err = m.reg.Register(wctx, ep)

	m.mu.Lock()
	if err != nil {
		e.registered, e.unsure = false, true
		live := liveLocked(e)
		m.mu.Unlock()
		m.log.Error("failed to register endpoint", "container_id", e.key, "error", err.Error())
		if !live {
			// The failed write may still land: correct it as below.
			m.deregisterHeld(context.WithoutCancel(wctx), e)
		}
		return false
	}
	e.registered, e.unsure, e.healthy = true, false, healthy
	if liveLocked(e) {
		m.observeLocked(e)
		m.mu.Unlock()
		return true
	}
	m.mu.Unlock()
	m.log.Info("pod turned terminating or was removed during its registration; deregistering it", "container_id", e.key)
	m.deregisterHeld(context.WithoutCancel(wctx), e) // its own budget, not what is left of wctx
	return false
}

// deregister removes the endpoint of e (terminating or removed) from the
// registry. A failure is retried with backoff (LivenessTick) until it
// succeeds.
//
// The wait for the key's write lock is bounded like the write itself
// (writeContext): when another write of the key holds it longer, the key
// joins the retry set instead.
func (m *Manager) deregister(ctx context.Context, e *entry) {
	lctx, cancel := writeContext(ctx)
	defer cancel()
	unlock, err := m.writes.lock(lctx, e.key)
	if err != nil {
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.deregistrationDueLocked(e) {
			next := m.scheduleRetryLocked(e.key)
			m.log.Error("failed to deregister endpoint; retrying", "container_id", e.key, "reason", "deregister",
				"retry_in", next.String(), "error", "another write of the key is in flight: "+err.Error())
		}
		return
	}
	defer unlock()
	m.deregisterHeld(ctx, e)
}

// deregistrationDueLocked reports whether e's key is to be deleted: e is
// registered (or a Register of it failed), and no newer record of the same container has registered
// the key since. mu is held.
func (m *Manager) deregistrationDueLocked(e *entry) bool {
	cur := m.entries[e.key]
	return (e.registered || e.unsure) && (cur == nil || cur == e || !cur.registered)
}

// deregisterHeld is deregister with e's key write lock held. Nothing is
// written when e is not registered, or when a newer record of the same
// container has registered the key since.
func (m *Manager) deregisterHeld(ctx context.Context, e *entry) {
	m.dropKeyHeld(ctx, e.key, "deregister", func() bool { return m.deregistrationDueLocked(e) })
}

// dropKeyHeld deregisters key, its write lock held, if still() (called
// under mu) holds. On success a pending retry of the key is dropped and
// a record of the key that may not be registered is marked unregistered;
// on failure the key joins the retry set. It reports whether the key was
// deleted.
func (m *Manager) dropKeyHeld(ctx context.Context, key, reason string, still func() bool) bool {
	m.mu.Lock()
	ok := still()
	m.mu.Unlock()
	if !ok {
		return false
	}
	wctx, cancel := writeContext(ctx)
	defer cancel()
	err := m.reg.Deregister(wctx, key)
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		next := m.scheduleRetryLocked(key)
		m.log.Error("failed to deregister endpoint; retrying", "container_id", key, "reason", reason,
			"retry_in", next.String(), "error", err.Error())
		return false
	}
	m.cancelRetryLocked(key)
	if e := m.entries[key]; e != nil && !liveLocked(e) {
		e.registered, e.unsure = false, false
		m.observeLocked(e)
	}
	return true
}

// scheduleRetryLocked puts key in the retry set, doubling its backoff if it
// was there, and returns the backoff. mu is held.
func (m *Manager) scheduleRetryLocked(key string) time.Duration {
	r := m.retries[key]
	if r == nil {
		r = &retry{backoff: retryMinBackoff}
		m.retries[key] = r
	} else {
		r.backoff = min(2*r.backoff, retryMaxBackoff)
	}
	r.next = m.now().Add(r.backoff)
	m.metrics.PendingDeregistrations.Set(float64(len(m.retries)))
	return r.backoff
}

// cancelRetryLocked takes key out of the retry set. mu is held.
func (m *Manager) cancelRetryLocked(key string) {
	if _, ok := m.retries[key]; ok {
		delete(m.retries, key)
		m.metrics.PendingDeregistrations.Set(float64(len(m.retries)))
	}
}

// retryDeregistrations deregisters again every key of the retry set whose
// backoff has passed. The set lives in memory: after a restart the ghost
// sweep finds the same keys (registered, without a live record).
func (m *Manager) retryDeregistrations(ctx context.Context) {
	m.mu.Lock()
	now := m.now()
	var due []string
	for k, r := range m.retries {
		if !now.Before(r.next) {
			due = append(due, k)
		}
	}
	m.mu.Unlock()
	for _, key := range due {
		unlock, err := m.writes.lock(ctx, key)
		if err != nil {
			return // stopping
		}
		if m.dropKeyHeld(ctx, key, "retry", func() bool { _, ok := m.retries[key]; return ok }) {
			m.log.Info("deregistered endpoint after a failed attempt", "container_id", key)
		}
		unlock()
	}
}

// sweepGhosts deletes this node's registry keys (eps, a listing of the
// registry) that no live record owns: a removed or terminating pod whose
// deregistration was lost, for example in an agent restart. Keys waiting
// in the retry set keep their backoff. It returns how many it deleted.
func (m *Manager) sweepGhosts(ctx context.Context, eps []registry.Endpoint) int {
	n := 0
	for _, ep := range eps {
		if ep.Node != m.cfg.Node {
			continue
		}
		m.mu.Lock()
		_, pending := m.retries[ep.Key]
		ghost := !pending && !liveLocked(m.entries[ep.Key])
		m.mu.Unlock()
		if !ghost {
			continue
		}
		unlock, err := m.writes.lock(ctx, ep.Key)
		if err != nil {
			return n // stopping
		}
		// Re-check under the key's lock: the key may have been registered
		// by a live record since the listing.
		if m.dropKeyHeld(ctx, ep.Key, "ghost", func() bool { return !liveLocked(m.entries[ep.Key]) }) {
			n++
			m.log.Info("deleted registry key without a live record", "container_id", ep.Key,
				"namespace", ep.Namespace, "name", ep.Name)
		}
		unlock()
	}
	return n
}

// registerAll registers entries (at Replay and SetLocality) replayParallel
// at a time, all under one writeTimeout: a restart while the registry is
// away waits that long once, not once per pod; the liveness loop registers
// what failed.
func (m *Manager) registerAll(ctx context.Context, es []*entry, healthy []bool) {
	wctx, cancel := writeContext(ctx)
	defer cancel()
	inParallel(es, func(i int, e *entry) { m.registerWith(wctx, e, healthy[i]) })
}

// inParallel calls fn for every entry, replayParallel at a time, and
// returns when every call has.
func inParallel(es []*entry, fn func(i int, e *entry)) {
	sem := make(chan struct{}, replayParallel)
	var wg sync.WaitGroup
	for i, e := range es {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn(i, e)
		}()
	}
	wg.Wait()
}
