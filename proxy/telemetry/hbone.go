package telemetry

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"aether.io/node/proxy/hbone"
)

// HBONEStats are the node-wide HBONE counters: every pod's hbone.Server
// summed (servers of pods that are gone included, so counters never go
// down) and the proxy's one hbone.Dialer.
type HBONEStats struct {
	Server hbone.ServerStats
	Dialer hbone.DialerStats
}

// hboneMetric is one exported series: its description and how to read
// its value from a snapshot.
type hboneMetric struct {
	desc  *prometheus.Desc
	kind  prometheus.ValueType
	value func(HBONEStats) float64
}

// hboneCollector exports HBONEStats, read once per scrape.
type hboneCollector struct {
	stats   func() HBONEStats
	metrics []hboneMetric
}

func counter(name, help string, labels prometheus.Labels, value func(HBONEStats) float64) hboneMetric {
	return hboneMetric{prometheus.NewDesc(name, help, nil, labels), prometheus.CounterValue, value}
}

func gauge(name, help string, value func(HBONEStats) float64) hboneMetric {
	return hboneMetric{prometheus.NewDesc(name, help, nil, nil), prometheus.GaugeValue, value}
}

func newHBONECollector(stats func() HBONEStats) *hboneCollector {
	const (
		handshakeFailures = "aether_proxy_hbone_server_handshake_failures_total"
		serverStreams     = "aether_proxy_hbone_server_streams_total"
		dialerStreams     = "aether_proxy_hbone_dialer_streams_total"
	)
	failuresHelp := "HBONE connections on :15008 whose mTLS handshake failed, by reason: timeout (not done within the handshake timeout), rejected (no or untrusted client SVID, expired certificate, no local SVID, no ALPN h2)."
	serverStreamsHelp := "CONNECT streams received on :15008, by outcome: delivered (200, handed to the app), bad_request (405 not CONNECT, 400 authority not ip:port), deliver_failed (the target could not be reached or was refused: 502, 503)."
	dialerStreamsHelp := "Outbound CONNECT streams, by outcome: opened (200) or failed (transport error or another status)."
	u := func(v uint64) float64 { return float64(v) }
	return &hboneCollector{stats: stats, metrics: []hboneMetric{
		counter("aether_proxy_hbone_server_connections_accepted_total", "TCP connections accepted on the pods' HBONE listeners (:15008).", nil,
			func(s HBONEStats) float64 { return u(s.Server.Accepted) }),
		counter("aether_proxy_hbone_server_handshakes_total", "HBONE connections whose mTLS handshake completed (client SVID verified, ALPN h2).", nil,
			func(s HBONEStats) float64 { return u(s.Server.Handshakes) }),
		counter(handshakeFailures, failuresHelp, prometheus.Labels{"reason": "timeout"},
			func(s HBONEStats) float64 { return u(s.Server.HandshakeTimeouts) }),
		counter(handshakeFailures, failuresHelp, prometheus.Labels{"reason": "rejected"},
			func(s HBONEStats) float64 { return u(s.Server.HandshakeFailures) }),
		counter(serverStreams, serverStreamsHelp, prometheus.Labels{"outcome": "delivered"},
			func(s HBONEStats) float64 { return u(s.Server.StreamsOpened) }),
		counter(serverStreams, serverStreamsHelp, prometheus.Labels{"outcome": "bad_request"},
			func(s HBONEStats) float64 { return u(s.Server.StreamsBadRequest) }),
		counter(serverStreams, serverStreamsHelp, prometheus.Labels{"outcome": "deliver_failed"},
			func(s HBONEStats) float64 { return u(s.Server.StreamsDeliverFailed) }),
		counter("aether_proxy_hbone_server_control_floods_total", "HBONE connections on :15008 closed because the client did not read the control frames it asked for (PING/SETTINGS acks, resets) while over 1 MiB of them were queued, or past the node's control-frame budget.", nil,
			func(s HBONEStats) float64 { return u(s.Server.ControlFloods) }),
		counter("aether_proxy_hbone_server_connections_rejected_total", "HBONE connections on :15008 closed at accept because the node's or the source address's connection cap (-hbone-max-connections, -hbone-max-connections-per-source) was reached.", nil,
			func(s HBONEStats) float64 { return u(s.Server.ConnsRejected) }),
		counter("aether_proxy_hbone_server_write_timeouts_total", "HBONE connections on :15008 closed because a write to the client did not finish within the write timeout (the client does not read).", nil,
			func(s HBONEStats) float64 { return u(s.Server.WriteTimeouts) }),
		counter("aether_proxy_hbone_server_ping_timeouts_total", "HBONE connections on :15008 closed because the client did not acknowledge a keepalive PING within the ping timeout.", nil,
			func(s HBONEStats) float64 { return u(s.Server.PingTimeouts) }),
		counter("aether_proxy_hbone_server_protocol_errors_total", "HBONE connections on :15008 closed on an HTTP/2 connection error of the client's (GOAWAY with its code: a malformed frame, flow control, over 100 SETTINGS entries, a header block over 144 KiB).", nil,
			func(s HBONEStats) float64 { return u(s.Server.ProtocolErrors) }),
		gauge("aether_proxy_hbone_server_streams_active", "CONNECT streams being served on :15008 now.",
			func(s HBONEStats) float64 { return float64(s.Server.StreamsActive) }),
		counter("aether_proxy_hbone_dialer_connections_opened_total", "Pooled outbound HBONE connections established (mTLS done).", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.ConnsOpened) }),
		counter("aether_proxy_hbone_dialer_connections_failed_total", "Outbound HBONE connection attempts that failed (TCP connect or mTLS handshake).", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.ConnsFailed) }),
		counter("aether_proxy_hbone_dialer_connections_evicted_total", "Pooled outbound HBONE connections removed because they broke or the peer closed them (GOAWAY, idle close).", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.ConnsEvicted) }),
		gauge("aether_proxy_hbone_dialer_connections_pooled", "Outbound HBONE connections in the pool now.",
			func(s HBONEStats) float64 { return float64(s.Dialer.ConnsPooled) }),
		counter(dialerStreams, dialerStreamsHelp, prometheus.Labels{"outcome": "opened"},
			func(s HBONEStats) float64 { return u(s.Dialer.StreamsOpened) }),
		counter(dialerStreams, dialerStreamsHelp, prometheus.Labels{"outcome": "failed"},
			func(s HBONEStats) float64 { return u(s.Dialer.StreamsFailed) }),
		counter("aether_proxy_hbone_dialer_control_floods_total", "Outbound HBONE connections closed because the server did not read the control frames it asked for (PING/SETTINGS acks) while over 1 MiB of them were queued, or past the node's control-frame budget.", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.ControlFloods) }),
		counter("aether_proxy_hbone_dialer_write_timeouts_total", "Outbound HBONE connections closed because a write to the server did not finish within the write timeout (the server does not read).", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.WriteTimeouts) }),
		counter("aether_proxy_hbone_dialer_ping_timeouts_total", "Outbound HBONE connections closed because the server did not acknowledge a keepalive PING within the ping timeout.", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.PingTimeouts) }),
		counter("aether_proxy_hbone_dialer_protocol_errors_total", "Outbound HBONE connections closed on an HTTP/2 connection error of the server's (GOAWAY with its code: a malformed frame, flow control, over 100 SETTINGS entries, a header block over 144 KiB).", nil,
			func(s HBONEStats) float64 { return u(s.Dialer.ProtocolErrors) }),
	}}
}

// Describe sends every series' description.
func (c *hboneCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.metrics {
		ch <- m.desc
	}
}

// Collect reads one snapshot and sends every series from it.
func (c *hboneCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.stats()
	for _, m := range c.metrics {
		ch <- prometheus.MustNewConstMetric(m.desc, m.kind, m.value(s))
	}
}

// RegisterHBONE exports the aether_proxy_hbone_* series, read from stats at
// every scrape. It fails when they are registered already.
func (m *Metrics) RegisterHBONE(stats func() HBONEStats) error {
	if err := m.Registry.Register(newHBONECollector(stats)); err != nil {
		return fmt.Errorf("failed to register hbone metrics: %w", err)
	}
	return nil
}
