package adsclient

import (
	"slices"

	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
)

// Versions are the resource versions a delta client holds for one type,
// kept as the initial_resource_versions of its next first request: in wire
// form, in the order they were set. A reconnect's request is then a small
// head followed by these bytes (Request): no map is walked and no string
// encoded at the moment the client needs the server's answer (at 70k
// workloads that walk and encoding were most of the client's part of a
// reconnect). The order is the one the server sent the resources in, which
// a server may use to compare them sequentially (xds/workload does).
//
// A changed or removed name leaves a hole in the wire form that Request
// skips; the holes are compacted away once they are half of it. The zero
// Versions is empty and ready to use. A Versions is not safe for
// concurrent use.
type Versions struct {
	// wire is the entries, each an initial_resource_versions field, in the
	// order set. Bytes below len(wire) are never modified: a request may
	// still be sending them (compaction makes a new slice).
	wire []byte
	// at is where each held name's entry is in wire.
	at map[string]span
	// holes are the spans of superseded entries, in the order they arose.
	holes []span
	// dead is the sum of the holes' lengths.
	dead int
}

// span is one entry in Versions.wire, and its version.
type span struct {
	off, n  int
	version string
}

// NewVersions returns the Versions of a map from resource name to version
// (in the map's order).
func NewVersions(m map[string]string) *Versions {
	v := &Versions{}
	for name, version := range m {
		v.Set(name, version)
	}
	return v
}

// Len is the number of names held.
func (v *Versions) Len() int { return len(v.at) }

// Get returns the version held for name.
func (v *Versions) Get(name string) (string, bool) {
	s, ok := v.at[name]
	return s.version, ok
}

// Map returns the versions as a map from name to version.
func (v *Versions) Map() map[string]string {
	m := make(map[string]string, len(v.at))
	for name, s := range v.at {
		m[name] = s.version
	}
	return m
}

// Set records version for name. A name that changes version moves to the
// end of the order.
func (v *Versions) Set(name, version string) {
	if v.at == nil {
		v.at = map[string]span{}
	}
	old, ok := v.at[name]
	if ok && old.version == version {
		return
	}
	if ok {
		delete(v.at, name) // compaction (in hole) moves only what is held
		v.hole(old)
	}
	off := len(v.wire)
	v.wire = appendEntry(v.wire, name, version)
	v.at[name] = span{off: off, n: len(v.wire) - off, version: version}
}

// Delete forgets name.
func (v *Versions) Delete(name string) {
	if s, ok := v.at[name]; ok {
		delete(v.at, name)
		v.hole(s)
	}
}

// hole marks s superseded and compacts the wire form once the holes are
// half of it.
func (v *Versions) hole(s span) {
	v.holes = append(v.holes, s)
	v.dead += s.n
	if v.dead > len(v.wire)/2 {
		v.compact()
	}
}

// compact rewrites the wire form without its holes, into a new slice
// (requests in flight keep the old one), keeping the order.
func (v *Versions) compact() {
	live := v.live()
	wire := make([]byte, 0, len(v.wire)-v.dead)
	starts := make([]int, len(live)) // old offset of each live run
	news := make([]int, len(live))   // its new offset
	for i, run := range live {
		starts[i], news[i] = run.off, len(wire)
		wire = append(wire, v.wire[run.off:run.off+run.n]...)
	}
	for name, s := range v.at {
		i, found := slices.BinarySearch(starts, s.off)
		if !found {
			i-- // s lies inside the run before
		}
		s.off += news[i] - starts[i]
		v.at[name] = s
	}
	v.wire, v.holes, v.dead = wire, nil, 0
}

// live returns the spans of wire between the holes, in order.
func (v *Versions) live() []span {
	slices.SortFunc(v.holes, func(a, b span) int { return a.off - b.off })
	runs := make([]span, 0, len(v.holes)+1)
	off := 0
	for _, h := range v.holes {
		if h.off > off {
			runs = append(runs, span{off: off, n: h.off - off})
		}
		off = h.off + h.n
	}
	if off < len(v.wire) {
		runs = append(runs, span{off: off, n: len(v.wire) - off})
	}
	return runs
}

// Request returns req with these versions as its
// initial_resource_versions (req's own map is not read), ready for SendMsg
// on a stream whose codec is Codec: every other field through
// proto.Marshal, followed by the held entries as they are (no copy: they
// are never modified in place). A nil Versions holds nothing.
func (v *Versions) Request(req *discovery.DeltaDiscoveryRequest) (*EncodedRequest, error) {
	head, err := marshalHead(headOf(req), nil)
	if err != nil {
		return nil, err
	}
	parts := [][]byte{head}
	if v != nil && len(v.at) > 0 {
		for _, run := range v.live() {
			parts = append(parts, v.wire[run.off:run.off+run.n:run.off+run.n])
		}
	}
	return &EncodedRequest{parts: parts}, nil
}
