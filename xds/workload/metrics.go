package workload

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Protocol label values.
const (
	protoDelta = "delta"
	protoSotW  = "sotw"
)

type metrics struct {
	clients   *prometheus.GaugeVec
	pushes    *prometheus.CounterVec
	resources *prometheus.HistogramVec
	latency   *prometheus.HistogramVec
	acks      *prometheus.CounterVec
	nacks     *prometheus.CounterVec
	lastNACK  *prometheus.GaugeVec
	workloads prometheus.Gauge
	addresses prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		clients: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "aether_wds_connected_clients",
			Help: "xDS streams currently open, by protocol (delta or sotw).",
		}, []string{"protocol"}),
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_wds_pushes_total",
			Help: "Responses sent to xDS clients, by protocol.",
		}, []string{"protocol"}),
		resources: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "aether_wds_push_resources",
			Help:    "Resources (updated plus removed) per response, by protocol.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 10),
		}, []string{"protocol"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "aether_wds_push_duration_seconds",
			Help:    "Time from the oldest change (or the request) a response carries to the end of its send, by protocol.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2.5, 14),
		}, []string{"protocol"}),
		acks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_wds_acks_total",
			Help: "Responses acknowledged by clients, by protocol.",
		}, []string{"protocol"}),
		nacks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_wds_nacks_total",
			Help: "Responses rejected by clients (NACK), by protocol.",
		}, []string{"protocol"}),
		lastNACK: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "aether_wds_last_nack_timestamp_seconds",
			Help: "Unix time of the last NACK; its labels carry the client node id and the error message (one series, replaced by each NACK).",
		}, []string{"protocol", "node", "message"}),
		workloads: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aether_wds_workloads",
			Help: "Workloads held by the index.",
		}),
		addresses: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aether_wds_addresses",
			Help: "Address resources served (every workload and every Service).",
		}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.clients, m.pushes, m.resources, m.latency, m.acks, m.nacks, m.lastNACK, m.workloads, m.addresses} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return nil, errors.New("failed to register wds metrics: already registered; give each server its own registerer")
			}
			return nil, err
		}
	}
	return m, nil
}

func (m *metrics) pushed(protocol string, n int, since time.Time) {
	m.pushes.WithLabelValues(protocol).Inc()
	m.resources.WithLabelValues(protocol).Observe(float64(n))
	if !since.IsZero() {
		m.latency.WithLabelValues(protocol).Observe(time.Since(since).Seconds())
	}
}

func (m *metrics) nacked(protocol, node, message string) {
	m.nacks.WithLabelValues(protocol).Inc()
	if len(message) > 256 {
		message = message[:256]
	}
	m.lastNACK.Reset()
	m.lastNACK.WithLabelValues(protocol, node, message).Set(float64(time.Now().UnixNano()) / 1e9)
}
