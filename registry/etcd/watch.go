package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"aether.io/node/registry"
)

// Rejected returns how many etcd values were ignored because their etcd key
// is not <prefix><node>/<key> or their JSON names another key or node.
func (r *Registry) Rejected() uint64 { return r.rejected.Load() }

// reject counts an ignored value and logs it at WARN once per etcd key.
func (r *Registry) reject(etcdKey, reason string, args ...any) {
	r.rejected.Add(1)
	r.warnMu.Lock()
	_, done := r.warned[etcdKey]
	r.warned[etcdKey] = struct{}{}
	r.warnMu.Unlock()
	if !done {
		r.log.Warn("ignoring etcd endpoint value", append([]any{"etcd_key", etcdKey, "reason", reason}, args...)...)
	}
}

// forget lets the next rejection of a deleted etcd key be logged again, so
// the set of logged keys does not outgrow what etcd holds.
func (r *Registry) forget(etcdKey string) {
	r.warnMu.Lock()
	delete(r.warned, etcdKey)
	r.warnMu.Unlock()
}

// List returns every node's endpoints.
func (r *Registry) List(ctx context.Context) ([]registry.Endpoint, error) {
	return r.list(ctx, r.prefix)
}

// ListNode returns this node's endpoints only: it reads <prefix><node>/,
// so its cost does not grow with the cluster (liveness uses it).
func (r *Registry) ListNode(ctx context.Context) ([]registry.Endpoint, error) {
	return r.list(ctx, r.prefix+r.node+"/")
}

func (r *Registry) list(ctx context.Context, prefix string) ([]registry.Endpoint, error) {
	resp, err := r.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("failed to list endpoints under %q: %w", prefix, err)
	}
	out := make([]registry.Endpoint, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if ep, ok := r.decode(kv); ok {
			out = append(out, ep)
		}
	}
	return out, nil
}

// decode returns the endpoint stored at kv, its key and node taken from the
// etcd key path. A value at a key outside the layout, or whose JSON names
// another key or node, is rejected: a writer cannot take over another
// endpoint key or node by what it puts in the value.
func (r *Registry) decode(kv *mvccpb.KeyValue) (registry.Endpoint, bool) {
	var ep registry.Endpoint
	k := string(kv.Key)
	node, key, ok := r.splitKey(k)
	if !ok {
		r.reject(k, "etcd key outside the <prefix><node>/<key> layout", "prefix", r.prefix)
		return ep, false
	}
	if err := json.Unmarshal(kv.Value, &ep); err != nil {
		r.log.Warn("skipping undecodable endpoint", "etcd_key", k, "error", err)
		return ep, false
	}
	if (ep.Key != "" && ep.Key != key) || (ep.Node != "" && ep.Node != node) {
		r.reject(k, "value key or node differs from its etcd key",
			"value_key", ep.Key, "value_node", ep.Node, "path_key", key, "path_node", node)
		return registry.Endpoint{}, false
	}
	ep.Key, ep.Node = key, node
	return ep, true
}

// Watch sends every node's endpoints as Puts, then every change, until ctx
// ends. It survives disconnects and compaction (see the package doc).
func (r *Registry) Watch(ctx context.Context) (<-chan registry.Event, error) {
	resp, err := r.cli.Get(ctx, r.prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("failed to list endpoints under %q: %w", r.prefix, err)
	}
	out := make(chan registry.Event, 256)
	go r.watch(ctx, resp, out)
	return out, nil
}

type watchState struct {
	r     *Registry
	out   chan<- registry.Event
	known map[string]int64 // etcd key → mod revision delivered
	rev   int64            // last revision delivered
}

func (w *watchState) send(ctx context.Context, ev registry.Event) bool {
	select {
	case w.out <- ev:
		return true
	case <-ctx.Done():
		return false
	}
}

// apply sends a listing as the difference to what was delivered.
func (w *watchState) apply(ctx context.Context, resp *clientv3.GetResponse) bool {
	seen := make(map[string]struct{}, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		k := string(kv.Key)
		if w.known[k] == kv.ModRevision {
			seen[k] = struct{}{}
			continue
		}
		ep, ok := w.r.decode(kv)
		if !ok {
			continue // a delivered key whose value is now rejected is deleted below
		}
		seen[k] = struct{}{}
		w.known[k] = kv.ModRevision
		if !w.send(ctx, registry.Event{Type: registry.EventPut, Key: ep.Key, Endpoint: ep}) {
			return false
		}
	}
	for k := range w.known {
		if _, ok := seen[k]; ok {
			continue
		}
		delete(w.known, k)
		if key, ok := w.r.endpointKey(k); ok {
			if !w.send(ctx, registry.Event{Type: registry.EventDelete, Key: key}) {
				return false
			}
		}
	}
	w.rev = resp.Header.Revision
	return true
}

func (r *Registry) watch(ctx context.Context, initial *clientv3.GetResponse, out chan registry.Event) {
	defer close(out)
	w := &watchState{r: r, out: out, known: make(map[string]int64)}
	if !w.apply(ctx, initial) {
		return
	}
	r.watchLoop(ctx, w)
}

// watchLoop watches from w.rev+1 until ctx ends, resuming after errors and
// listing again after compaction.
func (r *Registry) watchLoop(ctx context.Context, w *watchState) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		relist := false
		// RequireLeader: a member cut off from its cluster's leader ends
		// the watch (ErrNoLeader) instead of keeping it open and silent;
		// the loop resumes, and the client can reach another member.
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := r.cli.Watch(wctx, r.prefix, clientv3.WithPrefix(), clientv3.WithRev(w.rev+1))
		for wr := range wch {
			if wr.CompactRevision != 0 {
				r.log.Warn("etcd watch revision compacted; listing again", "from_revision", w.rev+1, "compact_revision", wr.CompactRevision)
				relist = true
				break
			}
			if err := wr.Err(); err != nil {
				r.log.Warn("etcd watch failed; resuming", "revision", w.rev+1, "error", err)
				break
			}
			backoff = 100 * time.Millisecond
			for _, ev := range wr.Events {
				k := string(ev.Kv.Key)
				var e registry.Event
				switch ev.Type {
				case mvccpb.PUT:
					ep, ok := r.decode(ev.Kv)
					if !ok {
						// A delivered endpoint overwritten by a rejected value
						// is gone; anything else is skipped.
						if _, was := w.known[k]; !was {
							continue
						}
						delete(w.known, k)
						key, _ := r.endpointKey(k)
						e = registry.Event{Type: registry.EventDelete, Key: key}
						break
					}
					w.known[k] = ev.Kv.ModRevision
					e = registry.Event{Type: registry.EventPut, Key: ep.Key, Endpoint: ep}
				case mvccpb.DELETE:
					r.forget(k)
					delete(w.known, k)
					key, ok := r.endpointKey(k)
					if !ok {
						continue
					}
					e = registry.Event{Type: registry.EventDelete, Key: key}
				}
				if !w.send(ctx, e) {
					cancel()
					return
				}
				w.rev = ev.Kv.ModRevision
			}
		}
		cancel()
		if ctx.Err() != nil {
			return
		}
		if relist {
			resp, err := r.cli.Get(ctx, r.prefix, clientv3.WithPrefix())
			if err == nil {
				if !w.apply(ctx, resp) {
					return
				}
				continue
			}
			r.log.Warn("failed to list endpoints after compaction; retrying", "error", err)
			// Keep relisting: watching from a compacted revision cannot work.
			w.rev = 0
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}
