package dataplane_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/xds/listener"
)

// accessLog collects the access log's lines (the proxy's stdout).
type accessLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *accessLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines parses every line written so far.
func (l *accessLog) lines(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	text := l.b.String()
	l.mu.Unlock()
	var out []map[string]any
	for line := range strings.SplitSeq(strings.TrimSpace(text), "\n") {
		if line == "" {
			continue
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(line), &v); err != nil {
			t.Fatalf("access log line %q is no JSON object: %v", line, err)
		}
		out = append(out, v)
	}
	return out
}

// await waits up to 10 s for a line carrying every field of want (values
// compared as printed) and returns it.
func (l *accessLog) await(t *testing.T, want map[string]any) map[string]any {
	t.Helper()
	var found map[string]any
	match := func() bool {
	next:
		for _, v := range l.lines(t) {
			for k, w := range want {
				if fmt.Sprint(v[k]) != fmt.Sprint(w) {
					continue next
				}
			}
			found = v
			return true
		}
		return false
	}
	if err := proxytest.WaitFor(ctx10(t), match); err != nil {
		var all []string
		for _, v := range l.lines(t) {
			all = append(all, fmt.Sprint(v))
		}
		t.Fatalf("no access log line with %v; lines:\n%s", want, strings.Join(all, "\n"))
	}
	return found
}

// accessMetrics returns metrics writing every connection to the returned
// access log.
func accessMetrics(t *testing.T) (*telemetry.Metrics, *accessLog) {
	t.Helper()
	out := &accessLog{}
	al, err := telemetry.NewAccessLog(out, telemetry.AccessLogAll, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	return telemetry.NewWithAccessLog(al), out
}

// echoRound dials dst from pod, has one byte echoed back and returns the
// connection, proxied and established.
func echoRound(t *testing.T, pod *proxytest.Pod, dst netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := pod.Dial(ctx10(t), dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatalf("echo through the proxy: %v", err)
	}
	return c
}

// awaitEnd waits up to 10 s for c to be closed under it (by the proxy).
func awaitEnd(t *testing.T, c *net.TCPConn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(c); err != nil && strings.Contains(err.Error(), "timeout") {
		t.Fatal("the proxy did not close the connection within 10 s")
	}
}

// TestAccessLogCloseReasons causes every close reason the access log
// writes, over real sockets in pod namespaces, and checks its line: a
// client that closes first, a server that closes first, a server that
// resets, a refused upstream, a connection to the proxy's own port, the
// pod's connection cap, the idle timeout, a drain that runs out of time, the
// proxy stopping; over HBONE both sides' lines of one connection (mutual TLS,
// both principals, the Service on each side), a Service without endpoints
// and a port -hbone-declared-ports-only refuses.
func TestAccessLogCloseReasons(t *testing.T) {
	t.Run("plain", func(t *testing.T) {
		m, log := accessMetrics(t)
		e := setupMetrics(t, dataplane.Config{ConnectTimeout: 3 * time.Second}, m)
		e.server.Serve(t, 8080)
		e.server.Handle(t, 8081, func(c net.Conn) { _, _ = c.Write([]byte("bye")) })
		e.server.Handle(t, 8082, func(c net.Conn) {
			_, _ = c.Read(make([]byte, 1))
			_ = c.(*net.TCPConn).SetLinger(0)
		})
		e.server.Echo(t, 8083)
		base := map[string]any{
			"reporter": "source", "src_workload": "client", "src_pod": "client", "src_namespace": "default",
			"dst_workload": "server", "dst_namespace": "default", "path": "plaintext", "security": "none",
			"policy_decision": "none", "src_principal": "", "dst_principal": "",
		}
		with := func(kv ...any) map[string]any {
			w := map[string]any{}
			for k, v := range base {
				w[k] = v
			}
			for i := 0; i < len(kv); i += 2 {
				w[kv[i].(string)] = kv[i+1]
			}
			return w
		}

		t.Run("client_closed", func(t *testing.T) {
			dst := netip.AddrPortFrom(e.server.IP4, 8080)
			reply, err := roundTrip(ctx10(t), e.client, dst, "hello")
			if err != nil {
				t.Fatal(err)
			}
			l := log.await(t, with("dst_addr", dst, "reason", "client_closed", "response_flags", "-", "error", "", "level", "INFO"))
			if l["bytes_to_dst"] != 5.0 || l["bytes_to_src"] != float64(len(reply)) {
				t.Errorf("bytes %v to dst, %v to src; want 5, %d", l["bytes_to_dst"], l["bytes_to_src"], len(reply))
			}
			if !strings.HasPrefix(fmt.Sprint(l["src_addr"]), e.client.IP4.String()+":") {
				t.Errorf("src_addr %v, want the client's address", l["src_addr"])
			}
			start, err1 := time.Parse(time.RFC3339Nano, fmt.Sprint(l["start_time"]))
			end, err2 := time.Parse(time.RFC3339Nano, fmt.Sprint(l["end_time"]))
			if err1 != nil || err2 != nil || end.Before(start) {
				t.Errorf("start_time %v, end_time %v: %v %v", l["start_time"], l["end_time"], err1, err2)
			}
		})
		t.Run("server_closed", func(t *testing.T) {
			dst := netip.AddrPortFrom(e.server.IP6, 8081)
			c, err := e.client.Dial(ctx10(t), dst)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			if b, err := io.ReadAll(c); err != nil || string(b) != "bye" {
				t.Fatalf("read %q, %v", b, err)
			}
			_ = c.Close()
			log.await(t, with("dst_addr", dst, "reason", "server_closed", "bytes_to_src", 3, "bytes_to_dst", 0))
		})
		t.Run("reset", func(t *testing.T) {
			dst := netip.AddrPortFrom(e.server.IP4, 8082)
			c, err := e.client.Dial(ctx10(t), dst)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			_, _ = c.Write([]byte("x"))
			_, _ = io.ReadAll(c)
			_ = c.Close()
			l := log.await(t, with("dst_addr", dst, "reason", "reset", "level", "WARN"))
			if l["error"] == "" {
				t.Error("a reset carries no error")
			}
		})
		t.Run("connect_failed", func(t *testing.T) {
			dst := netip.AddrPortFrom(e.server.IP4, 9) // nothing listens
			c, err := e.client.Dial(ctx10(t), dst)
			if err == nil {
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				_, _ = c.Read(make([]byte, 1))
				_ = c.Close()
			}
			l := log.await(t, with("dst_addr", dst, "reason", "connect_failed", "response_flags", "CONNECT"))
			if !strings.Contains(fmt.Sprint(l["error"]), "refused") {
				t.Errorf("error %q, want the refusal", l["error"])
			}
		})
		t.Run("misdirected", func(t *testing.T) {
			var port uint16
			for _, s := range e.client.Specs(t) {
				if s.Role == listener.RoleCapture {
					port = s.Binds[0].Addr.Port()
				}
			}
			dst := netip.AddrPortFrom(e.client.IP4, port)
			if c, err := e.client.Dial(ctx10(t), dst); err == nil {
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				_, _ = c.Read(make([]byte, 1))
				_ = c.Close()
			}
			log.await(t, map[string]any{"reporter": "source", "dst_addr": dst, "reason": "misdirected"})
		})
		t.Run("pod_closed", func(t *testing.T) {
			dst := netip.AddrPortFrom(e.server.IP4, 8083)
			c := echoRound(t, e.client, dst)
			e.stop() // the proxy stops (ShutdownDrain 0: at once)
			awaitEnd(t, c)
			log.await(t, with("dst_addr", dst, "reason", "pod_closed", "bytes_to_dst", 1, "bytes_to_src", 1))
		})
	})

	t.Run("limit", func(t *testing.T) {
		m, log := accessMetrics(t)
		e := setupMetrics(t, dataplane.Config{MaxConnsPerPod: 1}, m)
		e.server.Echo(t, 8080)
		dst := netip.AddrPortFrom(e.server.IP4, 8080)
		echoRound(t, e.client, dst) // holds the pod's one slot
		if c, err := e.client.Dial(ctx10(t), dst); err == nil {
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			_, _ = c.Read(make([]byte, 1))
			_ = c.Close()
		}
		log.await(t, map[string]any{
			"reporter": "source", "dst_addr": dst, "reason": "limit", "limit": "pod_connections",
			"response_flags": "UO", "src_workload": "client", "dst_workload": "server",
		})
	})

	t.Run("idle_timeout", func(t *testing.T) {
		m, log := accessMetrics(t)
		e := setupMetrics(t, dataplane.Config{TCPIdleTimeout: 200 * time.Millisecond, CheckInterval: 20 * time.Millisecond}, m)
		e.server.Echo(t, 8080)
		dst := netip.AddrPortFrom(e.server.IP4, 8080)
		awaitEnd(t, echoRound(t, e.client, dst))
		log.await(t, map[string]any{"reporter": "source", "dst_addr": dst, "reason": "idle_timeout", "error": "", "response_flags": "-"})
	})

	t.Run("drain_deadline", func(t *testing.T) {
		m, log := accessMetrics(t)
		e := setupMetrics(t, dataplane.Config{DrainTimeout: 100 * time.Millisecond}, m)
		e.server.Echo(t, 8080)
		dst := netip.AddrPortFrom(e.server.IP6, 8080)
		c := echoRound(t, e.client, dst)
		e.set(t, e.server) // the client pod's listeners are withdrawn: it drains
		awaitEnd(t, c)
		log.await(t, map[string]any{"reporter": "source", "dst_addr": dst, "reason": "drain_deadline"})
	})

	t.Run("hbone", func(t *testing.T) {
		m, log := accessMetrics(t)
		svcs := peers.NewServices()
		e := setupHBONEMetrics(t, dataplane.Config{ConnectTimeout: 3 * time.Second, Services: svcs, HBONEDeclaredPortsOnly: true}, m)
		vip4, vip6 := netip.MustParseAddr("10.88.0.200"), netip.MustParseAddr("fd88::200")
		mesh := serviceOf("mesh", vip4, vip6)
		empty := serviceOf("empty", netip.MustParseAddr("10.88.0.202"), netip.MustParseAddr("fd88::202"))
		svcs.UpsertService(mesh)
		svcs.UpsertService(empty)
		svcs.UpsertWorkload(member(hboneWorkload(e.server, true), mesh))
		svcs.UpsertWorkload(hboneWorkload(e.client, true))
		e.server.Serve(t, 8080)
		e.server.Echo(t, 9090)
		// The server declares 8080 only.
		specs := e.server.Specs(t)
		for i := range specs {
			specs[i].DeclaredPortsKnown, specs[i].DeclaredTCPPorts = true, []uint16{8080}
		}
		e.mgr.SetListeners(append(e.client.Specs(t), specs...))
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			i := slices.IndexFunc(e.mgr.Status(), func(s dataplane.PodStatus) bool { return s.Name == e.server.Name })
			return i >= 0 && e.mgr.Status()[i].DeclaredPortsKnown
		}); err != nil {
			t.Fatal("the server's declared ports never applied")
		}
		clientID, serverID := podID(e.client).String(), podID(e.server).String()

		t.Run("both sides over a Service", func(t *testing.T) {
			vip := netip.AddrPortFrom(vip4, 80)
			if _, err := roundTrip(ctx10(t), e.client, vip, "svc"); err != nil {
				t.Fatal(err)
			}
			target := netip.AddrPortFrom(e.server.IP4, 8080)
			for _, reporter := range []string{"source", "destination"} {
				l := log.await(t, map[string]any{
					"reporter": reporter, "dst_addr": target, "path": "hbone", "security": "mutual_tls",
					"src_principal": clientID, "dst_principal": serverID, "src_workload": "client", "dst_workload": "server",
					"dst_service": "mesh.default.svc.cluster.local", "bytes_to_dst": 3, "reason": "client_closed",
				})
				// The source side has the client's socket; the destination
				// side the tunnel connection's, from the client pod too.
				if src, err := netip.ParseAddrPort(fmt.Sprint(l["src_addr"])); err != nil || src.Addr() != e.client.IP4 || src.Port() == 0 {
					t.Errorf("%s: src_addr %v, want the client pod's address and a port", reporter, l["src_addr"])
				}
				labels := map[string]string{
					"reporter": reporter, "destination_service": "mesh.default.svc.cluster.local", "destination_service_name": "mesh",
					"destination_service_namespace": "default", "connection_security_policy": "mutual_tls",
					"source_principal": clientID, "destination_principal": serverID, "source_workload": "client",
					"destination_workload": "server", "response_flags": "-",
				}
				if got := sum(e.metrics, "istio_tcp_connections_closed_total", labels); got != 1 {
					t.Errorf("istio_tcp_connections_closed_total%v = %v, want 1", labels, got)
				}
			}
		})
		t.Run("no_endpoint", func(t *testing.T) {
			vip := netip.AddrPortFrom(netip.MustParseAddr("10.88.0.202"), 80)
			if c, err := e.client.Dial(ctx10(t), vip); err == nil {
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				_, _ = c.Read(make([]byte, 1))
				_ = c.Close()
			}
			log.await(t, map[string]any{
				"reporter": "source", "dst_addr": vip, "reason": "no_endpoint",
				"response_flags": "UH", "dst_service": "empty.default.svc.cluster.local", "src_workload": "client",
			})
			if got := sum(e.metrics, "istio_tcp_connections_closed_total", map[string]string{"destination_service_name": "empty", "response_flags": "UH"}); got != 1 {
				t.Errorf("closed{destination_service_name=empty,response_flags=UH} = %v, want 1", got)
			}
		})
		t.Run("denied", func(t *testing.T) {
			target := netip.AddrPortFrom(e.server.IP4, 9090)
			if _, err := roundTrip(ctx10(t), e.client, target, "no"); err == nil {
				t.Fatal("a stream to an undeclared port was delivered")
			}
			log.await(t, map[string]any{
				"reporter": "destination", "dst_addr": target, "reason": "denied",
				"policy_decision": "deny", "policy": "hbone-declared-ports-only", "response_flags": "DENY",
				"src_principal": clientID, "dst_workload": "server",
			})
			if got := sum(e.metrics, "istio_tcp_connections_closed_total", map[string]string{"reporter": "destination", "response_flags": "DENY"}); got != 1 {
				t.Errorf("closed{reporter=destination,response_flags=DENY} = %v, want 1", got)
			}
		})
	})
}

// telemetryEnv is a client and server pod pair whose proxy writes the
// access log at all (to a file, as to a redirected stdout) or not at all.
func telemetryEnv(b *testing.B, accessLog bool) (*env, *telemetry.Metrics) {
	m := telemetry.New()
	if accessLog {
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
	e := setupMetrics(b, dataplane.Config{}, m)
	e.server.Echo(b, 9001)
	return e, m
}

// connectRounds runs n connections (connect plus a one-byte round trip)
// from e's client to its echo server, waits until the proxy counted them
// all closed (want in total), and returns the process CPU time they took;
// with lat, it appends each connection's latency (connect to the byte
// back) to it.
func connectRounds(b *testing.B, e *env, m *telemetry.Metrics, n int, want float64, lat *[]time.Duration) time.Duration {
	dst := netip.AddrPortFrom(e.server.IP4, 9001)
	one := []byte{1}
	cpu := hbonetest.CPUTime()
	for range n {
		start := time.Now()
		c := benchDial(b, e, "ours", dst)
		if _, err := c.Write(one); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, one); err != nil {
			b.Fatal(err)
		}
		if lat != nil {
			*lat = append(*lat, time.Since(start))
		}
		_ = c.SetLinger(0) // no TIME_WAIT pile-up across iterations
		c.Close()
	}
	// The proxy's side of the last connections ends after the client's.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := proxytest.WaitFor(ctx, func() bool { return sum(m, "istio_tcp_connections_closed_total", nil) >= want }); err != nil {
		b.Fatal(err)
	}
	return hbonetest.CPUTime() - cpu
}

// BenchmarkConnectTelemetry: the CPU time of the whole process (client,
// proxy and echo server run in it) per proxied connection, connect plus a
// one-byte round trip, with the access log at all written to a file as to
// a redirected stdout (ours: the istio_tcp_* series and one JSON line per
// connection) against the access log off (peer: the series only; the
// proxy has no switch for its metrics); the goal is ≤ 1.05×
// (bench/goals/proxy.json). Each runs on its own pods; the machine's drift
// between the two runs is in the ratio (BenchmarkConnectTelemetryAB
// alternates them).
func BenchmarkConnectTelemetry(b *testing.B) {
	for _, mode := range []string{"peer", "ours"} {
		b.Run(mode, func(b *testing.B) {
			e, m := telemetryEnv(b, mode == "ours")
			b.ResetTimer()
			used := connectRounds(b, e, m, b.N, float64(b.N), nil)
			b.StopTimer()
			b.ReportMetric(float64(used.Nanoseconds())/float64(b.N), "cpu-ns/conn")
		})
	}
}

// BenchmarkConnectTelemetryAB is BenchmarkConnectTelemetry with both pod
// pairs up at once and the two alternated in blocks of 100 connections, so
// drift falls on both: cpu-ns/conn of each and their ratio (all/off).
func BenchmarkConnectTelemetryAB(b *testing.B) {
	const block = 100
	on, mOn := telemetryEnv(b, true)
	off, mOff := telemetryEnv(b, false)
	var cpuOn, cpuOff time.Duration
	var nOn, nOff int
	b.ResetTimer()
	for done := 0; done < b.N; done += 2 * block {
		cpuOff += connectRounds(b, off, mOff, block, float64(nOff+block), nil)
		nOff += block
		cpuOn += connectRounds(b, on, mOn, block, float64(nOn+block), nil)
		nOn += block
	}
	b.StopTimer()
	perOn, perOff := float64(cpuOn.Nanoseconds())/float64(nOn), float64(cpuOff.Nanoseconds())/float64(nOff)
	b.ReportMetric(perOn, "all-cpu-ns/conn")
	b.ReportMetric(perOff, "off-cpu-ns/conn")
	b.ReportMetric(perOn/perOff, "all/off")
}
