// Package local is the embedded single-node registry.Registry: endpoints live
// in memory in this process, and Watch followers get every change in order.
// It is the agent's default backend; the agent rebuilds it from its durable
// store on start (replay), so it needs no persistence of its own.
package local

import (
	"context"
	"sort"
	"sync"

	"aether.io/node/registry"
)

// Registry is an in-memory registry.Registry. The zero value is not usable;
// call New.
type Registry struct {
	mu        sync.Mutex
	endpoints map[string]registry.Endpoint
	watchers  map[*watcher]struct{}
}

type watcher struct {
	mu     sync.Mutex
	cond   *sync.Cond
	queue  []registry.Event
	closed bool
}

var _ registry.Registry = (*Registry)(nil)

// New returns an empty registry.
func New() *Registry {
	return &Registry{endpoints: map[string]registry.Endpoint{}, watchers: map[*watcher]struct{}{}}
}

func cloneEndpoint(ep registry.Endpoint) registry.Endpoint {
	c := ep
	c.IPs = append(c.IPs[:0:0], ep.IPs...)
	if ep.Labels != nil {
		c.Labels = make(map[string]string, len(ep.Labels))
		for k, v := range ep.Labels {
			c.Labels[k] = v
		}
	}
	if ep.Owner != nil {
		o := *ep.Owner
		c.Owner = &o
	}
	return c
}

// Register creates or replaces ep.
func (r *Registry) Register(ctx context.Context, ep registry.Endpoint) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ep = cloneEndpoint(ep)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.endpoints[ep.Key] = ep
	r.broadcast(registry.Event{Type: registry.EventPut, Key: ep.Key, Endpoint: ep})
	return nil
}

// Withdraw does nothing: the embedded registry writes only when it is
// called (it has no lease to re-grant), and its Register has no attempt
// left once it returns.
func (r *Registry) Withdraw(string) {}

// Deregister removes the endpoint with key; an unknown key is not an error
// and sends no event.
func (r *Registry) Deregister(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.endpoints[key]; !ok {
		return nil
	}
	delete(r.endpoints, key)
	r.broadcast(registry.Event{Type: registry.EventDelete, Key: key})
	return nil
}

// Get returns the endpoint with key.
func (r *Registry) Get(key string) (registry.Endpoint, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ep, ok := r.endpoints[key]
	if !ok {
		return registry.Endpoint{}, false
	}
	return cloneEndpoint(ep), true
}

// List returns every endpoint, sorted by key.
func (r *Registry) List(ctx context.Context) ([]registry.Endpoint, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]registry.Endpoint, 0, len(r.endpoints))
	for _, ep := range r.endpoints {
		out = append(out, cloneEndpoint(ep))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

// Watch sends the current content as Put events, then every change, until
// ctx ends. A slow follower never blocks writers: events queue per watcher.
func (r *Registry) Watch(ctx context.Context) (<-chan registry.Event, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	w := &watcher{}
	w.cond = sync.NewCond(&w.mu)
	r.mu.Lock()
	keys := make([]string, 0, len(r.endpoints))
	for k := range r.endpoints {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		ep := cloneEndpoint(r.endpoints[k])
		w.queue = append(w.queue, registry.Event{Type: registry.EventPut, Key: k, Endpoint: ep})
	}
	r.watchers[w] = struct{}{}
	r.mu.Unlock()

	out := make(chan registry.Event)
	go func() {
		<-ctx.Done()
		r.mu.Lock()
		delete(r.watchers, w)
		r.mu.Unlock()
		w.mu.Lock()
		w.closed = true
		w.cond.Broadcast()
		w.mu.Unlock()
	}()
	go func() {
		defer close(out)
		for {
			w.mu.Lock()
			for len(w.queue) == 0 && !w.closed {
				w.cond.Wait()
			}
			if w.closed {
				w.mu.Unlock()
				return
			}
			ev := w.queue[0]
			w.queue = w.queue[1:]
			w.mu.Unlock()
			select {
			case out <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// broadcast queues ev for every watcher; r.mu is held.
func (r *Registry) broadcast(ev registry.Event) {
	for w := range r.watchers {
		w.mu.Lock()
		if ev.Type == registry.EventPut {
			ev.Endpoint = cloneEndpoint(ev.Endpoint)
		}
		w.queue = append(w.queue, ev)
		w.cond.Signal()
		w.mu.Unlock()
	}
}
