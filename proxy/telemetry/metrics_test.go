package telemetry_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"aether.io/node/pkg/flowapi"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
)

var (
	web = peers.Peer{
		Workload: "web", Name: "web-7c9f-x2", Namespace: "a", CanonicalName: "web-svc", CanonicalRevision: "v1", Cluster: "c1",
		Identity: "spiffe://cluster.local/ns/a/sa/web",
	}
	db = peers.Peer{
		Workload: "db", Name: "db-0", Namespace: "b", CanonicalName: "db", CanonicalRevision: "latest", Cluster: "c1",
		Identity: "spiffe://cluster.local/ns/b/sa/db",
	}
	svc = peers.ServiceRef{Name: "db", Namespace: "b", Hostname: "db.b.svc.cluster.local"}
)

func info(reporter string, mtls bool) telemetry.ConnInfo {
	i := telemetry.ConnInfo{
		Reporter: reporter, Src: netip.MustParseAddrPort("10.0.0.5:40000"), Dst: netip.MustParseAddrPort("10.0.0.6:5432"),
		Source: web, Destination: db, Service: svc, Path: telemetry.PathPlaintext,
	}
	if mtls {
		i.MTLS, i.Path = true, telemetry.PathHBONE
		i.SourcePrincipal, i.DestinationPrincipal = web.Identity, db.Identity
	}
	return i
}

// series is the label set of one istio_tcp_* sample, as Istio's queries
// select it.
func series(reporter, flags, security, srcPrincipal string) string {
	return ",connection_security_policy=" + security +
		",destination_app=db,destination_canonical_revision=latest,destination_canonical_service=db,destination_cluster=c1" +
		",destination_principal=spiffe://cluster.local/ns/b/sa/db" +
		",destination_service=db.b.svc.cluster.local,destination_service_name=db,destination_service_namespace=b" +
		",destination_version=latest,destination_workload=db,destination_workload_namespace=b" +
		",reporter=" + reporter + ",request_protocol=tcp,response_flags=" + flags +
		",source_app=web-svc,source_canonical_revision=v1,source_canonical_service=web-svc,source_cluster=c1" +
		",source_principal=" + srcPrincipal + ",source_version=v1,source_workload=web,source_workload_namespace=a"
}

func TestIstioLabels(t *testing.T) {
	m := telemetry.New()
	c := m.Open(info(telemetry.ReporterSource, true))
	c.Received(60)
	c.Received(40)
	c.Sent(7)
	c.Close(telemetry.ReasonClientClosed, nil)
	m.Refused(info(telemetry.ReporterDestination, false), telemetry.ReasonConnectFailed, errors.New("connection refused"))
	// Nothing known of either end: every workload label is unknown.
	m.Refused(telemetry.ConnInfo{Reporter: telemetry.ReporterSource}, telemetry.ReasonLimit, nil)
	m.Misdirected(info(telemetry.ReporterSource, false), nil) // no series

	got := gather(t, m, true)
	mtls := series("source", "-", "mutual_tls", "spiffe://cluster.local/ns/a/sa/web")
	plain := series("destination", "-", "none", "unknown")
	for key, want := range map[string]float64{
		"istio_tcp_connections_opened_total" + mtls:  1,
		"istio_tcp_connections_closed_total" + mtls:  1,
		"istio_tcp_received_bytes_total" + mtls:      100,
		"istio_tcp_sent_bytes_total" + mtls:          7,
		"istio_tcp_connections_opened_total" + plain: 1,
		// A refused connection is opened with "-" and closed with its flag.
		"istio_tcp_connections_closed_total" + series("destination", "CONNECT", "none", "unknown"): 1,
		"aether_tcp_connection_duration_seconds,reporter=source":                                   2,
		"aether_tcp_connection_duration_seconds,reporter=destination":                              1,
	} {
		if got[key] != want {
			t.Errorf("%s = %v, want %v", key, got[key], want)
		}
	}
	unknown := 0
	for key := range got {
		if strings.HasPrefix(key, "istio_tcp_connections_closed_total,") && strings.Contains(key, "response_flags=UO") {
			unknown++
			for _, l := range []string{
				"source_workload=unknown", "destination_workload=unknown", "destination_service=unknown",
				"source_cluster=unknown", "destination_principal=unknown", "connection_security_policy=none",
			} {
				if !strings.Contains(key, ","+l) {
					t.Errorf("refusal of unknown ends: %s lacks %s", key, l)
				}
			}
		}
	}
	if unknown != 1 {
		t.Errorf("closed series with response_flags=UO: %d, want 1", unknown)
	}
	total := 0.0
	for key, v := range got {
		if strings.HasPrefix(key, "istio_tcp_connections_opened_total,") {
			total += v
		}
	}
	if total != 3 {
		t.Errorf("opened = %v, want 3 (the misdirected connection is in no istio series)", total)
	}
}

func TestCloseReasons(t *testing.T) {
	for r, want := range map[telemetry.CloseReason]string{
		telemetry.ReasonClientClosed: "-", telemetry.ReasonServerClosed: "-", telemetry.ReasonReset: "-",
		telemetry.ReasonIdleTimeout: "-", telemetry.ReasonDrainDeadline: "-", telemetry.ReasonPodClosed: "-",
		telemetry.ReasonConnectFailed: "CONNECT", telemetry.ReasonDenied: "DENY", telemetry.ReasonNoEndpoint: "UH",
		telemetry.ReasonLimit: "UO",
	} {
		if r.Flag() != want {
			t.Errorf("%s: flag %q, want %q", r, r.Flag(), want)
		}
		if r.Clean() != (r == telemetry.ReasonClientClosed || r == telemetry.ReasonServerClosed) {
			t.Errorf("%s: clean %v", r, r.Clean())
		}
	}
	var e telemetry.End
	if e.Reason(telemetry.ReasonReset) != telemetry.ReasonReset {
		t.Error("End without a reason does not give the default")
	}
	e.Finished(telemetry.ReasonClientClosed)
	e.Finished(telemetry.ReasonServerClosed)
	if got := e.Reason(telemetry.ReasonReset); got != telemetry.ReasonClientClosed {
		t.Errorf("End = %s, want the first clean end client_closed", got)
	}
	e.Force(telemetry.ReasonIdleTimeout)
	e.Force(telemetry.ReasonReset)
	if got := e.Reason(telemetry.ReasonClientClosed); got != telemetry.ReasonIdleTimeout {
		t.Errorf("End = %s, want the first forced reason idle_timeout over the clean end", got)
	}
}

// bufferedMetrics returns metrics whose access log (level, rate, opens)
// writes to the returned buffer.
func bufferedMetrics(t *testing.T, level telemetry.AccessLogLevel, rate float64, opens bool) (*telemetry.Metrics, *bytes.Buffer) {
	t.Helper()
	buf := &bytes.Buffer{}
	al, err := telemetry.NewAccessLog(buf, level, rate, opens)
	if err != nil {
		t.Fatal(err)
	}
	return telemetry.NewWithAccessLog(al), buf
}

// cleanAndRefused runs one clean connection (web to db over mutual TLS,
// 100 bytes to db, 7 back, db closed first) and one the destination's
// inbound policy strict refused.
func cleanAndRefused(m *telemetry.Metrics) {
	c := m.Open(info(telemetry.ReporterSource, true))
	c.Received(100)
	c.Sent(7)
	c.Close(telemetry.ReasonServerClosed, nil)
	denied := info(telemetry.ReporterDestination, false)
	denied.Policy = telemetry.PolicyInboundStrict
	m.Refused(denied, telemetry.ReasonDenied, errors.New("plaintext refused"))
}

// accessLines runs one clean and one failed connection through an access
// log of level and rate and returns its lines.
func accessLines(t *testing.T, level string, rate float64) []map[string]any {
	t.Helper()
	lvl, err := telemetry.ParseAccessLogLevel(level)
	if err != nil {
		t.Fatal(err)
	}
	m, buf := bufferedMetrics(t, lvl, rate, false)
	cleanAndRefused(m)
	m.FlushAccessLog()
	var lines []map[string]any
	for l := range strings.SplitSeq(strings.TrimSpace(buf.String()), "\n") {
		if l == "" {
			continue
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(l), &v); err != nil {
			t.Fatalf("access log line %q: %v", l, err)
		}
		lines = append(lines, v)
	}
	return lines
}

func TestAccessLog(t *testing.T) {
	lines := accessLines(t, "all", 1)
	if len(lines) != 2 {
		t.Fatalf("level all: %d lines, want 2", len(lines))
	}
	keys := func(v map[string]any) []string {
		var k []string
		for key := range v {
			k = append(k, key)
		}
		return k
	}
	if a, b := len(keys(lines[0])), len(keys(lines[1])); a != b || a != 30 {
		t.Errorf("lines have %d and %d keys, want the same 30: %v", a, b, keys(lines[0]))
	}
	for key, want := range map[string]any{
		"msg": "connection closed", "level": "INFO", "reporter": "source", "reason": "server_closed",
		"src_addr": "10.0.0.5:40000", "src_workload": "web", "src_pod": "web-7c9f-x2", "src_namespace": "a",
		"src_principal": "spiffe://cluster.local/ns/a/sa/web", "dst_addr": "10.0.0.6:5432", "dst_workload": "db",
		"dst_pod": "db-0", "dst_namespace": "b", "dst_principal": "spiffe://cluster.local/ns/b/sa/db",
		"dst_service": "db.b.svc.cluster.local", "bytes_to_dst": 100.0, "bytes_to_src": 7.0, "path": "hbone",
		"security": "mutual_tls", "policy_decision": "none", "policy": "", "response_flags": "-", "error": "",
	} {
		if lines[0][key] != want {
			t.Errorf("clean line %s = %#v, want %#v", key, lines[0][key], want)
		}
	}
	for key, want := range map[string]any{
		"level": "WARN", "reporter": "destination", "reason": "denied", "policy_decision": "deny",
		"policy": "inbound-policy/strict", "response_flags": "DENY", "error": "plaintext refused",
		"security": "none", "src_principal": "", "dst_principal": "", "path": "plaintext", "bytes_to_dst": 0.0,
	} {
		if lines[1][key] != want {
			t.Errorf("denied line %s = %#v, want %#v", key, lines[1][key], want)
		}
	}
	if d, ok := lines[0]["duration_ms"].(float64); !ok || d < 0 {
		t.Errorf("duration_ms = %#v", lines[0]["duration_ms"])
	}
	if got := accessLines(t, "errors", 1); len(got) != 1 || got[0]["reason"] != "denied" {
		t.Errorf("level errors: %v, want the denied line only", got)
	}
	if got := accessLines(t, "off", 1); len(got) != 0 {
		t.Errorf("level off: %v", got)
	}
	if got := accessLines(t, "all", 0); len(got) != 0 {
		t.Errorf("sample rate 0: %v", got)
	}
	for _, bad := range []float64{-0.1, 1.5} {
		if _, err := telemetry.NewAccessLog(&bytes.Buffer{}, telemetry.AccessLogAll, bad, false); err == nil {
			t.Errorf("sample rate %v accepted", bad)
		}
	}
	if _, err := telemetry.ParseAccessLogLevel("debug"); err == nil {
		t.Error("level debug accepted")
	}
}

// TestAccessLogOpens: with opens, a connection's open line comes first,
// with the same keys and no end, bytes or reason; only at level all.
func TestAccessLogOpens(t *testing.T) {
	for _, tc := range []struct {
		level telemetry.AccessLogLevel
		want  []string // msg of each line
	}{
		{telemetry.AccessLogAll, []string{"connection opened", "connection closed"}},
		{telemetry.AccessLogErrors, nil},
	} {
		m, buf := bufferedMetrics(t, tc.level, 1, true)
		c := m.Open(info(telemetry.ReporterSource, true))
		c.Received(3)
		c.Close(telemetry.ReasonClientClosed, nil)
		m.FlushAccessLog()
		var got []string
		var open map[string]any
		for l := range strings.SplitSeq(strings.TrimSpace(buf.String()), "\n") {
			if l == "" {
				continue
			}
			var v map[string]any
			if err := json.Unmarshal([]byte(l), &v); err != nil {
				t.Fatal(err)
			}
			if open == nil {
				open = v
			}
			got = append(got, v["msg"].(string))
		}
		if strings.Join(got, ",") != strings.Join(tc.want, ",") {
			t.Errorf("level %s: lines %v, want %v", tc.level, got, tc.want)
		}
		if tc.level == telemetry.AccessLogAll {
			if len(open) != 30 || open["end_time"] != "" || open["reason"] != "" || open["bytes_to_dst"] != 0.0 || open["dst_service"] != "db.b.svc.cluster.local" {
				t.Errorf("open line %v", open)
			}
		}
	}
}

// syncBuffer is a bytes.Buffer for the flush timer's writes and the test's
// reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestAccessLogBuffered: lines are held, then written without another
// line or a Flush (the flush timer), at once when FlushSize is held, and
// at Flush.
func TestAccessLogBuffered(t *testing.T) {
	var out syncBuffer
	al, err := telemetry.NewAccessLog(&out, telemetry.AccessLogAll, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	m := telemetry.NewWithAccessLog(al)
	m.Open(info(telemetry.ReporterSource, false)).Close(telemetry.ReasonClientClosed, nil)
	// The timer writes it, however long that takes here.
	for strings.Count(out.String(), "\n") != 1 {
		time.Sleep(time.Millisecond)
	}
	// Enough lines to pass FlushSize are written without waiting.
	n := 0
	for len(out.String()) < telemetry.FlushSize {
		m.Open(info(telemetry.ReporterSource, false)).Close(telemetry.ReasonClientClosed, nil)
		n++
		if n > telemetry.FlushSize {
			t.Fatalf("%d lines held, none written", n)
		}
	}
	m.Open(info(telemetry.ReporterSource, false)).Close(telemetry.ReasonClientClosed, nil)
	m.FlushAccessLog()
	if got := strings.Count(out.String(), "\n"); got != n+2 {
		t.Errorf("%d lines written after Flush, want %d", got, n+2)
	}
}

// stuckWriter is a stdout nobody drains until release is closed.
type stuckWriter struct {
	release chan struct{}
	mu      sync.Mutex
	lines   int
}

func (w *stuckWriter) Write(p []byte) (int, error) {
	<-w.release
	w.mu.Lock()
	defer w.mu.Unlock()
	w.lines += bytes.Count(p, []byte("\n"))
	return len(p), nil
}

// TestAccessLogStuckStdout: while stdout does not drain, connections still
// close (none waits for it), lines past MaxHeld are dropped and counted,
// and what was held is written once it drains.
func TestAccessLogStuckStdout(t *testing.T) {
	w := &stuckWriter{release: make(chan struct{})}
	al, err := telemetry.NewAccessLog(w, telemetry.AccessLogAll, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	m := telemetry.NewWithAccessLog(al)
	// Each line is ~800 bytes: 4,000 lines pass MaxHeld (1 MiB) beyond
	// the 64 KiB under way.
	const n = 4000
	for range n {
		m.Open(info(telemetry.ReporterSource, false)).Close(telemetry.ReasonClientClosed, nil)
	}
	dropped := al.Dropped()
	if dropped == 0 {
		t.Fatalf("no line dropped with %d lines held behind a stuck stdout", n)
	}
	if got := gather(t, m, false)["aether_proxy_access_log_dropped_total"]; got != float64(dropped) {
		t.Errorf("aether_proxy_access_log_dropped_total = %v, want %d", got, dropped)
	}
	close(w.release)
	m.FlushAccessLog()
	w.mu.Lock()
	defer w.mu.Unlock()
	if uint64(w.lines)+dropped != n {
		t.Errorf("%d lines written + %d dropped, want %d", w.lines, dropped, n)
	}
}

// TestAccessLogSampleRate checks that a rate keeps about that share: 2,000
// lines at 0.25 keep between 350 and 650 (binomial, > 10 sigma either
// side).
func TestAccessLogSampleRate(t *testing.T) {
	m, buf := bufferedMetrics(t, telemetry.AccessLogAll, 0.25, false)
	for range 2000 {
		m.Open(info(telemetry.ReporterSource, false)).Close(telemetry.ReasonClientClosed, nil)
	}
	m.FlushAccessLog()
	if n := strings.Count(buf.String(), "\n"); n < 350 || n > 650 {
		t.Errorf("rate 0.25 kept %d of 2000 lines", n)
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

// BenchmarkSeriesMemory: the heap the istio_tcp_* families hold for 1,000
// workload pairs, each with one proxied connection (opened, closed, sent
// and received: the usual four series of a pair) and one refused (a closed
// series with CONNECT), reported per pair and per series.
func BenchmarkSeriesMemory(b *testing.B) {
	const pairs = 1000
	for range b.N {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		m := telemetry.New()
		for i := range pairs {
			ci := info(telemetry.ReporterSource, true)
			ci.Source.Workload = "web-" + strconv.Itoa(i)
			ci.Destination.Workload = "db-" + strconv.Itoa(i)
			c := m.Open(ci)
			c.Received(100)
			c.Sent(100)
			c.Close(telemetry.ReasonClientClosed, nil)
			m.Refused(ci, telemetry.ReasonConnectFailed, nil)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		runtime.KeepAlive(m)
		heap := float64(after.HeapAlloc) - float64(before.HeapAlloc)
		b.ReportMetric(heap/pairs, "B/pair")
		b.ReportMetric(heap/(pairs*5), "B/series")
		b.ReportMetric(heap, "B/1000-pairs")
	}
}

// BenchmarkConnTelemetry: what one connection costs the telemetry, Open,
// a Received and a Sent, Close: the istio_tcp_* series only (off), with
// the access log at all writing its line to a file (all), and with a flows
// subscriber that never reads (flows-unread: its queue full, every event
// dropped and counted). The differences are the access log's and the
// flows' costs per connection, to set against the proxy's CPU per
// connection (proxy/dataplane BenchmarkConnectTelemetry,
// BenchmarkConnectFlows).
func BenchmarkConnTelemetry(b *testing.B) {
	for _, mode := range []string{"off", "all", "flows-unread"} {
		b.Run(mode, func(b *testing.B) {
			m := telemetry.New()
			if mode == "flows-unread" {
				s, err := m.Flows().Subscribe(flowapi.Request{})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(s.Close)
			}
			if mode == "all" {
				f, err := os.Create(filepath.Join(b.TempDir(), "access.log"))
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { _ = f.Close() })
				al, err := telemetry.NewAccessLog(f, telemetry.AccessLogAll, 1, false)
				if err != nil {
					b.Fatal(err)
				}
				m = telemetry.NewWithAccessLog(al)
			}
			ci := info(telemetry.ReporterSource, true)
			b.ReportAllocs()
			for range b.N {
				c := m.Open(ci)
				c.Received(100)
				c.Sent(100)
				c.Close(telemetry.ReasonClientClosed, nil)
			}
		})
	}
}

// BenchmarkGather: one scrape of the registry (Gather: what /metrics
// encodes) holding the series of 1,000 workload pairs as
// BenchmarkSeriesMemory lays them out.
func BenchmarkGather(b *testing.B) {
	m := telemetry.New()
	for i := range 1000 {
		ci := info(telemetry.ReporterSource, true)
		ci.Source.Workload = "web-" + strconv.Itoa(i)
		ci.Destination.Workload = "db-" + strconv.Itoa(i)
		c := m.Open(ci)
		c.Received(100)
		c.Close(telemetry.ReasonClientClosed, nil)
		m.Refused(ci, telemetry.ReasonConnectFailed, nil)
	}
	b.ReportAllocs()
	for range b.N {
		if _, err := m.Registry.Gather(); err != nil {
			b.Fatal(err)
		}
	}
}
