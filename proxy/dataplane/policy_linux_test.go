package dataplane_test

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"testing"
	"time"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/test/harness"
	"aether.io/node/xds/listener"
)

// TestHBONEPortAgrees: the inbound redirect never touches the proxy's HBONE
// port.
func TestHBONEPortAgrees(t *testing.T) {
	if capture.DefaultHBONEPort != hbone.DefaultPort {
		t.Fatalf("capture.DefaultHBONEPort %d differs from hbone.DefaultPort %d", capture.DefaultHBONEPort, hbone.DefaultPort)
	}
}

// TestInboundPolicy runs plaintext inbound connections through the server
// pod's inbound redirect (pkg/capture, inbound_capture) to the proxy's
// inbound listener: permissive delivers them to the app, strict resets them
// (the app sees nothing, counted reason="inbound_policy_denied"), a policy
// change applies from the next connection without rebinding, the kubelet's
// address (inbound_plaintext_allow_cidrs) reaches the app in strict mode,
// and a direct connection to the inbound port is reset.
func TestInboundPolicy(t *testing.T) {
	udsRoot := t.TempDir()
	m, log := accessMetrics(t)
	e := setupMetrics(t, dataplane.Config{UDSRoot: udsRoot}, m)
	const appPort = 8080
	// The node's address (an unmeshed client) and the kubelet's.
	node4, kubelet4 := netip.MustParseAddr("10.88.0.1"), netip.MustParseAddr("10.88.0.254")
	node6 := netip.MustParseAddr("fd88::1")
	for _, a := range []string{"10.88.0.1/24", "10.88.0.254/24", "fd88::1/64"} {
		harness.AddAddr(t, e.topo.Node, "br0", a)
	}
	cfg := capture.Config{RedirectAll: true, InboundCapture: true, InboundAllowCIDRs: []netip.Prefix{netip.PrefixFrom(kubelet4, 32)}}
	if err := (capture.Installer{}).Install(e.server.NS.Path(), capture.Build(cfg)); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 16)
	e.server.Handle(t, appPort, func(c net.Conn) {
		b := make([]byte, 64)
		n, _ := c.Read(b)
		got <- string(b[:n])
		_, _ = c.Write([]byte("app:" + string(b[:n])))
	})
	setPolicy := func(policy string) {
		specs := e.client.Specs(t)
		for _, s := range e.server.Specs(t) {
			s.InboundPolicy = policy
			specs = append(specs, s)
		}
		e.mgr.SetListeners(specs)
	}
	denied := func() float64 {
		return sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "inbound_policy_denied"})
	}
	// call connects from the node netns (source src) to dst, sends msg and
	// returns the answer.
	call := func(src netip.Addr, dst netip.AddrPort, msg string) (string, error) {
		var c net.Conn
		err := e.topo.Node.Do(func() error {
			var err error
			d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))}
			c, err = d.Dial("tcp", dst.String())
			return err
		})
		if err != nil {
			return "", err
		}
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, msg); err != nil {
			return "", err
		}
		b, err := io.ReadAll(c)
		return string(b), err
	}
	server4 := netip.AddrPortFrom(e.server.IP4, appPort)
	server6 := netip.AddrPortFrom(e.server.IP6, appPort)
	noApp := func(t *testing.T) {
		t.Helper()
		select {
		case m := <-got:
			t.Errorf("the app received %q under strict", m)
		default:
		}
	}

	t.Run("permissive delivers", func(t *testing.T) {
		for i, tc := range []struct {
			src netip.Addr
			dst netip.AddrPort
		}{{node4, server4}, {node6, server6}} {
			msg := "permissive-" + tc.dst.String()
			before := sum(e.metrics, "istio_tcp_connections_opened_total", map[string]string{"reporter": "destination", "destination_workload": "server"})
			ans, err := call(tc.src, tc.dst, msg)
			if err != nil || ans != "app:"+msg {
				t.Fatalf("call %d = %q, %v; want the app's answer", i, ans, err)
			}
			if m := <-got; m != msg {
				t.Errorf("the app received %q, want %q", m, msg)
			}
			if n := sum(e.metrics, "istio_tcp_connections_opened_total", map[string]string{"reporter": "destination", "destination_workload": "server"}) - before; n != 1 {
				t.Errorf("inbound connections opened counted %v, want 1", n)
			}
		}
	})
	t.Run("meshed client permissive", func(t *testing.T) {
		// client pod -> its proxy (capture) -> server pod's inbound redirect.
		c, err := e.client.Dial(ctx10(t), server4)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Close() }()
		_, _ = io.WriteString(c, "meshed")
		b := make([]byte, 64)
		n, err := c.Read(b)
		if err != nil || string(b[:n]) != "app:meshed" {
			t.Fatalf("meshed client read %q, %v", b[:n], err)
		}
		<-got
	})

	setPolicy(meshcontract.InboundPolicyStrict)
	t.Run("strict refuses", func(t *testing.T) {
		// The change applies in place: wait for the first refusal.
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			_, err := call(node4, server4, "probe-policy")
			if err == nil {
				<-got
			}
			return err != nil
		}); err != nil {
			t.Fatal("strict never applied")
		}
		before := denied()
		for _, dst := range []netip.AddrPort{server4, server6} {
			src := node4
			if dst.Addr().Is6() {
				src = node6
			}
			ans, err := call(src, dst, "strict")
			if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
				t.Errorf("call to %s under strict = %q, %v; want a reset", dst, ans, err)
			}
		}
		if n := denied() - before; n != 2 {
			t.Errorf("inbound_policy_denied counted %v, want 2", n)
		}
		// The destination side's access log names the policy.
		log.await(t, map[string]any{
			"reporter": "destination", "dst_addr": server6, "reason": "denied",
			"policy_decision": "deny", "policy": "inbound-policy/strict", "response_flags": "DENY",
			"path": "plaintext", "security": "none", "dst_workload": "server",
		})
		noApp(t)
	})
	t.Run("kubelet exempt under strict", func(t *testing.T) {
		ans, err := call(kubelet4, server4, "probe")
		if err != nil || ans != "app:probe" {
			t.Fatalf("kubelet probe = %q, %v; want the app's answer", ans, err)
		}
		<-got
	})
	t.Run("direct to the inbound port resets", func(t *testing.T) {
		before := sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "inbound_not_pod"})
		_, err := call(node4, netip.AddrPortFrom(e.server.IP4, listener.DefaultInboundPort), "direct")
		if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
			t.Errorf("direct connection to the inbound port = %v, want a reset", err)
		}
		if n := sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "inbound_not_pod"}) - before; n != 1 {
			t.Errorf("inbound_not_pod counted %v, want 1", n)
		}
		noApp(t)
	})

	setPolicy(meshcontract.InboundPolicyPermissive)
	t.Run("back to permissive", func(t *testing.T) {
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			ans, err := call(node4, server4, "again")
			if err == nil {
				<-got
			}
			return err == nil && ans == "app:again"
		}); err != nil {
			t.Fatal("permissive never applied again")
		}
	})
	t.Run("permissive over the UDS socket", func(t *testing.T) {
		sock := proxytest.PodSocketPath(t, udsRoot, "uid-server", "app.sock")
		proxytest.ServeUnix(t, sock, func(c net.Conn) {
			b := make([]byte, 64)
			n, _ := c.Read(b)
			_, _ = c.Write([]byte("uds:" + string(b[:n])))
		})
		specs := e.client.Specs(t)
		for _, s := range e.server.Specs(t) {
			s.UID, s.UDSSocket = "uid-server", sock
			specs = append(specs, s)
		}
		e.mgr.SetListeners(specs) // drained and bound again
		var ans string
		var err error
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			ans, err = call(node4, server4, "hello")
			if err == nil && ans == "app:hello" {
				<-got
			}
			return err == nil && ans == "uds:hello"
		}); err != nil {
			t.Fatalf("inbound never delivered over the UDS socket (last %q, %v)", ans, err)
		}
	})
}

// BenchmarkInboundConnect: connect plus a one-byte round trip to the server
// pod's app through the inbound redirect and the proxy's inbound listener
// (permissive: delivered over TCP from the pod netns) against the same app
// port excluded from the redirect (peer: straight to the app); the client
// socket carries the bypass mark so the client pod's own divert is not in
// the path. p50/p99.
func BenchmarkInboundConnect(b *testing.B) {
	e := setup(b, dataplane.Config{})
	cfg := capture.Config{RedirectAll: true, InboundCapture: true, ExcludeInboundPorts: []uint16{9002}}
	if err := (capture.Installer{}).Install(e.server.NS.Path(), capture.Build(cfg)); err != nil {
		b.Fatal(err)
	}
	e.server.Echo(b, 9001)
	e.server.Echo(b, 9002)
	for _, tc := range []struct {
		mode string
		port uint16
	}{{"ours", 9001}, {"peer", 9002}} {
		dst := netip.AddrPortFrom(e.server.IP4, tc.port)
		b.Run(tc.mode, func(b *testing.B) {
			lat := make([]time.Duration, 0, b.N)
			one := []byte{1}
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				c := benchDial(b, e, "peer", dst)
				if _, err := c.Write(one); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, one); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(start))
				_ = c.SetLinger(0)
				c.Close()
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
		})
	}
}
