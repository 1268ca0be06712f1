package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"aether.io/node/registry"
)

// writeMark is a write of one key in flight (see lockKey).
type writeMark struct {
	done chan struct{} // closed when the write ends
	// cancel ends the context of a put (Register, or the re-registration
	// after a lease loss); nil for a delete or a sweep. Withdraw calls it:
	// the Deregister that follows then sends its fenced delete at once
	// instead of waiting, behind this mark, for a put stalled on a member
	// that etcd cannot reach (a partitioned leader). If etcd applies that
	// put later, its fence fails (the delete and the tombstone changed
	// both revisions) and it does nothing.
	cancel context.CancelFunc
	// withdrawn: Withdraw ended this put. mu is held.
	withdrawn bool
}

// lockKey waits until no other write of key is in flight, or ctx ends,
// and marks one; the returned func ends it. mu is not held.
func (r *Registry) lockKey(ctx context.Context, key string) (unlock func(), err error) {
	_, unlock, err = r.markKey(ctx, key, nil)
	return unlock, err
}

// lockPut is lockKey for a put: it returns the put's context, which
// Withdraw of key cancels (see writeMark), and the mark, whose withdrawn
// tells the put why it failed. The returned func ends the mark and
// releases the context.
func (r *Registry) lockPut(ctx context.Context, key string) (context.Context, *writeMark, func(), error) {
	pctx, cancel := context.WithCancel(ctx)
	m, unlock, err := r.markKey(ctx, key, cancel)
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return pctx, m, func() { unlock(); cancel() }, nil
}

// markKey waits until key has no write mark, or ctx ends, and sets one
// with cancel (nil for a write that Withdraw does not end).
func (r *Registry) markKey(ctx context.Context, key string, cancel context.CancelFunc) (*writeMark, func(), error) {
	for {
		r.mu.Lock()
		busy, ok := r.writing[key]
		if !ok {
			m := &writeMark{done: make(chan struct{}), cancel: cancel}
			r.writing[key] = m
			r.mu.Unlock()
			return m, func() {
				r.mu.Lock()
				delete(r.writing, key)
				r.mu.Unlock()
				close(m.done)
			}, nil
		}
		r.mu.Unlock()
		select {
		case <-busy.done:
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("failed to write endpoint %q: another write of it is in flight: %w", key, ctx.Err())
		}
	}
}

// wasWithdrawn reports whether Withdraw ended the put of mark m.
func (r *Registry) wasWithdrawn(m *writeMark) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return m.withdrawn
}

// Register writes ep under this node with the node's lease.
func (r *Registry) Register(ctx context.Context, ep registry.Endpoint) error {
	if ep.Key == "" || strings.Contains(ep.Key, "/") {
		return fmt.Errorf("failed to register endpoint %q: the key must be non-empty and free of '/'", ep.Key)
	}
	val, err := json.Marshal(ep)
	if err != nil {
		return fmt.Errorf("failed to encode endpoint %q: %w", ep.Key, err)
	}
	pctx, mark, unlock, err := r.lockPut(ctx, ep.Key)
	if err != nil {
		return err
	}
	defer unlock()
	// The entry goes in before the Put so that a lease lost meanwhile is
	// re-granted with it; a failed Register takes it out again.
	r.mu.Lock()
	r.gen++
	gen := r.gen
	var prev *registry.Endpoint
	if old, ok := r.local[ep.Key]; ok {
		prev = old.prev
	}
	r.local[ep.Key] = localEntry{ep: ep, gen: gen, prev: prev}
	r.mu.Unlock()
	err = r.put(pctx, ep, val, gen)
	r.mu.Lock()
	defer r.mu.Unlock()
	if mark.withdrawn && err != nil {
		err = fmt.Errorf("failed to register endpoint %q: %w", ep.Key, errWithdrawn)
	}
	cur, ok := r.local[ep.Key]
	if !ok || cur.gen != gen {
		return err // deregistered or registered again meanwhile
	}
	switch {
	case mark.withdrawn:
		// Withdrawn after this call took the mark, before it put its
		// entry in: no re-grant may write the key back.
		delete(r.local, ep.Key)
	case err == nil:
		committed := ep
		r.local[ep.Key] = localEntry{ep: ep, gen: gen, prev: &committed}
	case prev != nil:
		r.local[ep.Key] = localEntry{ep: *prev, gen: gen, prev: prev}
	default:
		delete(r.local, ep.Key)
	}
	return err
}

// errWithdrawn is wrapped by the error of a Register whose key was
// withdrawn (or deregistered) before its next attempt.
var errWithdrawn = errors.New("withdrawn while its registration was in flight")

// put writes ep's encoded value val with the node's lease, granting a new
// lease once if etcd no longer has it. Before each attempt it checks that
// the key's local entry is still gen: a key withdrawn meanwhile is not
// written (a lease grant can take long, and the old lease's expiry may
// have deleted the key by then).
func (r *Registry) put(ctx context.Context, ep registry.Endpoint, val []byte, gen uint64) error {
	for attempt := 0; ; attempt++ {
		lease, err := r.ensureLease(ctx)
		if err != nil {
			return err
		}
		r.mu.Lock()
		cur, ok := r.local[ep.Key]
		r.mu.Unlock()
		if !ok || cur.gen != gen {
			return fmt.Errorf("failed to register endpoint %q: %w", ep.Key, errWithdrawn)
		}
		rev, err := r.fencedWrite(ctx, ep.Key, clientv3.OpPut(r.key(ep.Key), string(val), clientv3.WithLease(lease)), clientv3.OpDelete(r.tombKey(ep.Key)))
		if err == nil {
			r.setFence(ep.Key, fence{ep: rev})
			return nil
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && attempt == 0 {
			r.leaseLost(lease)
			continue
		}
		return fmt.Errorf("failed to register endpoint %q in etcd: %w", ep.Key, err)
	}
}

// Withdraw forgets key locally: no lease re-grant writes it back, and a
// put of it in flight (Register, or the re-registration after a lease
// loss) is cancelled, so it makes no further attempt and the Deregister
// that follows need not wait for it (see writeMark). A put already sent
// may still land, before that Deregister's delete (which then deletes it)
// or after it (then its fence fails and it does nothing).
func (r *Registry) Withdraw(key string) {
	r.mu.Lock()
	delete(r.local, key)
	if m := r.writing[key]; m != nil && m.cancel != nil {
		m.withdrawn = true
		m.cancel()
	}
	r.mu.Unlock()
}

// Deregister deletes the endpoint at once. It is withdrawn first, even if
// the delete fails, so no lease re-grant writes it back; a write of the key
// in flight (which etcd may still apply) ends before the delete is sent.
func (r *Registry) Deregister(ctx context.Context, key string) error {
	r.Withdraw(key)
	unlock, err := r.lockKey(ctx, key)
	if err != nil {
		return fmt.Errorf("failed to deregister endpoint %q from etcd: %w", key, err)
	}
	defer unlock()
	if err := r.deleteWithTombstone(ctx, key); err != nil {
		return fmt.Errorf("failed to deregister endpoint %q from etcd: %w", key, err)
	}
	return nil
}
