package proxy_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	discovery "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	cachev3 "github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	serverv3 "github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"

	workload "aether.io/node/api/istio/workload"
	"aether.io/node/proxy"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/test/harness"
	"aether.io/node/xds/listener"
	"aether.io/node/xds/resource"
)

func TestMain(m *testing.M) { harness.Main(m) }

// agent stands in for aether-agent's xDS side with go-control-plane's own
// delta server and linear caches, one per type.
type agent struct {
	// requests receives every delta request the proxy sends.
	requests  chan *discovery.DeltaDiscoveryRequest
	socket    string
	listeners *cachev3.LinearCache
	workloads *cachev3.LinearCache
	policies  *cachev3.LinearCache
	// stop ends the server (its streams too), as an agent that dies;
	// later calls do nothing.
	stop func()
}

func startAgent(t testing.TB) *agent {
	t.Helper()
	return startAgentAt(t, filepath.Join(t.TempDir(), "xds.sock"))
}

// startAgentAt is startAgent serving socket (an agent restarted on the
// socket of one that stopped: fresh caches, the resources yet to add).
func startAgentAt(t testing.TB, socket string) *agent {
	t.Helper()
	a := &agent{
		requests:  make(chan *discovery.DeltaDiscoveryRequest, 256),
		socket:    socket,
		listeners: cachev3.NewLinearCache(resource.ListenerType),
		workloads: cachev3.NewLinearCache(resource.AddressType),
		policies:  cachev3.NewLinearCache(resource.AuthorizationType),
	}
	mux := &cachev3.MuxCache{
		Classify:      func(r *cachev3.Request) string { return r.GetTypeUrl() },
		ClassifyDelta: func(r *cachev3.DeltaRequest) string { return r.GetTypeUrl() },
		Caches:        map[string]cachev3.Cache{resource.ListenerType: a.listeners, resource.AddressType: a.workloads, resource.AuthorizationType: a.policies},
	}
	ctx, cancel := context.WithCancel(context.Background())
	cb := serverv3.CallbackFuncs{StreamDeltaRequestFunc: func(_ int64, r *discovery.DeltaDiscoveryRequest) error {
		select {
		case a.requests <- r:
		default:
		}
		return nil
	}}
	srv := serverv3.NewServer(ctx, mux, cb)
	g := grpc.NewServer()
	discovery.RegisterAggregatedDiscoveryServiceServer(g, srv)
	ln, err := net.Listen("unix", a.socket)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	a.stop = sync.OnceFunc(func() { cancel(); g.Stop() })
	t.Cleanup(a.stop)
	return a
}

// addPod publishes the pod's listeners and workload, as the agent does at
// AddPod.
func (a *agent) addPod(t testing.TB, p *proxytest.Pod) {
	t.Helper()
	ls, err := listener.Build(p.Record())
	if err != nil {
		t.Fatal(err)
	}
	up := map[string]types.Resource{}
	for _, l := range ls {
		up[l.GetName()] = l
	}
	if err := a.listeners.UpdateResources(up, nil); err != nil {
		t.Fatal(err)
	}
	w := p.Workload()
	if err := a.workloads.UpdateResource(w.GetUid(), &workload.Address{Type: &workload.Address_Workload{Workload: w}}); err != nil {
		t.Fatal(err)
	}
}

// removePod withdraws the pod's listeners, as the agent does at RemovePod.
func (a *agent) removePod(t *testing.T, p *proxytest.Pod) {
	t.Helper()
	var names []string
	for _, r := range listener.Roles {
		names = append(names, listener.ListenerName(p.Record().ContainerID, r))
	}
	if err := a.listeners.UpdateResources(nil, names); err != nil {
		t.Fatal(err)
	}
}

// runProxy runs a proxy until the test ends; Run must end without error.
func runProxy(t *testing.T, cfg proxy.Config) *proxy.Proxy {
	t.Helper()
	return runProxyLog(t, cfg, slog.New(slog.NewTextHandler(os.Stderr, nil)))
}

// runProxyLog is runProxy logging to log.
func runProxyLog(t *testing.T, cfg proxy.Config, log *slog.Logger) *proxy.Proxy {
	t.Helper()
	p, err := proxy.New(cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("proxy.Run: %v", err)
		}
	})
	return p
}

func metrics(t *testing.T, addr net.Addr) string {
	t.Helper()
	resp, err := http.Get("http://" + addr.String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestEndToEnd: listeners and workloads arrive over delta ADS from
// go-control-plane's server; the proxy binds both pods' listeners in their
// netns; both pods have the divert installed by pkg/capture; the client connects to the
// server pod's IP over IPv4 and IPv6; the connection is captured and proxied
// (the server sees the bytes) and /metrics names both workloads; removing
// the client's listeners drains it.
func TestEndToEnd(t *testing.T) {
	topo := proxytest.New(t, []string{"client", "server"}, "client", "server")
	client, server := topo.Pods[0], topo.Pods[1]
	ag := startAgent(t)
	ag.addPod(t, client)
	ag.addPod(t, server)

	access := &lockedBuffer{}
	p := runProxy(t, proxy.Config{
		XDSTarget: "unix://" + ag.socket, NodeID: "node-1", AdminAddress: "127.0.0.1:0",
		AccessLog: telemetry.AccessLogAll, AccessLogOutput: access,
	})
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer wcancel()
	admin, err := p.AdminAddr(wctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, pod := range []*proxytest.Pod{client, server} {
		err := proxytest.WaitFor(wctx, func() bool { return pod.ReadyCode(wctx) == 200 })
		if err != nil {
			t.Fatalf("pod %s never ready: %+v", pod.Name, p.Manager.Status())
		}
	}
	if err := proxytest.WaitFor(wctx, func() bool { return p.Peers.Len() == 2 }); err != nil {
		t.Fatalf("WDS index has %d workloads, want 2", p.Peers.Len())
	}

	srv := server.Serve(t, 8080)
	for _, dst := range []netip.Addr{server.IP4, server.IP6} {
		c, err := client.Dial(wctx, netip.AddrPortFrom(dst, 8080))
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		payload := "payload to " + dst.String()
		if _, err := c.Write([]byte(payload)); err != nil {
			t.Fatal(err)
		}
		_ = c.CloseWrite()
		reply, err := io.ReadAll(c)
		c.Close()
		if err != nil || !strings.HasPrefix(string(reply), fmt.Sprintf("got %d from ", len(payload))) {
			t.Fatalf("reply %q, %v", reply, err)
		}
		select {
		case got := <-srv.Got:
			if !strings.HasSuffix(got, " "+payload) {
				t.Errorf("server got %q", got)
			}
		case <-wctx.Done():
			t.Fatal("server saw nothing")
		}
	}
	// And the other way: the server pod's own outbound connection to the
	// client is captured by the server's divert.
	back := client.Serve(t, 9090)
	c, err := server.Dial(wctx, netip.AddrPortFrom(client.IP6, 9090))
	if err != nil {
		t.Fatal(err)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	_, _ = c.Write([]byte("reverse"))
	_ = c.CloseWrite()
	if reply, err := io.ReadAll(c); err != nil || string(reply) != "got 7 from "+server.IP6.String() {
		t.Fatalf("reverse reply %q, %v", reply, err)
	}
	c.Close()
	<-back.Got
	// Istio's series, reported by the source side (the capturing pod's
	// outbound), with Istio's labels: plaintext, so no source principal.
	backLabels := []string{
		`reporter="source"`, `source_workload="server"`, `source_canonical_service="server-svc"`, `source_app="server-svc"`,
		`source_workload_namespace="default"`, `source_principal="unknown"`, `destination_workload="client"`,
		`destination_canonical_service="client-svc"`, `destination_app="client-svc"`, `destination_workload_namespace="default"`,
		`destination_service="unknown"`, `request_protocol="tcp"`, `response_flags="-"`, `connection_security_policy="none"`,
	}
	if l := seriesLine(metrics(t, admin), "istio_tcp_connections_opened_total", backLabels...); !strings.HasSuffix(l, " 1") {
		t.Errorf("metrics lack istio_tcp_connections_opened_total %v = 1 (found %q):\n%s", backLabels, l, grepSeries(metrics(t, admin)))
	}
	labels := []string{
		`reporter="source"`, `source_workload="client"`, `source_canonical_service="client-svc"`,
		`destination_workload="server"`, `destination_canonical_service="server-svc"`, `response_flags="-"`, `connection_security_policy="none"`,
	}
	if err := proxytest.WaitFor(wctx, func() bool {
		return strings.HasSuffix(seriesLine(metrics(t, admin), "istio_tcp_connections_closed_total", labels...), " 2")
	}); err != nil {
		t.Fatalf("metrics lack istio_tcp_connections_closed_total %v = 2:\n%s", labels, grepSeries(metrics(t, admin)))
	}
	if seriesLine(metrics(t, admin), "istio_tcp_received_bytes_total", labels...) == "" {
		t.Errorf("no received bytes series")
	}
	// The access log (AccessLogOutput, at all): a line per connection,
	// the client's two and the server's one.
	if err := proxytest.WaitFor(wctx, func() bool {
		return strings.Count(access.String(), `"msg":"connection closed"`) >= 3
	}); err != nil {
		t.Fatalf("access log has fewer than 3 lines:\n%s", access.String())
	}
	for _, want := range []string{`"reporter":"source","start_time":`, `"src_workload":"client"`, `"dst_workload":"server"`, `"reason":"client_closed"`} {
		if !strings.Contains(access.String(), want) {
			t.Errorf("access log lacks %s:\n%s", want, access.String())
		}
	}

	// RemovePod: the client's listeners are withdrawn and drained.
	ag.removePod(t, client)
	// The readiness listener is closed after the drain.
	err = proxytest.WaitFor(wctx, func() bool { return client.ReadyCode(wctx) == 0 })
	if err != nil {
		t.Fatalf("client listeners still open after RemovePod: %+v", p.Manager.Status())
	}
	if code, err := server.Readiness(wctx); err != nil || code != 200 {
		t.Errorf("server readiness after the client's removal: %d, %v", code, err)
	}
	if p.XDS.Acks() < 3 {
		t.Errorf("proxy ACKed %d responses, want at least 3", p.XDS.Acks())
	}
}

// seriesLine returns the first sample line of metric name in the scraped
// text whose labels include every one of labels (`name="value"`); "" when
// none does.
func seriesLine(text, name string, labels ...string) string {
next:
	for l := range strings.SplitSeq(text, "\n") {
		if !strings.HasPrefix(l, name+"{") {
			continue
		}
		for _, want := range labels {
			if !strings.Contains(l, "{"+want+",") && !strings.Contains(l, ","+want+",") && !strings.Contains(l, ","+want+"}") {
				continue next
			}
		}
		return l
	}
	return ""
}

// grepSeries returns the proxy's own and Istio's series of a scrape.
func grepSeries(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, "aether_") || strings.HasPrefix(l, "istio_") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestNackKeepsValidListeners: a listener the proxy cannot use (no pod
// metadata) is NACKed with a reason; the valid listeners of the same
// response are served anyway. After a reconnect the proxy sends the versions
// it holds (initial_resource_versions).
func TestNackKeepsValidListeners(t *testing.T) {
	topo := proxytest.New(t, []string{"client"})
	client := topo.Pods[0]
	ag := startAgent(t)
	ag.addPod(t, client)
	if err := ag.listeners.UpdateResource("foreign", &listenerv3.Listener{Name: "foreign"}); err != nil {
		t.Fatal(err)
	}
	p := runProxy(t, proxy.Config{XDSTarget: "unix://" + ag.socket, NodeID: "node-1"})
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer wcancel()
	var nack *discovery.DeltaDiscoveryRequest
	for nack == nil {
		select {
		case r := <-ag.requests:
			if r.GetErrorDetail() != nil {
				nack = r
			}
		case <-wctx.Done():
			t.Fatal("no NACK for the foreign listener")
		}
	}
	if nack.GetTypeUrl() != resource.ListenerType || !strings.Contains(nack.GetErrorDetail().GetMessage(), "foreign") {
		t.Errorf("NACK %s: %q, want the listener type naming \"foreign\"", nack.GetTypeUrl(), nack.GetErrorDetail().GetMessage())
	}
	err := proxytest.WaitFor(wctx, func() bool { return client.ReadyCode(wctx) == 200 })
	if err != nil {
		t.Fatalf("valid listeners not served after a NACK: %+v", p.Manager.Status())
	}
}

// TestSplitStreams: with LDSTarget set, listeners come from one server and
// workloads from another.
func TestSplitStreams(t *testing.T) {
	topo := proxytest.New(t, []string{"client"})
	client := topo.Pods[0]
	agW, agL := startAgent(t), startAgent(t)
	ls, err := listener.Build(client.Record())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls {
		if err := agL.listeners.UpdateResource(l.GetName(), l); err != nil {
			t.Fatal(err)
		}
	}
	w := client.Workload()
	if err := agW.workloads.UpdateResource(w.GetUid(), &workload.Address{Type: &workload.Address_Workload{Workload: w}}); err != nil {
		t.Fatal(err)
	}
	p := runProxy(t, proxy.Config{XDSTarget: "unix://" + agW.socket, LDSTarget: "unix://" + agL.socket, NodeID: "node-1"})
	wctx, wcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer wcancel()
	err = proxytest.WaitFor(wctx, func() bool { return client.ReadyCode(wctx) == 200 && p.Peers.Len() == 1 })
	if err != nil {
		t.Fatalf("split streams: pods %+v, %d workloads", p.Manager.Status(), p.Peers.Len())
	}
}

// lockedBuffer is a bytes.Buffer safe for the access log's concurrent
// writes and the test's reads.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
