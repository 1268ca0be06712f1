package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Revoke revokes this node's lease, deleting all its endpoints at once.
func (r *Registry) Revoke(ctx context.Context) error {
	// A grant in flight would install a lease after this.
	if err := r.lockGrant(ctx); err != nil {
		return fmt.Errorf("failed to revoke the lease of node %q: %w", r.node, err)
	}
	defer r.unlockGrant()
	r.mu.Lock()
	lease := r.lease
	r.lease = 0
	r.local = make(map[string]localEntry)
	r.fences = make(map[string]fence) // the revoke deletes keys and tombstones
	r.mu.Unlock()
	if lease == 0 {
		return nil
	}
	if _, err := r.cli.Revoke(ctx, lease); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("failed to revoke lease %x: %w", int64(lease), err)
	}
	return nil
}

// lockGrant takes the grant lock, or returns ctx's error if ctx ends first.
func (r *Registry) lockGrant(ctx context.Context) error {
	select {
	case r.grant <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r *Registry) unlockGrant() { <-r.grant }

// currentLease returns the node's lease, 0 if there is none.
func (r *Registry) currentLease() clientv3.LeaseID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lease
}

// ensureLease returns the node's lease, granting it and starting its
// keepalive if there is none. Grants run one at a time under the grant lock
// (waited for no longer than ctx allows), never
// under mu (see Registry).
func (r *Registry) ensureLease(ctx context.Context) (clientv3.LeaseID, error) {
	if lease := r.currentLease(); lease != 0 {
		return lease, nil
	}
	if err := r.lockGrant(ctx); err != nil {
		return 0, fmt.Errorf("failed to grant etcd lease (TTL %ds): waiting for the grant in flight: %w", r.ttl, err)
	}
	defer r.unlockGrant()
	if lease := r.currentLease(); lease != 0 {
		return lease, nil // granted while this call waited
	}
	if r.ctx.Err() != nil {
		return 0, errors.New("failed to grant lease: the registry is closed")
	}
	resp, err := r.cli.Grant(ctx, r.ttl)
	if err != nil {
		return 0, fmt.Errorf("failed to grant etcd lease (TTL %ds): %w", r.ttl, err)
	}
	ka, err := r.cli.KeepAlive(r.ctx, resp.ID)
	if err != nil {
		return 0, fmt.Errorf("failed to keep etcd lease %x alive: %w", int64(resp.ID), err)
	}
	r.mu.Lock()
	r.lease = resp.ID
	r.mu.Unlock()
	r.log.Info("granted etcd lease", "lease", int64(resp.ID), "ttl_seconds", r.ttl)
	r.wg.Add(1)
	go r.keepAlive(resp.ID, ka)
	return resp.ID, nil
}

// keepAlive drains the keepalive responses; when the channel closes while
// the registry is open, the lease is gone: grant a new one and write this
// node's endpoints again, retrying with backoff.
func (r *Registry) keepAlive(lease clientv3.LeaseID, ka <-chan *clientv3.LeaseKeepAliveResponse) {
	defer r.wg.Done()
	for range ka {
	}
	if r.ctx.Err() != nil {
		return
	}
	r.log.Warn("etcd lease lost; granting a new one and registering again", "lease", int64(lease))
	r.leaseLost(lease)
	backoff := 200 * time.Millisecond
	for r.ctx.Err() == nil {
		if err := r.reRegister(); err == nil {
			return
		} else {
			r.log.Warn("failed to register again after losing the lease", "error", err, "backoff", backoff)
		}
		select {
		case <-r.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

func (r *Registry) leaseLost(lease clientv3.LeaseID) {
	r.mu.Lock()
	if r.lease == lease {
		r.lease = 0
	}
	r.mu.Unlock()
}

// reRegister grants a lease (which starts a new keepalive loop) and puts
// every local endpoint with it.
func (r *Registry) reRegister() error {
	ctx, cancel := context.WithTimeout(r.ctx, 10*time.Second)
	defer cancel()
	lease, err := r.ensureLease(ctx)
	if err != nil {
		return err
	}
	r.mu.Lock()
	keys := make([]string, 0, len(r.local))
	for k := range r.local {
		keys = append(keys, k)
	}
	r.mu.Unlock()
	for _, k := range keys {
		if err := r.reRegisterKey(ctx, k, lease); err != nil {
			return err
		}
	}
	return nil
}

// reRegisterKey puts key's local endpoint with lease, its write lock held,
// unless it was deregistered meanwhile.
func (r *Registry) reRegisterKey(ctx context.Context, key string, lease clientv3.LeaseID) error {
	pctx, mark, unlock, err := r.lockPut(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	r.mu.Lock()
	e, still := r.local[key]
	r.mu.Unlock()
	if !still {
		return nil
	}
	val, err := json.Marshal(e.ep)
	if err != nil {
		return fmt.Errorf("failed to encode endpoint %q: %w", key, err)
	}
	rev, err := r.fencedWrite(pctx, key, clientv3.OpPut(r.key(key), string(val), clientv3.WithLease(lease)), clientv3.OpDelete(r.tombKey(key)))
	if err != nil {
		if r.wasWithdrawn(mark) {
			return nil // deregistered meanwhile: nothing to write back
		}
		return fmt.Errorf("failed to register endpoint %q again: %w", key, err)
	}
	r.setFence(key, fence{ep: rev})
	return nil
}
