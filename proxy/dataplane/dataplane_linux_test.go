package dataplane_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"aether.io/node/pkg/readiness"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/test/harness"
	"aether.io/node/xds/listener"
)

func TestMain(m *testing.M) { harness.Main(m) }

type env struct {
	topo    *proxytest.Topology
	client  *proxytest.Pod
	server  *proxytest.Pod
	mgr     *dataplane.Manager
	metrics *telemetry.Metrics
	// stop ends the manager's Run (as SIGTERM does) and waits for it.
	stop func()
}

func setup(t testing.TB, cfg dataplane.Config) *env {
	t.Helper()
	return setupMetrics(t, cfg, telemetry.New())
}

// setupMetrics is setup with the manager's metrics (an access log).
func setupMetrics(t testing.TB, cfg dataplane.Config, m *telemetry.Metrics) *env {
	t.Helper()
	topo := proxytest.New(t, []string{"client", "server"}, "client", "server")
	e := &env{topo: topo, client: topo.Pods[0], server: topo.Pods[1], metrics: m}
	idx := peers.NewIndex()
	idx.Upsert(e.client.Workload())
	idx.Upsert(e.server.Workload())
	mgr, err := dataplane.New(cfg, idx, e.metrics, nil)
	if err != nil {
		t.Fatal(err)
	}
	e.mgr = mgr
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = mgr.Run(ctx); close(done) }()
	e.stop = sync.OnceFunc(func() { cancel(); <-done })
	t.Cleanup(func() { e.stop(); mgr.Close() })
	e.set(t, e.client, e.server)
	for _, p := range []*proxytest.Pod{e.client, e.server} {
		e.waitReady(t, p, 200)
	}
	return e
}

func (e *env) set(t testing.TB, pods ...*proxytest.Pod) {
	var specs []listener.Spec
	for _, p := range pods {
		specs = append(specs, p.Specs(t)...)
	}
	e.mgr.SetListeners(specs)
}

func ctx10(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func (e *env) waitReady(t testing.TB, p *proxytest.Pod, want int) {
	t.Helper()
	var last int
	var lastErr error
	err := proxytest.WaitFor(ctx10(t), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		last, lastErr = p.Readiness(ctx)
		return lastErr == nil && last == want
	})
	if err != nil {
		t.Fatalf("readiness of %s never answered %d (last %d, %v)", p.Name, want, last, lastErr)
	}
}

// sum adds the values of metric name whose labels include match.
func sum(m *telemetry.Metrics, name string, match map[string]string) float64 {
	mfs, _ := m.Registry.Gather()
	var total float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, mt := range mf.GetMetric() {
			l := map[string]string{}
			for _, lp := range mt.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			for k, v := range match {
				if l[k] != v {
					continue next
				}
			}
			total += mt.GetCounter().GetValue()
		}
	}
	return total
}

func opened(m *telemetry.Metrics, src, dst string) float64 {
	mfs, _ := m.Registry.Gather()
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != "istio_tcp_connections_opened_total" {
			continue
		}
		for _, mt := range mf.GetMetric() {
			l := map[string]string{}
			for _, lp := range mt.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			if l["source_workload"] == src && l["destination_workload"] == dst &&
				l["source_workload_namespace"] == "default" && l["destination_canonical_service"] == dst+"-svc" {
				sum += mt.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// TestCaptureForwardsTCP: a connection from the client pod to the server
// pod's IP is diverted to the proxy, forwarded from the client's netns with
// the bypass mark (the server sees the client's own IP), half-close passes
// through, and the metrics name both workloads.
func TestCaptureForwardsTCP(t *testing.T) {
	e := setup(t, dataplane.Config{})
	srv := e.server.Serve(t, 8080)
	for i, dst := range []netip.Addr{e.server.IP4, e.server.IP6} {
		t.Run(dst.String(), func(t *testing.T) {
			ctx := ctx10(t)
			c, err := e.client.Dial(ctx, netip.AddrPortFrom(dst, 8080))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			payload := fmt.Sprintf("hello-%d", i)
			if _, err := c.Write([]byte(payload)); err != nil {
				t.Fatal(err)
			}
			if err := c.CloseWrite(); err != nil { // half-close: the server reads EOF, then answers
				t.Fatal(err)
			}
			reply, err := io.ReadAll(c)
			if err != nil {
				t.Fatal(err)
			}
			src := e.client.IP4
			if dst.Is6() {
				src = e.client.IP6
			}
			if want := fmt.Sprintf("got %d from %s", len(payload), src); string(reply) != want {
				t.Errorf("reply %q, want %q", reply, want)
			}
			select {
			case got := <-srv.Got:
				if got != src.String()+" "+payload {
					t.Errorf("server got %q", got)
				}
			case <-ctx.Done():
				t.Fatal("server saw nothing")
			}
			// The proxy accounted the connection to both workloads.
			if err := proxytest.WaitFor(ctx, func() bool { return opened(e.metrics, "client", "server") >= float64(i+1) }); err != nil {
				t.Fatalf("no istio_tcp_connections_opened_total{source_workload=client,destination_workload=server}")
			}
		})
	}
	// Bytes are counted when a connection ends, after the client saw EOF.
	want := float64(len("hello-0") + len("hello-1"))
	if err := proxytest.WaitFor(ctx10(t), func() bool { return sum(e.metrics, "istio_tcp_received_bytes_total", nil) >= want }); err != nil {
		t.Errorf("istio_tcp_received_bytes_total = %v, want at least %v", sum(e.metrics, "istio_tcp_received_bytes_total", nil), want)
	}
}

// TestUpstreamRefusedResets: a refused upstream connect resets the
// captured connection and is counted.
func TestUpstreamRefusedResets(t *testing.T) {
	e := setup(t, dataplane.Config{})
	// Nothing listens on port 9. The kernel completes the client's handshake
	// with the capture socket before the proxy tries upstream, so the reset
	// reaches the client either while its connect returns or on its read.
	c, err := e.client.Dial(ctx10(t), netip.AddrPortFrom(e.server.IP4, 9))
	if err == nil {
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if err == nil || !strings.Contains(err.Error(), "reset") {
		t.Fatalf("connection to a refusing upstream = %v, want a reset", err)
	}
	if got := sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "connect"}); got != 1 {
		t.Errorf("aether_tcp_connections_failed_total{reason=connect} = %v, want 1", got)
	}
}

// TestUpstreamResetPropagates: the server resets; the client sees a reset.
func TestUpstreamResetPropagates(t *testing.T) {
	e := setup(t, dataplane.Config{})
	var ln net.Listener
	e.server.NS.MustDo(t, func() error {
		var err error
		ln, err = net.Listen("tcp", netip.AddrPortFrom(e.server.IP4, 7070).String())
		return err
	})
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		buf := make([]byte, 4)
		_, _ = io.ReadFull(c, buf)
		_ = c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}()
	c := dialPing(t, e.client, netip.AddrPortFrom(e.server.IP4, 7070))
	_, err := c.Read(make([]byte, 1))
	if err == nil || !strings.Contains(err.Error(), "reset") {
		t.Fatalf("read after the server's reset = %v, want a reset", err)
	}
}

// TestDrain: removing a pod's listeners turns readiness to 503 while an open
// connection still works; once it ends the pod's listeners are closed. A
// connection still open at the drain deadline ends with a FIN (EOF).
func TestDrain(t *testing.T) {
	for _, tc := range []struct {
		name     string
		deadline time.Duration
	}{{"finishes", time.Minute}, {"deadline", 300 * time.Millisecond}} {
		t.Run(tc.name, func(t *testing.T) {
			e := setup(t, dataplane.Config{DrainTimeout: tc.deadline})
			e.server.Echo(t, 8081)
			ctx := ctx10(t)
			c, err := e.client.Dial(ctx, netip.AddrPortFrom(e.server.IP4, 8081))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			echo := func(s string) error {
				if _, err := c.Write([]byte(s)); err != nil {
					return err
				}
				buf := make([]byte, len(s))
				if _, err := io.ReadFull(c, buf); err != nil {
					return err
				}
				if string(buf) != s {
					return fmt.Errorf("echo %q, want %q", buf, s)
				}
				return nil
			}
			if err := echo("before"); err != nil {
				t.Fatal(err)
			}
			e.set(t, e.server) // the client pod is removed
			e.waitReady(t, e.client, 503)
			if tc.name == "finishes" {
				if err := echo("during drain"); err != nil {
					t.Fatalf("open connection broke while draining: %v", err)
				}
				c.Close()
			} else {
				// The deadline ends it with a FIN, never a reset: the
				// client reads EOF.
				if _, err := io.ReadAll(c); err != nil {
					t.Fatalf("connection at the drain deadline ended with %v, want a FIN (EOF)", err)
				}
			}
			err = proxytest.WaitFor(ctx, func() bool {
				for _, st := range e.mgr.Status() {
					if st.Name == "client" {
						return false
					}
				}
				return true
			})
			if err != nil {
				t.Fatalf("client pod still known after drain: %+v", e.mgr.Status())
			}
			if _, err := e.client.Readiness(ctx); err == nil {
				t.Error("readiness listener still open after drain")
			}
			e.waitReady(t, e.server, 200) // the other pod is untouched
		})
	}
}

// TestVanishedNetNS: the client pod's netns disappears; its listeners are
// closed without disturbing the proxy or the other pod.
func TestVanishedNetNS(t *testing.T) {
	e := setup(t, dataplane.Config{CheckInterval: 50 * time.Millisecond})
	// The pin goes away as at CNI DEL (the harness's own cleanup then
	// finds nothing left to remove).
	if err := unix.Unmount(e.client.NS.Path(), unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(e.client.NS.Path()); err != nil {
		t.Fatal(err)
	}
	ctx := ctx10(t)
	err := proxytest.WaitFor(ctx, func() bool {
		for _, st := range e.mgr.Status() {
			if st.Name == "client" && st.State != dataplane.StateFailed {
				return false
			}
		}
		return true
	})
	if err != nil {
		t.Fatalf("vanished pod still served: %+v", e.mgr.Status())
	}
	e.waitReady(t, e.server, 200)
	if e.mgr.Ready("ctr-client") {
		t.Error("vanished pod reported ready")
	}
}

// TestCaptureForwardsUDP: a datagram to the server is diverted, forwarded
// with the bypass mark, and the reply comes back from the original
// destination; the second datagram of the flow takes the same path.
func TestCaptureForwardsUDP(t *testing.T) {
	e := setup(t, dataplane.Config{})
	for i, dst := range []netip.Addr{e.server.IP4, e.server.IP6} {
		t.Run(dst.String(), func(t *testing.T) {
			var pc net.PacketConn
			// A fresh IPv6 address may still be tentative: retry the bind.
			err := proxytest.WaitFor(ctx10(t), func() bool {
				return e.server.NS.Do(func() error {
					var err error
					pc, err = net.ListenPacket("udp", netip.AddrPortFrom(dst, 5353).String())
					return err
				}) == nil
			})
			if err != nil {
				t.Fatalf("failed to bind udp %s:5353 in the server pod", dst)
			}
			defer pc.Close()
			go func() {
				buf := make([]byte, 512)
				for {
					n, from, err := pc.ReadFrom(buf)
					if err != nil {
						return
					}
					_, _ = pc.WriteTo([]byte("re:"+string(buf[:n])+" from "+from.(*net.UDPAddr).AddrPort().Addr().Unmap().String()), from)
				}
			}()
			var c net.Conn
			e.client.NS.MustDo(t, func() error {
				var err error
				c, err = net.Dial("udp", netip.AddrPortFrom(dst, 5353).String())
				return err
			})
			defer c.Close()
			src := e.client.IP4
			if dst.Is6() {
				src = e.client.IP6
			}
			for i := range 2 {
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				msg := fmt.Sprintf("q%d", i)
				if _, err := c.Write([]byte(msg)); err != nil {
					t.Fatal(err)
				}
				buf := make([]byte, 512)
				n, err := c.Read(buf)
				if err != nil {
					t.Fatalf("datagram %d: no reply: %v", i, err)
				}
				if want := "re:" + msg + " from " + src.String(); string(buf[:n]) != want {
					t.Errorf("reply %q, want %q", buf[:n], want)
				}
			}
			// Both datagrams went through the proxy, and both replies (the
			// counter moves just after the reply is sent).
			for _, dir := range []string{"outbound", "reply"} {
				match := map[string]string{"direction": dir, "outcome": "forwarded"}
				if err := proxytest.WaitFor(ctx10(t), func() bool { return sum(e.metrics, "aether_udp_datagrams_total", match) >= float64(2*(i+1)) }); err != nil {
					t.Errorf("aether_udp_datagrams_total{direction=%s,outcome=forwarded} = %v, want >= %d", dir, sum(e.metrics, "aether_udp_datagrams_total", match), 2*(i+1))
				}
			}
		})
	}
}

// TestPluginReadinessProbe drives aether-cni's own prober (pkg/readiness)
// against the proxy: it confirms a serving pod, and sees 503 while the pod
// drains with a connection open.
func TestPluginReadinessProbe(t *testing.T) {
	e := setup(t, dataplane.Config{})
	url := fmt.Sprintf("http://127.0.0.1:%d%s", listener.DefaultOutboundPort, listener.ReadyPath)
	ctx := ctx10(t)
	if err := (readiness.Prober{}).Probe(ctx, e.client.NS.Path(), url, 5*time.Second); err != nil {
		t.Fatalf("plugin probe of a serving pod: %v", err)
	}
	e.server.Echo(t, 8082)
	c, err := e.client.Dial(ctx, netip.AddrPortFrom(e.server.IP4, 8082))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("x")); err != nil { // the connection is proxied and open
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	e.set(t, e.server)
	e.waitReady(t, e.client, 503)
	// The prober returns its last failure: a 503, or (if the budget ends
	// during a request) that request's deadline. Either way it must fail.
	err = (readiness.Prober{Interval: 400 * time.Millisecond}).Probe(ctx, e.client.NS.Path(), url, time.Second)
	if err == nil || !strings.Contains(err.Error(), "503") && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("plugin probe of a draining pod = %v, want a 503 failure", err)
	}
}

// TestUpstreamConnectTimeout: an upstream that never answers (no host at the
// address) is given up after ConnectTimeout and the client is reset.
func TestUpstreamConnectTimeout(t *testing.T) {
	e := setup(t, dataplane.Config{ConnectTimeout: 300 * time.Millisecond})
	c, err := e.client.Dial(ctx10(t), netip.MustParseAddrPort("10.88.0.99:80"))
	if err == nil {
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if err == nil || !strings.Contains(err.Error(), "reset") {
		t.Fatalf("connection to an unanswering upstream = %v, want a reset", err)
	}
	if got := sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "connect"}); got != 1 {
		t.Errorf("aether_tcp_connections_failed_total{reason=connect} = %v, want 1", got)
	}
}

// TestBytesCountedWhileOpen: a busy long-lived connection's bytes show in
// the metrics before it ends (at least every 4 MiB).
func TestBytesCountedWhileOpen(t *testing.T) {
	e := setup(t, dataplane.Config{})
	e.server.Handle(t, 8083, func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
	ctx := ctx10(t)
	c, err := e.client.Dial(ctx, netip.AddrPortFrom(e.server.IP4, 8083))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(make([]byte, 5<<20)); err != nil {
		t.Fatal(err)
	}
	match := map[string]string{"source_workload": "client", "destination_workload": "server"}
	if err := proxytest.WaitFor(ctx, func() bool { return sum(e.metrics, "istio_tcp_received_bytes_total", match) >= 4<<20 }); err != nil {
		t.Fatalf("received bytes of an open connection = %v, want >= 4 MiB", sum(e.metrics, "istio_tcp_received_bytes_total", match))
	}
	if got := sum(e.metrics, "istio_tcp_connections_closed_total", match); got != 0 {
		t.Errorf("connection counted closed while open: %v", got)
	}
}

// TestBytesCountedWhenIdle: the bytes of an open connection that went idle
// (far less than 4 MiB, both ways) are in the metrics, exactly, before it
// ends.
func TestBytesCountedWhenIdle(t *testing.T) {
	e := setup(t, dataplane.Config{})
	const up, down = 1000, 300
	e.server.Handle(t, 8084, func(c net.Conn) {
		if _, err := io.ReadFull(c, make([]byte, up)); err != nil {
			return
		}
		_, _ = c.Write(make([]byte, down))
		_, _ = io.Copy(io.Discard, c) // stays open until the client closes
	})
	ctx := ctx10(t)
	c, err := e.client.Dial(ctx, netip.AddrPortFrom(e.server.IP4, 8084))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(make([]byte, up)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, down)); err != nil {
		t.Fatal(err)
	}
	match := map[string]string{"source_workload": "client", "destination_workload": "server"}
	counted := func() bool {
		return sum(e.metrics, "istio_tcp_received_bytes_total", match) == up &&
			sum(e.metrics, "istio_tcp_sent_bytes_total", match) == down
	}
	if err := proxytest.WaitFor(ctx, counted); err != nil {
		t.Fatalf("bytes of an idle open connection: received %v, sent %v, want %d and %d",
			sum(e.metrics, "istio_tcp_received_bytes_total", match), sum(e.metrics, "istio_tcp_sent_bytes_total", match), up, down)
	}
	if got := sum(e.metrics, "istio_tcp_connections_closed_total", match); got != 0 {
		t.Errorf("connection counted closed while open: %v", got)
	}
}

// TestBindFailureRetried: a port already taken in the pod netns fails the
// pod's bind (nothing of it stays bound) and is retried until it is free.
func TestBindFailureRetried(t *testing.T) {
	topo := proxytest.New(t, []string{"client"}, "client")
	client := topo.Pods[0]
	var squat net.Listener
	client.NS.MustDo(t, func() error {
		var err error
		squat, err = net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", listener.DefaultOutboundPort))
		return err
	})
	defer squat.Close()
	mgr, err := dataplane.New(dataplane.Config{CheckInterval: 50 * time.Millisecond}, peers.NewIndex(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = mgr.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; mgr.Close() })
	mgr.SetListeners(client.Specs(t))
	wctx := ctx10(t)
	err = proxytest.WaitFor(wctx, func() bool {
		st := mgr.Status()
		return len(st) == 1 && st[0].State == dataplane.StateFailed && strings.Contains(st[0].Error, "address already in use")
	})
	if err != nil {
		t.Fatalf("status with a squatted port: %+v", mgr.Status())
	}
	// Nothing of the pod stayed bound: the capture port is free between
	// attempts. A retry (every CheckInterval) holds it while it tries, so
	// one refused listen is not a leak; one that never succeeds is.
	var freeErr error
	if err := proxytest.WaitFor(wctx, func() bool {
		client.NS.MustDo(t, func() error {
			l, err := net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", listener.DefaultCapturePort))
			if freeErr = err; err == nil {
				return l.Close()
			}
			return nil
		})
		return freeErr == nil
	}); err != nil {
		t.Fatalf("capture port left bound after a failed start: %v", freeErr)
	}
	squat.Close()
	if err := proxytest.WaitFor(wctx, func() bool { return client.ReadyCode(wctx) == 200 }); err != nil {
		t.Fatalf("pod not serving after the port was freed: %+v", mgr.Status())
	}
}

// TestListenersChanged: a pod whose listener set changes is drained and
// bound again with the new set.
func TestListenersChanged(t *testing.T) {
	e := setup(t, dataplane.Config{})
	rec := e.client.Record()
	rec.Ports.Outbound = 19081
	ls, err := listener.Build(rec)
	if err != nil {
		t.Fatal(err)
	}
	specs := e.server.Specs(t)
	for _, l := range ls {
		s, err := listener.Parse(l)
		if err != nil {
			t.Fatal(err)
		}
		specs = append(specs, s)
	}
	e.mgr.SetListeners(specs)
	wctx := ctx10(t)
	// The old readiness port closes, the new one serves.
	if err := proxytest.WaitFor(wctx, func() bool { return e.client.ReadyCode(wctx) == 0 }); err != nil {
		t.Fatal("old outbound listener still open")
	}
	err = proxytest.WaitFor(wctx, func() bool {
		var ok bool
		_ = e.client.NS.Do(func() error {
			c, err := net.DialTimeout("tcp", "127.0.0.1:19081", time.Second)
			if err == nil {
				ok = true
				c.Close()
			}
			return nil
		})
		return ok && e.mgr.Ready(rec.ContainerID)
	})
	if err != nil {
		t.Fatalf("new listener set not serving: %+v", e.mgr.Status())
	}
}
