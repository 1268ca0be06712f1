package workload

import (
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/resource"
)

// Resource is one workload as it is served: marshalled once per change and
// shared, read-only, by every stream. Never modify a Resource or the
// messages it points to.
type Resource struct {
	// Name is the resource name, the workload uid.
	Name string
	// Version is the content hash of Body (16 hex digits).
	Version string
	// Body is the deterministic wire encoding of the workload.
	Body []byte
	// wireDelta and wireSotW are this resource as a field of a delta and of
	// a SotW response; Body is a sub-slice of both.
	wireDelta, wireSotW []byte
	// Any wraps Body for SotW responses.
	Any *anypb.Any
	// Delta is the resource entry of a delta response.
	Delta *discovery.Resource
}

// NewResource marshals w once (deterministically) and computes its version.
func NewResource(w *workloadpb.Workload) (*Resource, error) {
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(w)
	if err != nil {
		return nil, fmt.Errorf("failed to marshal workload %q: %w", w.GetUid(), err)
	}
	version := strconv.FormatUint(xxhash.Sum64(body), 16)
	wd, ws, value := encodeResource(w.GetUid(), version, body)
	a := &anypb.Any{TypeUrl: resource.WorkloadType, Value: value}
	return &Resource{
		Name:      w.GetUid(),
		Version:   version,
		Body:      value,
		wireDelta: wd,
		wireSotW:  ws,
		Any:       a,
		Delta:     &discovery.Resource{Name: w.GetUid(), Version: version, Resource: a},
	}, nil
}

// Index holds the served workloads by name, each marshalled once, and tells
// the streams watching it which names changed. It keys changes by the
// registry's endpoint key too, because a deregistration only carries that.
//
// Every change costs O(1) marshalling plus O(streams) bookkeeping; nothing
// is rebuilt per change.
type Index struct {
	mu       sync.RWMutex
	byName   map[string]*Resource
	nameKey  map[string]string // name → endpoint key that owns it
	keyName  map[string]string // endpoint key → name
	rev      uint64
	watchers map[*Subscription]struct{}
	onSize   func(int)

	sotwMu   sync.Mutex
	sotwRev  uint64
	sotwList []*Resource
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{
		byName:   make(map[string]*Resource),
		nameKey:  make(map[string]string),
		keyName:  make(map[string]string),
		watchers: make(map[*Subscription]struct{}),
	}
}

// Upsert sets the workload registered under the endpoint key. It validates
// and marshals w once; an unchanged workload (same version) is not pushed.
// A new key for an existing uid (a pod's new sandbox) takes the uid over.
// It reports whether anything changed.
func (x *Index) Upsert(key string, w *workloadpb.Workload) (bool, error) {
	if err := Validate(w); err != nil {
		return false, err
	}
	r, err := NewResource(w)
	if err != nil {
		return false, err
	}
	return x.UpsertResource(key, r), nil
}

// UpsertResource is Upsert for an already marshalled resource.
func (x *Index) UpsertResource(key string, r *Resource) bool {
	now := time.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	changed := false
	if old, ok := x.keyName[key]; ok && old != r.Name {
		// The endpoint was renamed (should not happen for pods): drop the old name.
		delete(x.keyName, key)
		if x.nameKey[old] == key {
			x.deleteLocked(old, now)
			changed = true
		}
	}
	if prevKey, ok := x.nameKey[r.Name]; ok && prevKey != key {
		delete(x.keyName, prevKey)
	}
	x.keyName[key] = r.Name
	x.nameKey[r.Name] = key
	if cur, ok := x.byName[r.Name]; ok && cur.Version == r.Version {
		return changed
	}
	x.byName[r.Name] = r
	x.rev++
	x.notifyLocked(r.Name, now)
	x.sizeLocked()
	return true
}

// Remove deletes the workload registered under the endpoint key. A key that
// no longer owns its uid (the pod got a new sandbox) removes nothing. It
// reports whether anything changed.
func (x *Index) Remove(key string) bool {
	now := time.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	name, ok := x.keyName[key]
	if !ok {
		return false
	}
	delete(x.keyName, key)
	if x.nameKey[name] != key {
		return false
	}
	x.deleteLocked(name, now)
	return true
}

func (x *Index) deleteLocked(name string, now time.Time) {
	delete(x.nameKey, name)
	if _, ok := x.byName[name]; !ok {
		return
	}
	delete(x.byName, name)
	x.rev++
	x.notifyLocked(name, now)
	x.sizeLocked()
}

func (x *Index) sizeLocked() {
	if x.onSize != nil {
		x.onSize(len(x.byName))
	}
}

// Get returns the resource with the given name, or nil.
func (x *Index) Get(name string) *Resource {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.byName[name]
}

// Len returns the number of workloads.
func (x *Index) Len() int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return len(x.byName)
}

// Revision returns a counter that grows with every change.
func (x *Index) Revision() uint64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.rev
}

// Keys returns the endpoint keys the index holds workloads for.
func (x *Index) Keys() []string {
	x.mu.RLock()
	defer x.mu.RUnlock()
	out := make([]string, 0, len(x.keyName))
	for k := range x.keyName {
		out = append(out, k)
	}
	return out
}
