package dataplane_test

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"aether.io/node/proxy/proxytest"
)

// scrape GETs /metrics from a server on the registry, as Prometheus does,
// and returns every sample of the text exposition by its series
// (`name{label="value",...}` as printed).
func scrape(t *testing.T, e *hboneEnv) map[string]float64 {
	t.Helper()
	ts := httptest.NewServer(promhttp.HandlerFor(e.metrics.Registry, promhttp.HandlerOpts{}))
	defer ts.Close()
	resp, err := http.Get(ts.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("sample %q: %v", line, err)
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestHBONEMetricsScraped: after real tunnelled traffic (IPv4 and IPv6,
// so two pooled connections) and one connection to :15008 that is not
// TLS, /metrics shows the aether_proxy_hbone_* series with those counts;
// once the server pod is removed its server's counters stay (they never go
// down when a pod goes).
func TestHBONEMetricsScraped(t *testing.T) {
	e := setupHBONE(t)
	srv := e.server.Serve(t, 8080)
	for i, dst := range []netip.Addr{e.server.IP4, e.server.IP6} {
		if _, err := roundTrip(ctx10(t), e.client, netip.AddrPortFrom(dst, 8080), fmt.Sprintf("m-%d", i)); err != nil {
			t.Fatal(err)
		}
		<-srv.Got
	}
	// Not TLS: the server's handshake rejects it and closes.
	c, err := e.plain.Dial(ctx10(t), netip.AddrPortFrom(e.server.IP4, 15008))
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("GET / HTTP/1.1\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, c)
	_ = c.Close()

	server := map[string]float64{
		`aether_proxy_hbone_server_connections_accepted_total`:                  3,
		`aether_proxy_hbone_server_handshakes_total`:                            2,
		`aether_proxy_hbone_server_handshake_failures_total{reason="rejected"}`: 1,
		`aether_proxy_hbone_server_handshake_failures_total{reason="timeout"}`:  0,
		`aether_proxy_hbone_server_streams_total{outcome="delivered"}`:          2,
		`aether_proxy_hbone_server_streams_total{outcome="bad_request"}`:        0,
		`aether_proxy_hbone_server_streams_total{outcome="deliver_failed"}`:     0,
		`aether_proxy_hbone_server_streams_active`:                              0,
	}
	dialer := map[string]float64{
		`aether_proxy_hbone_dialer_connections_opened_total`:        2,
		`aether_proxy_hbone_dialer_connections_failed_total`:        0,
		`aether_proxy_hbone_dialer_connections_evicted_total`:       0,
		`aether_proxy_hbone_dialer_connections_pooled`:              2,
		`aether_proxy_hbone_dialer_streams_total{outcome="opened"}`: 2,
		`aether_proxy_hbone_dialer_streams_total{outcome="failed"}`: 0,
	}
	check := func(t *testing.T, want map[string]float64) {
		t.Helper()
		var got map[string]float64
		match := func() bool {
			got = scrape(t, e)
			for k, v := range want {
				if g, ok := got[k]; !ok || g != v {
					return false
				}
			}
			return true
		}
		if err := proxytest.WaitFor(ctx10(t), match); err != nil {
			for k, v := range want {
				if g, ok := got[k]; !ok || g != v {
					t.Errorf("%s = %v (exported: %v), want %v", k, g, ok, v)
				}
			}
		}
	}
	check(t, server)
	check(t, dialer)

	// The server pod goes: its server shuts down and its counts are kept.
	e.mgr.SetListeners(e.client.Specs(t))
	if err := proxytest.WaitFor(ctx10(t), func() bool {
		for _, st := range e.mgr.Status() {
			if st.Name == e.server.Name {
				return false
			}
		}
		return true
	}); err != nil {
		t.Fatalf("server pod still known: %+v", e.mgr.Status())
	}
	check(t, server)
}
