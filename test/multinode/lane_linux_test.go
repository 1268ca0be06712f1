package multinode

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"
)

// agentCount is how many nodes (agents) a lane runs.
const agentCount = 3

// lane is the whole multi-node setup: the etcd cluster, one agent per node
// (each through its own etcd proxy), the pods the test added and the xDS
// checker.
type lane struct {
	t     *testing.T // owns the lane's resources (pods outlive a fault's subtest)
	c     *cluster
	nodes []*node
	chk   *checker
	live  map[*node][]*pod // ADDed and not yet marked terminating
	term  map[*node][]*pod // marked terminating, not yet DELeted
	seq   int
	rnd   *rand.Rand // picks the node a fault hits; nil: the first
	// outageStart is when the current etcd outage began (zero: none);
	// outage is the longest outage since the last settle.
	outageStart time.Time
	outage      time.Duration
}

// newLane starts a three-member cluster, agentCount agents and the
// checker, adds two pods per node and waits until every agent serves them.
func newLane(t *testing.T) *lane {
	t.Helper()
	l := &lane{t: t, c: newCluster(t, 3), live: map[*node][]*pod{}, term: map[*node][]*pod{}}
	for i := range agentCount {
		l.nodes = append(l.nodes, newNode(t, l.c, i))
	}
	l.chk = newChecker(l.nodes)
	t.Cleanup(func() {
		l.chk.stop()
		if t.Failed() {
			for _, n := range l.nodes {
				t.Logf("agent %s logs:\n%s", n.name, n.logs())
			}
		}
	})
	var k checks
	for range 2 {
		l.addPods(t, &k)
	}
	l.settle(t, &k)
	if k.violations > 0 {
		t.Fatalf("the lane did not start clean: %d violations", k.violations)
	}
	return l
}

// down starts an etcd outage (for the settle bound).
func (l *lane) down() { l.outageStart = time.Now() }

// up ends the etcd outage.
func (l *lane) up() {
	if !l.outageStart.IsZero() {
		l.outage = max(l.outage, time.Since(l.outageStart))
		l.outageStart = time.Time{}
	}
}

// addPods adds one pod on every node whose agent runs, through its CNI
// chain, and records whether ADD succeeded and how long it took.
func (l *lane) addPods(t *testing.T, k *checks) {
	t.Helper()
	for _, n := range l.nodes {
		if !n.running() {
			continue
		}
		l.seq++
		name := fmt.Sprintf("web-%s-%d", n.name, l.seq)
		p := n.newPod(l.t, name)
		// Known before ADD: the agent may serve it before ADD returns.
		l.chk.setPhase(p, phaseAdding)
		took, err := n.add(p)
		k.adds++
		k.addMax = max(k.addMax, took)
		k.check(t, err == nil, "ADD of %s on %s failed after %v: %v", name, n.name, took, err)
		if err != nil {
			// As a runtime does after a failed ADD.
			l.chk.setPhase(p, phaseDeleted)
			err := n.del(t, p)
			k.check(t, err == nil, "DEL of %s on %s after its failed ADD: %v", name, n.name, err)
			continue
		}
		l.chk.setPhase(p, phaseLive)
		l.live[n] = append(l.live[n], p)
	}
}

// churn adds a pod on every running node, marks its oldest live pod
// terminating and DELs the pod it marked terminating before.
func (l *lane) churn(t *testing.T, k *checks) {
	t.Helper()
	for _, n := range l.nodes {
		if !n.running() {
			continue
		}
		for _, p := range l.term[n] {
			l.chk.setPhase(p, phaseDeleted)
			err := n.del(t, p)
			k.check(t, err == nil, "DEL of %s on %s: %v", p.name, n.name, err)
		}
		l.term[n] = nil
		if len(l.live[n]) > 1 {
			p := l.live[n][0]
			l.live[n] = l.live[n][1:]
			l.chk.setPhase(p, phaseTerminating)
			n.writePod(t, p.name, p.sbx.UID, time.Now().UTC().Format(time.RFC3339))
			l.term[n] = append(l.term[n], p)
		}
	}
	l.addPods(t, k)
}

// settle waits, within settleBound of the fault's longest outage, until
// every agent serves what the checker expects, and counts the continuous
// checks and violations since the last settle.
func (l *lane) settle(t *testing.T, k *checks) {
	t.Helper()
	l.up()
	bound := settleBound(l.outage)

	l.outage = 0
	start := time.Now()
	deadline := start.Add(bound)
	for {
		miss, pairs := l.chk.unmet()
		if len(miss) == 0 {
			k.run += pairs
			t.Logf("settled in %v (bound %v)", time.Since(start).Round(time.Millisecond), bound)
			break
		}
		if time.Now().After(deadline) {
			k.run += pairs
			for _, m := range miss {
				k.check(t, false, "not settled within %v: %s", bound, m)
			}
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	runs, violations := l.chk.drain()
	k.run += runs
	for _, v := range violations {
		k.check(t, false, "xDS checker: %s", v)
	}
}

// restartAgent stops n's agent with sig and starts it again on the same
// state.
func (l *lane) restartAgent(t *testing.T, n *node, sig syscall.Signal) {
	t.Helper()
	n.stop(sig)
	l.chk.restarting(n)
	n.start(t)
}

// logged reports whether n's current agent logged msg.
func (n *node) logged(msg string) bool {
	return strings.Contains(n.logs(), `"msg":"`+msg+`"`)
}
