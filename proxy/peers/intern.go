package peers

import (
	"maps"
	"slices"
	"strconv"
	"strings"

	"aether.io/node/api/istio/workload"
)

// strs is a table of the strings many workloads repeat (namespace,
// cluster, revision, workload and canonical names, SPIFFE ids): each held
// once, shared by every entry naming it, counted so the last one to go
// frees it. Decoded messages carry one copy per workload otherwise. Used
// under its owner's lock.
type strs map[string]*interned

type interned struct {
	s string
	n int
}

// hold returns the table's copy of s, counting one more holder.
func (t strs) hold(s string) string {
	if s == "" {
		return ""
	}
	if e := t[s]; e != nil {
		e.n++
		return e.s
	}
	t[s] = &interned{s: s, n: 1}
	return s
}

// drop counts one holder of s fewer.
func (t strs) drop(s string) {
	if e := t[s]; e != nil {
		if e.n--; e.n == 0 {
			delete(t, s)
		}
	}
}

// svcSet is one services map (istio.workload.Workload.services) shared by
// every workload whose map has the same content (the endpoints of one
// Service and ports), counted as strs; read-only.
type svcSet struct {
	key string
	m   map[string]*workload.PortList
	n   int
}

// sets are the shared services maps by content (svcSetKey).
type sets map[string]*svcSet

// hold returns the shared set with m's content (nil for an empty map),
// counting one more holder.
func (t sets) hold(m map[string]*workload.PortList) *svcSet {
	if len(m) == 0 {
		return nil
	}
	k := svcSetKey(m)
	if s := t[k]; s != nil {
		s.n++
		return s
	}
	s := &svcSet{key: k, m: m, n: 1}
	t[k] = s
	return s
}

// drop counts one holder of s fewer.
func (t sets) drop(s *svcSet) {
	if s == nil {
		return
	}
	if s.n--; s.n == 0 {
		delete(t, s.key)
	}
}

// svcSetKey spells a services map's content: its keys in order, each
// with its ports (service port, target port and protocol; a nil port list and an
// empty one read alike, as they do for Choose).
func svcSetKey(m map[string]*workload.PortList) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(m)) {
		b.WriteString(strconv.Itoa(len(k)))
		b.WriteByte(':')
		b.WriteString(k)
		for _, p := range m[k].GetPorts() {
			b.WriteByte(',')
			b.WriteString(strconv.FormatUint(uint64(p.GetServicePort()), 10))
			b.WriteByte('>')
			b.WriteString(strconv.FormatUint(uint64(p.GetTargetPort()), 10))
			b.WriteByte('/')
			b.WriteString(strconv.Itoa(int(p.GetAppProtocol())))
		}
		b.WriteByte(';')
	}
	return b.String()
}
