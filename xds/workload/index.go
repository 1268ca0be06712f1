package workload

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	workloadpb "aether.io/node/api/istio/workload"
	"aether.io/node/xds/resource"
)

// Resource is one resource as it is served: marshalled once per change
// and shared, read-only, by every stream. Never modify a Resource or the
// messages it points to.
type Resource struct {
	// Name is the resource name (a workload uid, or a Service's
	// <namespace>/<hostname>).
	Name string
	// hash is the content hash Version spells; next to Name, so a
	// reconnect's in-order comparison reads one cache line of a resource.
	hash uint64
	// Version is the content hash of Body in lowercase hex (up to 16
	// digits, no leading zeros).
	Version string
	// Body is the deterministic wire encoding of the resource (the Any's
	// value).
	Body []byte
	// frame is laid out at the first send (framed): a resource of a view
	// no stream subscribes to (the Workload view where every client
	// takes Addresses) never holds one.
	frame atomic.Pointer[frame]
	// address is, for a workload made by NewResource, its
	// Address{workload} encoding: a header, then Body, in one allocation
	// (Body is its tail), so the Address view serves the same bytes, never
	// a copy. Nil otherwise.
	address []byte
	// typ is the type the resource is served as (typeURLs).
	typ uint8
}

// typeURLs are the types a Resource is served as, by Resource.typ.
var typeURLs = [...]string{resource.WorkloadType, resource.AddressType, resource.AuthorizationType}

// typeIndex is typeURL's index in typeURLs; the index serves no other type.
func typeIndex(typeURL string) uint8 {
	for i, t := range typeURLs {
		if t == typeURL {
			return uint8(i)
		}
	}
	panic("xds/workload: no resource type " + typeURL)
}

// typeURL is the type the resource is served as.
func (r *Resource) typeURL() string { return typeURLs[r.typ] }

// addressBytes returns a workload's Address{workload} encoding (header
// then Body, one allocation); nil for a resource NewResource did not make.
func (r *Resource) addressBytes() []byte { return r.address }

// Any returns Body wrapped for a SotW response. It is built at each call
// (the server's codec sends the pre-encoded parts, so only a server
// without it marshals typed responses), so nothing is kept for it.
func (r *Resource) Any() *anypb.Any { return &anypb.Any{TypeUrl: r.typeURL(), Value: r.Body} }

// Delta returns the resource entry of a delta response, built at each
// call as Any.
func (r *Resource) Delta() *discovery.Resource {
	return &discovery.Resource{Name: r.Name, Version: r.Version, Resource: r.Any()}
}

// frame is the bytes around a resource's Body, pre then suf in one
// slice: pre (b[:preLen]) and suf (b[preLen:]) frame it as a field of a
// delta response; pre[sotwAt:] and Body are a field of a SotW response
// (encodeFrame).
type frame struct {
	b              []byte
	preLen, sotwAt int32
}

// framed returns r's frame, laying it out once, at r's first send (when
// several streams race, one layout wins and the others are dropped).
func (r *Resource) framed() *frame {
	if f := r.frame.Load(); f != nil {
		return f
	}
	b, preLen, sotwAt := encodeFrame(r.typeURL(), r.Name, r.Version, len(r.Body))
	f := &frame{b: b, preLen: int32(preLen), sotwAt: int32(sotwAt)}
	if r.frame.CompareAndSwap(nil, f) {
		return f
	}
	return r.frame.Load()
}

// appendDelta appends r's delta-response field, as parts.
func (r *Resource) appendDelta(parts [][]byte) [][]byte {
	f := r.framed()
	return append(parts, f.b[:f.preLen:f.preLen], r.Body, f.b[f.preLen:])
}

// appendSotW appends r's SotW-response field, as parts.
func (r *Resource) appendSotW(parts [][]byte) [][]byte {
	f := r.framed()
	return append(parts, f.b[f.sotwAt:f.preLen:f.preLen], r.Body)
}

// slotted is a served name's entry in Index.byName: its slot in
// Index.bySlot, and the version hash inline, so a reconnect compares a
// client's versions without touching the resources it does not send.
//
// Slots are dense (a name keeps its slot while it is served; a freed slot
// is handed out again first): a reconnect marks the names a client holds
// in a slice indexed by slot, not a map, and full states are sent in slot
// order, so a client that keeps versions in the order it received them
// sends them back in that order, which the index then reads sequentially
// (see selectKnown).
type slotted struct {
	hash uint64
	slot int
}

// NewResource marshals w once (deterministically) and computes its version.
// The bytes are laid out once as Address{workload}, so the Address view
// serves them too (Index.Addresses) without a copy.
func NewResource(w *workloadpb.Workload) (*Resource, error) {
	o := proto.MarshalOptions{Deterministic: true}
	size := o.Size(w)
	hdr := protowire.SizeTag(fieldAddressWorkload) + protowire.SizeVarint(uint64(size))
	buf := protowire.AppendTag(make([]byte, 0, hdr+size), fieldAddressWorkload, protowire.BytesType)
	buf = protowire.AppendVarint(buf, uint64(size))
	buf, err := o.MarshalAppend(buf, w)
	if err != nil {
		return nil, fmt.Errorf("failed to marshal workload %q: %w", w.GetUid(), err)
	}
	if len(buf) != hdr+size {
		return nil, fmt.Errorf("failed to marshal workload %q: %d bytes, sized %d", w.GetUid(), len(buf)-hdr, size)
	}
	r := newResource(resource.WorkloadType, w.GetUid(), buf[hdr:])
	r.address = buf
	return r, nil
}

// newResource is the resource name of typeURL whose value is body (kept,
// not copied), framed at its first send.
func newResource(typeURL, name string, body []byte) *Resource {
	hash := xxhash.Sum64(body)
	version := strconv.FormatUint(hash, 16)
	return &Resource{
		Name:    name,
		Version: version,
		Body:    body,
		typ:     typeIndex(typeURL),
		hash:    hash,
	}
}

// Index holds the served workloads by name, each marshalled once, and tells
// the streams watching it which names changed. It keys changes by the
// registry's endpoint key too, because a deregistration only carries that.
//
// Ownership: every endpoint key belongs to the source that put it (the
// agent's own records, the follower of the shared registry, ...; see
// Writer) until that source removes it. A source can neither replace nor
// remove another source's key, so local and remote workloads cannot erase
// each other. When several keys claim one uid (a pod's new sandbox, or the
// same pod seen through two sources) the newest upsert is served, and
// removing it serves the newest remaining claimant instead of nothing.
//
// Every change costs O(1) marshalling plus O(streams) bookkeeping; nothing
// is rebuilt per change.
type Index struct {
	typeURL string
	// addr is the Address view of a workload index (nil for the Address
	// index itself): every served workload is mirrored into it as an
	// Address, next to the Services written there (see Addresses).
	addr *Index
	// authz is the Authorization view of a workload index (nil for the
	// views themselves): see Authorizations.
	authz *Index
	// members says which Services each workload belongs to (nil: none);
	// see SetMembership.
	members Membership

	mu       sync.RWMutex
	byName   map[string]slotted   // served name → its slot in bySlot
	bySlot   []*Resource          // served resources by slot; nil: a free slot
	nameKey  map[string]string    // name → endpoint key whose resource is served
	keys     map[string]*keyEntry // endpoint key → its source and resource
	claims   map[string][]string  // name → endpoint keys claiming it
	seq      uint64               // last keyEntry.seq handed out
	rev      uint64
	free     []int // empty slots of bySlot, handed out again first
	watchers map[*Subscription]struct{}
	onSize   func(int)

	sotwMu   sync.Mutex
	sotwRev  uint64
	sotwList []*Resource
}

// keyEntry is what one endpoint key holds: its source, the uid it claims
// and its resource; seq orders the claimants of a uid (newest served).
// A lazy claim (Writer.UpsertLazy) holds no resource while another claim
// of its uid is served: build makes its workload when it is to be served.
type keyEntry struct {
	source string
	name   string
	res    *Resource
	build  func() *workloadpb.Workload
	seq    uint64
}

// ErrNotOwner is returned by Writer.Upsert for an endpoint key that another
// source put in the index.
var ErrNotOwner = errors.New("endpoint key belongs to another source")

// NewIndex returns an empty index of workloads (resource.WorkloadType)
// with its Address view (Addresses).
func NewIndex() *Index {
	x := newIndex(resource.WorkloadType)
	x.addr = newIndex(resource.AddressType)
	x.authz = newIndex(resource.AuthorizationType)
	return x
}

func newIndex(typeURL string) *Index {
	return &Index{
		typeURL:  typeURL,
		byName:   make(map[string]slotted),
		nameKey:  make(map[string]string),
		keys:     make(map[string]*keyEntry),
		claims:   make(map[string][]string),
		watchers: make(map[*Subscription]struct{}),
	}
}

// Writer is one source's handle on an Index: it upserts and removes only
// the endpoint keys this source put, and lists only those (see Index,
// Ownership). Build it with Index.Writer.
type Writer struct {
	x      *Index
	source string
}

// Writer returns the handle of the named source. The Index's own Upsert,
// UpsertResource and Remove write as the source "".
func (x *Index) Writer(source string) *Writer { return &Writer{x: x, source: source} }

// Upsert sets the workload registered under the endpoint key. It validates
// and marshals w once; an unchanged workload (same version) is not pushed.
// A new key for an existing uid (a pod's new sandbox) takes the uid over.
// It reports whether anything changed.
func (x *Index) Upsert(key string, w *workloadpb.Workload) (bool, error) {
	return x.upsert("", key, w)
}

// Upsert is Index.Upsert as this source; a key another source holds is
// refused with ErrNotOwner.
func (w *Writer) Upsert(key string, wl *workloadpb.Workload) (bool, error) {
	return w.x.upsert(w.source, key, wl)
}

func (x *Index) upsert(source, key string, w *workloadpb.Workload) (bool, error) {
	if err := Validate(w); err != nil {
		return false, err
	}
	if x.members != nil {
		// The membership is read and the resource stored under one lock,
		// so a Refresh (after a membership change) cannot be overtaken by
		// an upsert built from the membership before it.
		x.mu.Lock()
		defer x.mu.Unlock()
		x.bindLocked(w)
		r, err := NewResource(w)
		if err != nil {
			return false, err
		}
		return x.upsertResourceLocked(source, key, r, time.Now())
	}
	r, err := NewResource(w)
	if err != nil {
		return false, err
	}
	return x.upsertResource(source, key, r)
}

// UpsertResource is Upsert for an already marshalled resource. A key
// another source holds is left alone (false).
func (x *Index) UpsertResource(key string, r *Resource) bool {
	changed, _ := x.upsertResource("", key, r)
	return changed
}

func (x *Index) upsertResource(source, key string, r *Resource) (bool, error) {
	now := time.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.upsertResourceLocked(source, key, r, now)
}

func (x *Index) upsertResourceLocked(source, key string, r *Resource, now time.Time) (bool, error) {
	return x.claimLocked(source, key, &keyEntry{source: source, name: r.Name, res: r}, now)
}

// claimLocked sets key's entry to ne (of source) and serves it unless a
// claim of higher rank holds its name; x.mu is held.
func (x *Index) claimLocked(source, key string, ne *keyEntry, now time.Time) (bool, error) {
	changed := false
	e, ok := x.keys[key]
	switch {
	case ok && e.source != source:
		return false, fmt.Errorf("failed to upsert endpoint %q as %q: %w (%q)", key, source, ErrNotOwner, e.source)
	case ok && e.name != ne.name:
		// The endpoint was renamed (should not happen for pods): drop its claim on the old name.
		changed = x.unclaimLocked(e.name, key, now)
	}
	x.seq++
	ne.seq = x.seq
	x.keys[key] = ne
	// Every key of x.keys claims its resource's name, and only that one:
	// a key already held under this name is in its claims (no scan of
	// them, which grows with the sandboxes of one pod).
	if !ok || e.name != ne.name {
		x.claims[ne.name] = append(x.claims[ne.name], key)
	}
	if cur, served := x.nameKey[ne.name]; served && cur != key && x.keys[cur].rank() > ne.rank() {
		return changed, nil // a Service endpoint known only from its EndpointSlice yields to the pod's record
	}
	r, err := x.resourceLocked(ne)
	if err != nil {
		return changed, err
	}
	return x.serveLocked(ne.name, key, r, now) || changed, nil
}

// UpsertLazy is Upsert of the workload build returns, for a claim that is
// often outranked (EndpointSource: a pod's record usually holds its uid):
// while another claim of the uid is served, nothing is marshalled or kept
// but build, which makes the workload when this claim is to be served.
// build must return the same workload every time and is called with the
// index locked (it must not call the index); the workload is validated
// here, at once.
func (w *Writer) UpsertLazy(key string, build func() *workloadpb.Workload) (bool, error) {
	wl := build()
	if err := Validate(wl); err != nil {
		return false, err
	}
	w.x.mu.Lock()
	defer w.x.mu.Unlock()
	return w.x.claimLocked(w.source, key, &keyEntry{source: w.source, name: wl.GetUid(), build: build}, time.Now())
}

// resourceLocked returns e's resource, marshalling a lazy claim's
// workload (with its membership) first; x.mu is held.
func (x *Index) resourceLocked(e *keyEntry) (*Resource, error) {
	if e.res != nil {
		return e.res, nil
	}
	w := e.build()
	if x.members != nil {
		x.bindLocked(w)
	}
	r, err := NewResource(w)
	if err != nil {
		return nil, err
	}
	e.res = r
	return r, nil
}

// EndpointSource is the source of workloads known only as a Service's
// endpoint (from its EndpointSlice: a pod outside the mesh, served with
// tunnel_protocol NONE so a client connects to it directly). Its claim on
// a uid is served only while no other source claims the uid.
const EndpointSource = "endpoints"

// rank orders the claimants of a uid before their age: any record of the
// pod outranks an endpoint known only from an EndpointSlice.
func (e *keyEntry) rank() int {
	if e.source == EndpointSource {
		return 0
	}
	return 1
}

// serveLocked makes r (of key) the served resource of name; an unchanged
// version is not pushed. It reports whether anything changed.
func (x *Index) serveLocked(name, key string, r *Resource, now time.Time) bool {
	if cur, ok := x.nameKey[name]; ok && cur != key {
		if e := x.keys[cur]; e != nil && e.build != nil {
			e.res = nil // a lazy claim no longer served keeps its build only
		}
	}
	x.nameKey[name] = key
	return x.putLocked(name, r, now)
}

// putLocked serves r as name (slot, version, watchers); x.mu is held.
func (x *Index) putLocked(name string, r *Resource, now time.Time) bool {
	cur, ok := x.byName[name]
	if ok && x.bySlot[cur.slot].Version == r.Version {
		return false
	}
	slot := cur.slot
	switch {
	case ok:
	case len(x.free) > 0:
		slot = x.free[len(x.free)-1]
		x.free = x.free[:len(x.free)-1]
	default:
		slot = len(x.bySlot)
		x.bySlot = append(x.bySlot, nil)
	}
	x.byName[name] = slotted{hash: r.hash, slot: slot}
	x.bySlot[slot] = r
	x.rev++
	x.notifyLocked(name, now)
	x.sizeLocked()
	if x.addr != nil {
		x.addr.mirror(name, r)
	}
	return true
}

// Remove deletes the workload registered under the endpoint key (as the
// source ""). A key that no longer owns its uid (the pod got a new sandbox)
// removes nothing. It reports whether anything changed.
func (x *Index) Remove(key string) bool { return x.remove("", key) }

// Remove is Index.Remove as this source: a key another source holds is
// left alone.
func (w *Writer) Remove(key string) bool { return w.x.remove(w.source, key) }

func (x *Index) remove(source, key string) bool {
	now := time.Now()
	x.mu.Lock()
	defer x.mu.Unlock()
	e, ok := x.keys[key]
	if !ok || e.source != source {
		return false
	}
	delete(x.keys, key)
	return x.unclaimLocked(e.name, key, now)
}

// unclaimLocked drops key's claim on name. If key was served, the newest
// remaining claimant is served instead, or the name is deleted when none
// is left. It reports whether anything changed.
func (x *Index) unclaimLocked(name, key string, now time.Time) bool {
	keys := slices.DeleteFunc(x.claims[name], func(k string) bool { return k == key })
	if len(keys) == 0 {
		delete(x.claims, name)
		x.deleteLocked(name, now)
		return true
	}
	x.claims[name] = keys
	if x.nameKey[name] != key {
		return false
	}
	var next string
	var best *keyEntry
	for _, k := range keys {
		if e := x.keys[k]; best == nil || e.rank() > best.rank() || (e.rank() == best.rank() && e.seq > best.seq) {
			next, best = k, e
		}
	}
	r, err := x.resourceLocked(best)
	if err != nil {
		// Validated when it was put, so only a marshal failure: serve
		// none rather than a claim that is no longer one.
		x.deleteLocked(name, now)
		return true
	}
	return x.serveLocked(name, next, r, now)
}

// Keys returns the endpoint keys this source holds.
func (w *Writer) Keys() []string {
	w.x.mu.RLock()
	defer w.x.mu.RUnlock()
	var out []string
	for k, e := range w.x.keys {
		if e.source == w.source {
			out = append(out, k)
		}
	}
	return out
}

func (x *Index) deleteLocked(name string, now time.Time) {
	delete(x.nameKey, name)
	cur, ok := x.byName[name]
	if !ok {
		return
	}
	x.bySlot[cur.slot] = nil
	x.free = append(x.free, cur.slot)
	delete(x.byName, name)
	x.rev++
	x.notifyLocked(name, now)
	x.sizeLocked()
	if x.addr != nil {
		x.addr.unmirror(name, now)
	}
	if b, ok := x.members.(PolicyBinding); ok {
		b.Forget(name)
	}
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
	return x.getLocked(name)
}

// getLocked returns the resource served as name, or nil; x.mu is held.
func (x *Index) getLocked(name string) *Resource {
	if e, ok := x.byName[name]; ok {
		return x.bySlot[e.slot]
	}
	return nil
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
