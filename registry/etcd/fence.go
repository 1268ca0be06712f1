package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultTombstoneTTL is how long a deregistered endpoint's tombstone is kept
// when Options.TombstoneTTL is zero.
const DefaultTombstoneTTL = 10 * time.Minute

// maxFenceAttempts bounds the writes of one call whose fence failed: each
// failure means the key changed in etcd since this node last knew it (a
// late write of its own, or its lease's expiry); more than a few in a row
// mean another writer of the same keys.
const maxFenceAttempts = 4

// fence is what this node knows of one endpoint key in etcd: the mod
// revision of its endpoint key and of its tombstone, 0 for absent. A write
// applies only if etcd still has these, and every write changes one of them
// to a new revision, so a write that etcd applies late (one this node gave
// up on) finds them changed and does nothing.
type fence struct{ ep, tomb int64 }

// tombstone is the value of a tombstone key.
type tombstone struct {
	// DeletedAt is when the endpoint was deregistered, by this node's
	// clock; the sweep deletes the tombstone TombstoneTTL later.
	DeletedAt time.Time `json:"deleted_at"`
}

// tombPrefixOf returns the tombstone prefix for an endpoint prefix: beside
// it, not under it, so watchers of the endpoints never see tombstones
// ("/aether/endpoints/" → "/aether/endpoints.tombstones/").
func tombPrefixOf(prefix string) string {
	return strings.TrimSuffix(prefix, "/") + ".tombstones/"
}

func (r *Registry) tombKey(epKey string) string { return r.tombPrefix + r.node + "/" + epKey }

// errFenceContended is wrapped by the error of a write that found its key
// changed in etcd maxFenceAttempts times in a row.
var errFenceContended = errors.New("the key kept changing in etcd under this node")

// fencedWrite applies ops to key's endpoint and tombstone keys in one
// transaction guarded by key's fence, and returns the revision it
// committed. When the fence fails (etcd holds another revision than this
// node knew), it learns the current ones from the same transaction and
// tries again: the caller decided this write last. The caller holds key's
// write mark (lockKey). An error leaves the fence unknown: the next write
// learns it with one more round trip.
func (r *Registry) fencedWrite(ctx context.Context, key string, ops ...clientv3.Op) (int64, error) {
	epKey, tombKey := r.key(key), r.tombKey(key)
	r.mu.Lock()
	f := r.fences[key] // unknown: assume neither exists (a new endpoint)
	delete(r.fences, key)
	r.mu.Unlock()
	for range maxFenceAttempts {
		resp, err := r.cli.Txn(ctx).If(
			clientv3.Compare(clientv3.ModRevision(epKey), "=", f.ep),
			clientv3.Compare(clientv3.ModRevision(tombKey), "=", f.tomb),
		).Then(ops...).Else(
			clientv3.OpGet(epKey, clientv3.WithKeysOnly()),
			clientv3.OpGet(tombKey, clientv3.WithKeysOnly()),
		).Commit()
		if err != nil {
			return 0, err
		}
		if resp.Succeeded {
			return resp.Header.Revision, nil
		}
		f = fence{ep: modRevision(resp.Responses[0]), tomb: modRevision(resp.Responses[1])}
	}
	return 0, fmt.Errorf("%w (%d attempts): is another agent running with node name %q?", errFenceContended, maxFenceAttempts, r.node)
}

// modRevision is the mod revision of the one key a Get in a transaction
// read, 0 if it does not exist.
func modRevision(op *etcdserverpb.ResponseOp) int64 {
	rr := op.GetResponseRange()
	if rr == nil || len(rr.Kvs) == 0 {
		return 0
	}
	return rr.Kvs[0].ModRevision
}

// setFence records what key's fence is after a committed write. mu is not
// held.
func (r *Registry) setFence(key string, f fence) {
	r.mu.Lock()
	r.fences[key] = f
	r.mu.Unlock()
}

// deleteWithTombstone deletes key's endpoint and writes its tombstone with
// the node's lease, granting one if the node has none (it lost it, or has
// not registered since it started): a tombstone without a lease would stay
// in etcd for good if this node never came back to sweep it. The grant
// costs a round trip only then, and waits on nothing the delete does not
// need: an etcd that cannot grant cannot apply the delete either. A
// tombstone fences off a Register of the key that etcd applies after this
// delete.
func (r *Registry) deleteWithTombstone(ctx context.Context, key string) error {
	val, err := json.Marshal(tombstone{DeletedAt: time.Now().UTC()})
	if err != nil {
		return fmt.Errorf("failed to encode the tombstone of %q: %w", key, err)
	}
	for attempt := 0; ; attempt++ {
		lease, err := r.ensureLease(ctx)
		if err != nil {
			return fmt.Errorf("failed to write the tombstone of %q: %w", key, err)
		}
		rev, err := r.fencedWrite(ctx, key, clientv3.OpDelete(r.key(key)), clientv3.OpPut(r.tombKey(key), string(val), clientv3.WithLease(lease)))
		if err == nil {
			r.setFence(key, fence{ep: 0, tomb: rev})
			return nil
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && attempt == 0 {
			r.leaseLost(lease) // expired under us: grant a new one, once
			continue
		}
		return err
	}
}

// sweepTombstones deletes this node's tombstones older than the tombstone
// TTL, every half TTL until the registry is closed. A tombstone whose key
// is being written is left for the next sweep.
func (r *Registry) sweepTombstones() {
	defer r.wg.Done()
	every := max(r.tombTTL/2, time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-r.ctx.Done():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(r.ctx, 30*time.Second)
		n, err := r.sweepOnce(ctx, time.Now())
		cancel()
		switch {
		case err != nil && r.ctx.Err() == nil:
			r.log.Warn("failed to sweep endpoint tombstones; retrying at the next sweep", "error", err, "next_in", every)
		case n > 0:
			r.log.Debug("swept endpoint tombstones", "count", n)
		}
	}
}

// sweepOnce deletes this node's tombstones deleted before now less the
// tombstone TTL and reports how many.
func (r *Registry) sweepOnce(ctx context.Context, now time.Time) (int, error) {
	prefix := r.tombPrefix + r.node + "/"
	resp, err := r.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("failed to list tombstones under %q: %w", prefix, err)
	}
	n := 0
	for _, kv := range resp.Kvs {
		key := strings.TrimPrefix(string(kv.Key), prefix)
		var ts tombstone
		if err := json.Unmarshal(kv.Value, &ts); err != nil {
			r.log.Warn("deleting undecodable endpoint tombstone", "etcd_key", string(kv.Key), "error", err)
		} else if now.Sub(ts.DeletedAt) < r.tombTTL {
			continue
		}
		done, err := r.sweepKey(ctx, key, kv.ModRevision)
		if err != nil {
			return n, err
		}
		if done {
			n++
		}
	}
	return n, nil
}

// sweepKey deletes key's tombstone if it is still the one at rev and no
// write of key is in flight, and forgets key's fence.
func (r *Registry) sweepKey(ctx context.Context, key string, rev int64) (bool, error) {
	r.mu.Lock()
	_, busy := r.writing[key]
	r.mu.Unlock()
	if busy {
		return false, nil
	}
	unlock, err := r.lockKey(ctx, key)
	if err != nil {
		return false, err
	}
	defer unlock()
	tk := r.tombKey(key)
	resp, err := r.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(tk), "=", rev)).Then(clientv3.OpDelete(tk)).Commit()
	if err != nil {
		return false, fmt.Errorf("failed to delete the tombstone of %q: %w", key, err)
	}
	if resp.Succeeded {
		r.mu.Lock()
		delete(r.fences, key)
		r.mu.Unlock()
	}
	return resp.Succeeded, nil
}
