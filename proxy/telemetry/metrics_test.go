package telemetry_test

import (
	"testing"

	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
)

func TestConnCounts(t *testing.T) {
	m := telemetry.New()
	l := telemetry.Labels("outbound", peers.Peer{Workload: "web", Namespace: "a", CanonicalName: "web-svc"}, peers.Peer{})
	want := []string{"outbound", "web", "a", "web-svc", telemetry.Unknown, telemetry.Unknown, telemetry.Unknown}
	for i := range want {
		if l[i] != want[i] {
			t.Fatalf("Labels = %v, want %v", l, want)
		}
	}
	c := m.Open(l)
	c.Received(60)
	c.Received(40)
	c.Sent(7)
	c.Close()
	got := gather(t, m, false)
	for name, v := range map[string]float64{
		"aether_tcp_connections_opened_total":    1,
		"aether_tcp_connections_closed_total":    1,
		"aether_tcp_received_bytes_total":        100,
		"aether_tcp_sent_bytes_total":            7,
		"aether_tcp_connection_duration_seconds": 1,
	} {
		if got[name] != v {
			t.Errorf("%s = %v, want %v", name, got[name], v)
		}
	}
}

// gather sums every series of m by metric name (with labels: by
// `name,label=value,...`): counter and gauge values, histogram sample counts.
func gather(t *testing.T, m *telemetry.Metrics, labels bool) map[string]float64 {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			key := mf.GetName()
			if labels {
				for _, l := range mt.GetLabel() {
					key += "," + l.GetName() + "=" + l.GetValue()
				}
			}
			got[key] += mt.GetCounter().GetValue() + mt.GetGauge().GetValue() + float64(mt.GetHistogram().GetSampleCount())
		}
	}
	return got
}
