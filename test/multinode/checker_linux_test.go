package multinode

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/workload/client"
)

// Correctness bounds of the checker (README.md). They are not performance
// thresholds: each is the sum of the periods and backoff caps that the
// protocol needs in the worst case, with nothing slow.
const (
	// watchBackoffCap is registry/etcd's watch resume backoff cap.
	watchBackoffCap = 5 * time.Second
	// regrantBackoffCap is registry/etcd's lease re-grant backoff cap.
	regrantBackoffCap = 5 * time.Second
	// settleBase bounds how long after a change (an ADD, a terminating
	// mark, a DEL, a healed fault) every agent serves it: a lease lost in
	// the fault is noticed and granted again within leaseTTL and the
	// regrant backoff, a broken watch resumes within its backoff, and the
	// liveness loop registers what a cut write missed (and sweeps ghosts)
	// within two ticks.
	settleBase = leaseTTL + 2*livenessInterval + watchBackoffCap + regrantBackoffCap
)

// settleBound is settleBase plus twice the longest etcd outage of the
// fault: the etcd client's reconnect backoff and the agent's
// deregistration retry backoff double from about a second, so each fires
// within the outage's length after it ends.
func settleBound(outage time.Duration) time.Duration { return settleBase + 2*outage }

// phase is where a pod is in its life, as the test drives it.
type phase int

const (
	// phaseAdding: the manifest is written and ADD is running; nothing is
	// asserted yet, but the pod is known (it may be served before ADD
	// returns).
	phaseAdding phase = iota
	// phaseLive: ADD returned; every agent serves it within the bound
	// (agents of other nodes only while its own agent is alive).
	phaseLive
	// phaseTerminating: marked terminating; gone from every other agent
	// within the bound and, once its own agent has seen the mark (its own
	// xDS serves it UNHEALTHY), never back there; its own agent keeps
	// serving it until DEL. Before that its agent may still register it
	// (a lease re-grant racing the pod source's next poll): the agent
	// cannot skip what it has not seen.
	phaseTerminating
	// phaseDeleted: DEL was issued; gone from every agent within the bound
	// and never back.
	phaseDeleted
)

// podState is what the checker knows of one pod.
type podState struct {
	p     *pod
	phase phase
	// marked: its own agent has seen it terminating (served UNHEALTHY).
	marked bool
}

// view is one agent's workload discovery as the checker sees it across
// the agent's restarts (one stream after another).
type view struct {
	n    *node
	held map[string]workloadpb.WorkloadStatus
	gone map[string]bool // uids seen absent since they stopped being live here
	// stream numbers the streams; responses of an older one are ignored.
	stream int
	fresh  bool // the current stream has not answered yet
}

// checker follows every agent's xDS (a delta wildcard stream each, redialed
// when the agent restarts) and checks the lane's invariants continuously
// (on every response) and at settle points (within a bound):
//   - a live or terminating pod is never removed from its own agent's xDS,
//     across restarts: the first response of a restarted agent holds it;
//   - a deleted pod, or a terminating one (once its own agent serves it
//     UNHEALTHY) on another agent, never comes back after the agent dropped
//     it;
//   - nothing the test did not add is served;
//   - within the bound after a change: every live pod is served by every
//     running agent (a pod of a dead agent by none but its own), every
//     terminating pod by no other agent, every deleted pod by none.
type checker struct {
	mu         sync.Mutex
	pods       map[string]*podState
	views      []*view
	dead       map[*node]bool // agents killed for good: their pods expire elsewhere
	runs       int            // continuous checks since the last drain
	violations []string       // continuous violations since the last drain
	remoteGaps int            // live pods of a live node removed from another agent (restarts, lease loss)

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// newChecker starts following every node's agent; stop ends it.
func newChecker(nodes []*node) *checker {
	ctx, cancel := context.WithCancel(context.Background())
	c := &checker{pods: map[string]*podState{}, dead: map[*node]bool{}, cancel: cancel}
	for _, n := range nodes {
		v := &view{n: n, held: map[string]workloadpb.WorkloadStatus{}, gone: map[string]bool{}}
		c.views = append(c.views, v)
		c.wg.Add(1)
		go c.follow(ctx, v)
	}
	return c
}

func (c *checker) stop() {
	c.cancel()
	c.wg.Wait()
}

// follow keeps one stream open to v's agent, redialing after it ends.
func (c *checker) follow(ctx context.Context, v *view) {
	defer c.wg.Done()
	for ctx.Err() == nil {
		cl, err := client.Dial(ctx, client.Options{Socket: v.n.xdsSocket(), NodeID: "checker-" + v.n.name})
		if err == nil {
			c.mu.Lock()
			v.stream++
			v.fresh = true
			stream := v.stream
			c.mu.Unlock()
			for {
				up, err := cl.Recv()
				if err != nil {
					break
				}
				c.apply(v, stream, up)
			}
			_ = cl.Close()
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// violate records a continuous violation. mu is held.
func (c *checker) violate(format string, args ...any) {
	c.violations = append(c.violations, fmt.Sprintf(time.Now().Format("15:04:05.000 ")+format, args...))
}

// restarting forgets v's current stream: the agent is stopped, and the
// next stream's first response is checked as the restarted agent's state.
func (c *checker) restarting(n *node) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, v := range c.views {
		if v.n == n {
			v.stream++
			v.fresh = true
		}
	}
}

// apply checks and applies one response of v's stream.
func (c *checker) apply(v *view, stream int, up *client.Update) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if stream != v.stream {
		return
	}
	if v.fresh {
		// The first response of a stream is the agent's whole state: what
		// the view held and it lacks was removed while the checker was
		// away (a restart).
		v.fresh = false
		now := map[string]bool{}
		for _, w := range up.Updated {
			now[w.GetUid()] = true
		}
		for _, uid := range slices.Sorted(maps.Keys(v.held)) {
			if !now[uid] {
				c.removed(v, uid, "the first response after a reconnect lacks it")
			}
		}
	}
	for _, uid := range up.Removed {
		c.removed(v, uid, "removed")
	}
	for _, w := range up.Updated {
		uid := w.GetUid()
		c.runs++
		ps := c.pods[uid]
		switch {
		case ps == nil:
			c.violate("%s serves %s, which the test never added", v.n.name, uid)
		case v.gone[uid]:
			c.violate("%s serves %s again (%s) after dropping it", v.n.name, uid, w.GetStatus())
		case ps.p.node == v.n && ps.phase == phaseTerminating && !ps.marked && w.GetStatus() == workloadpb.WorkloadStatus_UNHEALTHY:
			// Its own agent has seen the mark: from now on no other agent
			// may serve it once it dropped it (or while it lacks it).
			ps.marked = true
			for _, o := range c.views {
				if _, held := o.held[uid]; o != v && !held {
					o.gone[uid] = true
				}
			}
		}
		v.held[uid] = w.GetStatus()
	}
}

// removed checks and applies the removal of uid from v. mu is held.
func (c *checker) removed(v *view, uid, how string) {
	if _, ok := v.held[uid]; !ok {
		return
	}
	delete(v.held, uid)
	c.runs++
	ps := c.pods[uid]
	if ps == nil {
		return
	}
	own := ps.p.node == v.n
	switch {
	case own && (ps.phase == phaseLive || ps.phase == phaseTerminating):
		c.violate("%s dropped its own pod %s (%s) before DEL", v.n.name, uid, how)
	case ps.phase == phaseDeleted || ps.phase == phaseTerminating && !own && ps.marked:
		v.gone[uid] = true
	case ps.phase == phaseLive && !c.dead[ps.p.node]:
		c.remoteGaps++
	}
}

// setPhase records a pod's new phase (before the action that causes it).
func (c *checker) setPhase(p *pod, ph phase) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ps := c.pods[p.uid]
	if ps == nil {
		ps = &podState{p: p}
		c.pods[p.uid] = ps
	}
	ps.phase = ph
}

// setDead marks n's agent as killed for good (true) or back (false).
func (c *checker) setDead(n *node, dead bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.dead[n] = dead
}

// unmet lists what the settle invariants still miss, and how many
// (agent, pod) pairs they covered.
func (c *checker) unmet() (miss []string, pairs int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, v := range c.views {
		if !v.n.running() {
			continue
		}
		if v.fresh {
			miss = append(miss, v.n.name+": no response yet from the running agent")
			continue
		}
		for _, uid := range slices.Sorted(maps.Keys(c.pods)) {
			ps := c.pods[uid]
			own := ps.p.node == v.n
			_, held := v.held[uid]
			var want, check bool
			switch ps.phase {
			case phaseAdding:
				continue
			case phaseLive:
				want, check = own || !c.dead[ps.p.node], true
			case phaseTerminating:
				want, check = own, !own
				if own && !ps.marked {
					miss = append(miss, fmt.Sprintf("%s: its terminating pod %s is not served UNHEALTHY", v.n.name, uid))
				}
			case phaseDeleted:
				want, check = false, true
			}
			if !check {
				continue
			}
			pairs++
			if held != want {
				miss = append(miss, fmt.Sprintf("%s: %s served=%v, want %v (phase %d, node %s)", v.n.name, uid, held, want, ps.phase, ps.p.node.name))
			}
		}
	}
	return miss, pairs
}

// drain returns the continuous checks and violations since the last drain.
func (c *checker) drain() (runs int, violations []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	runs, violations = c.runs, c.violations
	c.runs, c.violations = 0, nil
	return runs, violations
}
