package telemetry_test

import (
	"testing"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/telemetry"
)

// TestRegisterHBONE: every field of the stats reaches its series, read at
// gather time; a second registration fails.
func TestRegisterHBONE(t *testing.T) {
	m := telemetry.New()
	st := telemetry.HBONEStats{
		Server: hbone.ServerStats{Accepted: 1, Handshakes: 2, HandshakeTimeouts: 3, HandshakeFailures: 4, StreamsOpened: 5, StreamsActive: 6, StreamsBadRequest: 7, StreamsDeliverFailed: 8, ControlFloods: 15, ConnsRejected: 17, WriteTimeouts: 18, PingTimeouts: 20, ProtocolErrors: 21},
		Dialer: hbone.DialerStats{ConnsOpened: 9, ConnsFailed: 10, ConnsEvicted: 11, ConnsPooled: 12, StreamsOpened: 13, StreamsFailed: 14, ControlFloods: 16, WriteTimeouts: 19, PingTimeouts: 22, ProtocolErrors: 23},
	}
	if err := m.RegisterHBONE(func() telemetry.HBONEStats { return st }); err != nil {
		t.Fatal(err)
	}
	if err := m.RegisterHBONE(func() telemetry.HBONEStats { return st }); err == nil {
		t.Error("a second RegisterHBONE succeeded")
	}
	st.Server.Accepted = 100 // read at gather time, not at registration
	got := gather(t, m, true)
	for name, want := range map[string]float64{
		"aether_proxy_hbone_server_connections_accepted_total":               100,
		"aether_proxy_hbone_server_handshakes_total":                         2,
		"aether_proxy_hbone_server_handshake_failures_total,reason=timeout":  3,
		"aether_proxy_hbone_server_handshake_failures_total,reason=rejected": 4,
		"aether_proxy_hbone_server_streams_total,outcome=delivered":          5,
		"aether_proxy_hbone_server_streams_active":                           6,
		"aether_proxy_hbone_server_streams_total,outcome=bad_request":        7,
		"aether_proxy_hbone_server_streams_total,outcome=deliver_failed":     8,
		"aether_proxy_hbone_dialer_connections_opened_total":                 9,
		"aether_proxy_hbone_dialer_connections_failed_total":                 10,
		"aether_proxy_hbone_dialer_connections_evicted_total":                11,
		"aether_proxy_hbone_dialer_connections_pooled":                       12,
		"aether_proxy_hbone_dialer_streams_total,outcome=opened":             13,
		"aether_proxy_hbone_dialer_streams_total,outcome=failed":             14,
		"aether_proxy_hbone_server_control_floods_total":                     15,
		"aether_proxy_hbone_dialer_control_floods_total":                     16,
		"aether_proxy_hbone_server_connections_rejected_total":               17,
		"aether_proxy_hbone_server_write_timeouts_total":                     18,
		"aether_proxy_hbone_dialer_write_timeouts_total":                     19,
		"aether_proxy_hbone_server_ping_timeouts_total":                      20,
		"aether_proxy_hbone_server_protocol_errors_total":                    21,
		"aether_proxy_hbone_dialer_ping_timeouts_total":                      22,
		"aether_proxy_hbone_dialer_protocol_errors_total":                    23,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s = %v (exported: %v), want %v", name, v, ok, want)
		}
	}
}
