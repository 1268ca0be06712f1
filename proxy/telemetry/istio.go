package telemetry

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// istioSeries holds the four istio_tcp_* families in one table: one entry
// per label set (the IstioLabels values), with the four counters of that
// set, exported at each scrape (counterSample). A client_golang
// CounterVec keeps ~3 KB per series (each series' 23 label pairs as protobuf
// messages); an entry here is its label values (shared strings) and four
// counters, ~0.5 KB for all four families of a label set.
type istioSeries struct {
	opened, closed, sent, received *prometheus.Desc

	mu sync.RWMutex
	m  map[labelKey]*seriesEntry
}

// labelKey is the values of IstioLabels, in order.
type labelKey [23]string

// Bits of seriesEntry.families: the families a label set is exported in
// (a refused connection's closed set with a flag has no opened, sent or
// received series, as with a CounterVec).
const (
	famOpened uint32 = 1 << iota
	famClosed
	famSent
	famReceived
)

// seriesEntry is the counters of one label set.
type seriesEntry struct {
	families                       atomic.Uint32
	opened, closed, sent, received atomic.Uint64
}

func newIstioSeries() *istioSeries {
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, IstioLabels[:], nil) }
	return &istioSeries{
		opened: d("istio_tcp_connections_opened_total",
			"The total number of TCP connections opened (reporter source: the client pod's outbound side; destination: the server pod's inbound side)."),
		closed: d("istio_tcp_connections_closed_total",
			"The total number of TCP connections closed (response_flags: how a refused or failed one ended)."),
		sent: d("istio_tcp_sent_bytes_total",
			"The size of total bytes sent during response in case of a TCP connection (destination to source)."),
		received: d("istio_tcp_received_bytes_total",
			"The size of total bytes received during request in case of a TCP connection (source to destination)."),
		m: map[labelKey]*seriesEntry{},
	}
}

// entry returns the counters of k, in the families of mark from now on.
func (s *istioSeries) entry(k *labelKey, mark uint32) *seriesEntry {
	s.mu.RLock()
	e := s.m[*k]
	s.mu.RUnlock()
	if e == nil {
		s.mu.Lock()
		if e = s.m[*k]; e == nil {
			e = &seriesEntry{}
			s.m[*k] = e
		}
		s.mu.Unlock()
	}
	if e.families.Load()&mark != mark {
		e.families.Or(mark)
	}
	return e
}

// Describe sends the four families' descriptions.
func (s *istioSeries) Describe(ch chan<- *prometheus.Desc) {
	ch <- s.opened
	ch <- s.closed
	ch <- s.sent
	ch <- s.received
}

// Collect sends every label set's counters in the families it is in. The
// label pairs of a set are built once per scrape, in three allocations,
// and shared by its families (prometheus.MustNewConstMetric would build
// them per family, ~70 allocations each).
func (s *istioSeries) Collect(ch chan<- prometheus.Metric) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for k, e := range s.m {
		f := e.families.Load()
		if f == 0 {
			continue
		}
		labels := labelPairs(&k)
		for _, c := range [...]struct {
			bit  uint32
			desc *prometheus.Desc
			v    *atomic.Uint64
		}{{famOpened, s.opened, &e.opened}, {famClosed, s.closed, &e.closed}, {famSent, s.sent, &e.sent}, {famReceived, s.received, &e.received}} {
			if f&c.bit != 0 {
				ch <- &counterSample{desc: c.desc, labels: labels, v: float64(c.v.Load())}
			}
		}
	}
}

// sortedLabels are the indexes of IstioLabels sorted by name (the order
// the exposition wants label pairs in), and labelNames the names' values
// the pairs point to.
var sortedLabels, labelNames = func() ([len(IstioLabels)]int, [len(IstioLabels)]string) {
	var idx [len(IstioLabels)]int
	for i := range idx {
		idx[i] = i
	}
	slices.SortFunc(idx[:], func(a, b int) int {
		if IstioLabels[a] < IstioLabels[b] {
			return -1
		}
		return 1
	})
	return idx, IstioLabels
}()

// labelPairs returns k as label pairs sorted by name.
func labelPairs(k *labelKey) []*dto.LabelPair {
	values := new(labelKey)
	*values = *k
	pairs := make([]dto.LabelPair, len(k))
	out := make([]*dto.LabelPair, len(k))
	for j, i := range sortedLabels {
		pairs[j].Name, pairs[j].Value = &labelNames[i], &values[i]
		out[j] = &pairs[j]
	}
	return out
}

// counterSample is one exported counter of a label set.
type counterSample struct {
	desc   *prometheus.Desc
	labels []*dto.LabelPair
	v      float64
}

// Desc returns the family's description.
func (c *counterSample) Desc() *prometheus.Desc { return c.desc }

// Write fills out with the sample (prometheus.Metric).
func (c *counterSample) Write(out *dto.Metric) error {
	out.Label = c.labels
	out.Counter = &dto.Counter{Value: &c.v}
	return nil
}
