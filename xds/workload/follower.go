package workload

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"aether.io/node/registry"
)

// FollowerSource is the Index source (Index.Writer) a Follower writes as.
const FollowerSource = "registry"

// Follower keeps its share of an Index equal to what a Registry holds: it
// consumes Registry.Watch, builds each endpoint's workload once per change
// and upserts or removes it. It writes as FollowerSource, so it never
// replaces or removes a key another source (the agent's own records) put
// in the index, and its reconcile only removes keys it put itself.
type Follower struct {
	reg registry.Registry
	cfg Config
	idx *Writer
	log *slog.Logger
	// synced is closed once the initial content has been applied.
	synced chan struct{}
}

// NewFollower returns a follower of reg into idx. It does no I/O; call Run.
func NewFollower(reg registry.Registry, cfg Config, idx *Index, log *slog.Logger) *Follower {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Follower{reg: reg, cfg: cfg, idx: idx.Writer(FollowerSource), log: log, synced: make(chan struct{})}
}

// Synced is closed once the registry's content at start has been listed
// into the index.
func (f *Follower) Synced() <-chan struct{} { return f.synced }

// Run follows the registry until ctx ends. If the watch channel closes
// early (the backend gave up), it watches again and reconciles with List so
// that nothing deleted meanwhile stays served; retries back off up to 5 s.
func (f *Follower) Run(ctx context.Context) error {
	backoff := 100 * time.Millisecond
	first := true
	for {
		ch, err := f.reg.Watch(ctx)
		if err == nil {
			if !first {
				err = f.reconcile(ctx)
			}
			if err == nil {
				if first {
					// The initial Puts of Watch plus a List make the content known.
					if err = f.reconcile(ctx); err == nil {
						close(f.synced)
					}
				}
				first = false
				backoff = 100 * time.Millisecond
				f.consume(ctx, ch)
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			f.log.Warn("registry watch failed; retrying", "error", err, "backoff", backoff)
		} else {
			f.log.Warn("registry watch ended early; watching again", "backoff", backoff)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// reconcile lists the registry and applies it: puts every endpoint and
// removes the keys the registry no longer has among those the follower put
// (keys of other sources are never touched).
func (f *Follower) reconcile(ctx context.Context) error {
	eps, err := f.reg.List(ctx)
	if err != nil {
		return fmt.Errorf("failed to list registry: %w", err)
	}
	live := make(map[string]struct{}, len(eps))
	for _, ep := range eps {
		live[ep.Key] = struct{}{}
		f.put(ep)
	}
	for _, k := range f.idx.Keys() {
		if _, ok := live[k]; !ok {
			f.idx.Remove(k)
		}
	}
	return nil
}

func (f *Follower) consume(ctx context.Context, ch <-chan registry.Event) {
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-ch:
			if !ok {
				return
			}
			switch ev.Type {
			case registry.EventPut:
				f.put(ev.Endpoint)
			case registry.EventDelete:
				f.idx.Remove(ev.Key)
			}
		}
	}
}

func (f *Follower) put(ep registry.Endpoint) {
	w, err := Build(f.cfg, ep)
	if err == nil {
		_, err = f.idx.Upsert(ep.Key, w)
	}
	if errors.Is(err, ErrNotOwner) {
		// Another source serves this key (this node's own pod): leave it.
		f.log.Warn("not serving endpoint: the key is served by another source", "key", ep.Key, "namespace", ep.Namespace, "name", ep.Name)
		return
	}
	if err != nil {
		// An endpoint that cannot be served must not keep an older version.
		f.idx.Remove(ep.Key)
		f.log.Warn("not serving endpoint", "key", ep.Key, "namespace", ep.Namespace, "name", ep.Name, "error", err)
	}
}
