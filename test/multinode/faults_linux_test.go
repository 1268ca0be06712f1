package multinode

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// recovery bounds how long the cluster may take to serve writes again, and a
// restarted or healed member to catch up, after a fault.
const recovery = 30 * time.Second

// checks counts invariant checks and violations of one fault.
type checks struct{ run, violations int }

// check records one invariant check.
func (k *checks) check(t *testing.T, ok bool, format string, args ...any) {
	t.Helper()
	k.run++
	if !ok {
		k.violations++
		t.Errorf(format, args...)
	}
}

// writable waits until a write succeeds and records whether it did in time.
func (c *cluster) writable(t *testing.T, k *checks, key string) {
	t.Helper()
	deadline := time.Now().Add(recovery)
	var err error
	for time.Now().Before(deadline) {
		if err = c.put(key, "v"); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	k.check(t, err == nil, "write %q not accepted within %v: %v", key, recovery, err)
}

// caughtUp waits until m serves, from its own state, the revision the
// cluster is at and records whether it did in time.
func (c *cluster) caughtUp(t *testing.T, k *checks, m *member) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	want, err := c.client.Get(ctx, "/health")
	cancel()
	if err != nil {
		k.check(t, false, "failed to read cluster revision: %v", err)
		return
	}
	deadline := time.Now().Add(recovery)
	var got int64
	for time.Now().Before(deadline) {
		if st, err := c.status(m); err == nil {
			got = st.Header.Revision
			if got >= want.Header.Revision {
				break
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	k.check(t, got >= want.Header.Revision, "member %s at revision %d, cluster at %d after %v", m.name, got, want.Header.Revision, recovery)
}

// follower returns a running member that is not the leader.
func (c *cluster) follower(leader *member) *member {
	for _, m := range c.members {
		if m != leader && m.cmd != nil {
			return m
		}
	}
	c.t.Fatal("no follower")
	return nil
}

// fault is one injected etcd fault and the invariants checked around it.
type fault struct {
	name string
	nft  bool
	run  func(t *testing.T, c *cluster, k *checks)
}

var faults = []fault{
	{name: "kill9_member", run: func(t *testing.T, c *cluster, k *checks) {
		m := c.follower(c.leader(recovery))
		c.stop(m, syscall.SIGKILL)
		c.writable(t, k, "/fault/kill9_member/during")
		c.start(m)
		c.writable(t, k, "/fault/kill9_member/after")
		c.caughtUp(t, k, m)
	}},
	{name: "kill9_leader", run: func(t *testing.T, c *cluster, k *checks) {
		l := c.leader(recovery)
		c.stop(l, syscall.SIGKILL)
		n := c.leader(recovery)
		k.check(t, n != l, "leader %s still leader after kill -9", l.name)
		c.writable(t, k, "/fault/kill9_leader/during")
		c.start(l)
		c.writable(t, k, "/fault/kill9_leader/after")
		c.caughtUp(t, k, l)
	}},
	{name: "all_down", run: func(t *testing.T, c *cluster, k *checks) {
		for _, m := range c.members {
			c.stop(m, syscall.SIGKILL)
		}
		k.check(t, c.put("/fault/all_down/during", "v") != nil, "write accepted with every member down")
		for _, m := range c.members {
			c.start(m)
		}
		c.writable(t, k, "/fault/all_down/after")
		for _, m := range c.members {
			c.caughtUp(t, k, m)
		}
	}},
	{name: "partition_leader", nft: true, run: func(t *testing.T, c *cluster, k *checks) {
		l := c.leader(recovery)
		c.partition(l)
		all := c.client
		c.client = c.newClient(l)
		c.writable(t, k, "/fault/partition_leader/during")
		c.heal(l)
		c.client = all
		c.writable(t, k, "/fault/partition_leader/after")
		c.caughtUp(t, k, l)
	}},
	{name: "compaction_during_partition", nft: true, run: func(t *testing.T, c *cluster, k *checks) {
		f := c.follower(c.leader(recovery))
		st, err := c.status(f)
		if err != nil {
			t.Fatalf("failed to get status of %s: %v", f.name, err)
		}
		c.partition(f)
		all := c.client
		c.client = c.newClient(f)
		for i := range 50 {
			c.writable(t, k, fmt.Sprintf("/fault/compaction/%d", i))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := c.client.Get(ctx, "/health")
		if err == nil {
			_, err = c.client.Compact(ctx, resp.Header.Revision, clientv3.WithCompactPhysical())
		}
		cancel()
		k.check(t, err == nil, "failed to compact past %s's revision %d: %v", f.name, st.Header.Revision, err)
		c.heal(f)
		c.client = all
		c.writable(t, k, "/fault/compaction/after")
		c.caughtUp(t, k, f)
	}},
}

// TestEtcdFaults injects each fault into its own three-member cluster and
// prints a table of faults, invariant checks and violations.
func TestEtcdFaults(t *testing.T) {
	type row struct {
		name string
		k    checks
	}
	var rows []row
	_, nftErr := exec.LookPath("nft")
	for _, f := range faults {
		t.Run(f.name, func(t *testing.T) {
			if f.nft && nftErr != nil {
				t.Fatalf("the partition faults need nft (make deps installs nftables): %v", nftErr)
			}
			start := time.Now()
			c := newCluster(t, 3)
			var k checks
			f.run(t, c, &k)
			rows = append(rows, row{f.name, k})
			t.Logf("%s took %v", f.name, time.Since(start).Round(time.Millisecond))
		})
	}
	t.Logf("%-28s %5s %6s %10s", "fault", "count", "checks", "violations")
	for _, r := range rows {
		t.Logf("%-28s %5d %6d %10d", r.name, 1, r.k.run, r.k.violations)
	}
}

var (
	seedFlag  = flag.Int64("multinode.seed", 0, "seed of TestEtcdFaultsRandomized (0: from the clock; printed)")
	stepsFlag = flag.Int("multinode.steps", 4, "faults TestEtcdFaultsRandomized injects one after another")
	soakFlag  = flag.Duration("multinode.soak", 0, "keep TestEtcdFaultsRandomized injecting faults for this long (overrides -multinode.steps)")
)

// TestEtcdFaultsRandomized injects faults drawn from faults, in an order
// drawn from a seed, one after another into one three-member cluster
// (each fault leaves the cluster whole, so the next starts from a healed
// cluster with history). The seed is printed, and named again on failure:
// rerun with -multinode.seed=<seed>. make test runs -multinode.steps (4)
// faults from a fresh seed; -multinode.soak=30m is the long soak.
func TestEtcdFaultsRandomized(t *testing.T) {
	seed := *seedFlag
	if seed == 0 {
		seed = time.Now().UnixNano()
	}
	t.Logf("seed %d (rerun: go test ./test/multinode -run TestEtcdFaultsRandomized -multinode.seed=%d)", seed, seed)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("FAILED with seed %d: rerun with -multinode.seed=%d", seed, seed)
		}
	})
	if _, err := exec.LookPath("nft"); err != nil {
		t.Fatalf("the partition faults need nft (make deps installs nftables): %v", err)
	}
	rnd := rand.New(rand.NewPCG(uint64(seed), 0))
	c := newCluster(t, 3)
	count := map[string]int{}
	var k checks
	start := time.Now()
	for step := 0; ; step++ {
		if *soakFlag > 0 && time.Since(start) >= *soakFlag || *soakFlag <= 0 && step >= *stepsFlag {
			break
		}
		f := faults[rnd.IntN(len(faults))]
		before := k
		t.Logf("step %d: %s", step, f.name)
		f.run(t, c, &k)
		count[f.name]++
		if k.violations > before.violations {
			t.Fatalf("step %d (%s) broke an invariant; seed %d", step, f.name, seed)
		}
	}
	t.Logf("%-28s %5s", "fault", "count")
	for _, f := range faults {
		t.Logf("%-28s %5d", f.name, count[f.name])
	}
	t.Logf("%d checks, %d violations, %v", k.run, k.violations, time.Since(start).Round(time.Millisecond))
}
