package dataplane_test

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

// echoOnce dials dst from pod through the proxy, writes one byte and reads
// it back: the connection is proxied end to end. The connection stays open.
func echoOnce(t *testing.T, pod *proxytest.Pod, dst netip.AddrPort) (*net.TCPConn, error) {
	t.Helper()
	c, err := pod.Dial(ctx10(t), dst)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	b := []byte{'x'}
	_, err = c.Write(b)
	if err == nil {
		b[0] = 0
		_, err = c.Read(b)
	}
	if err == nil && b[0] != 'x' {
		err = fmt.Errorf("echo %q, want x", b)
	}
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

func limitHits(e *env, limit string) float64 {
	return sum(e.metrics, "aether_proxy_limit_hits_total", map[string]string{"limit": limit})
}

// TestConnectionCaps: a pod at its connection cap gets its next connection
// reset and counted, while another pod's connections keep working; a
// closed connection frees its slot. The node-wide cap works the same way
// across pods.
func TestConnectionCaps(t *testing.T) {
	t.Run("per pod", func(t *testing.T) {
		e := setup(t, dataplane.Config{MaxConnsPerPod: 5})
		e.server.Echo(t, 8080)
		e.client.Echo(t, 8081)
		dst := netip.AddrPortFrom(e.server.IP4, 8080)
		var held []*net.TCPConn
		for i := range 5 {
			c, err := echoOnce(t, e.client, dst)
			if err != nil {
				t.Fatalf("connection %d under the cap: %v", i, err)
			}
			held = append(held, c)
		}
		t.Cleanup(func() {
			for _, c := range held {
				_ = c.Close()
			}
		})
		if c, err := echoOnce(t, e.client, dst); err == nil {
			_ = c.Close()
			t.Fatalf("a connection over the pod's cap was proxied: status %+v, hits %v, opened %v", e.mgr.Status(), limitHits(e, telemetry.LimitPodConnections), sum(e.metrics, "istio_tcp_connections_opened_total", nil))
		}
		if limitHits(e, telemetry.LimitPodConnections) < 1 {
			t.Error("the pod cap was not counted")
		}
		// Another pod is not affected.
		c, err := echoOnce(t, e.server, netip.AddrPortFrom(e.client.IP4, 8081))
		if err != nil {
			t.Fatalf("the other pod's connection failed while the first is at its cap: %v", err)
		}
		_ = c.Close()
		// A closed connection frees its slot.
		_ = held[0].Close()
		held = held[1:]
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			c, err := echoOnce(t, e.client, dst)
			if err == nil {
				held = append(held, c)
			}
			return err == nil
		}); err != nil {
			t.Fatal("the slot of a closed connection was never freed")
		}
	})
	t.Run("node", func(t *testing.T) {
		e := setup(t, dataplane.Config{MaxConns: 3})
		e.server.Echo(t, 8080)
		e.client.Echo(t, 8081)
		for i := range 3 {
			c, err := echoOnce(t, e.client, netip.AddrPortFrom(e.server.IP4, 8080))
			if err != nil {
				t.Fatalf("connection %d under the node cap: %v", i, err)
			}
			t.Cleanup(func() { _ = c.Close() })
		}
		if c, err := echoOnce(t, e.server, netip.AddrPortFrom(e.client.IP4, 8081)); err == nil {
			_ = c.Close()
			t.Fatalf("a connection over the node's cap was proxied: status %+v, hits %v", e.mgr.Status(), limitHits(e, telemetry.LimitNodeConnections))
		}
		if limitHits(e, telemetry.LimitNodeConnections) < 1 {
			t.Error("the node cap was not counted")
		}
	})
}

// udpEcho answers every datagram on addr inside pod with "re:<payload>".
func udpEcho(t *testing.T, pod *proxytest.Pod, addr netip.AddrPort) {
	t.Helper()
	var pc net.PacketConn
	if err := proxytest.WaitFor(ctx10(t), func() bool {
		return pod.NS.Do(func() error {
			var err error
			pc, err = net.ListenPacket("udp", addr.String())
			return err
		}) == nil
	}); err != nil {
		t.Fatalf("failed to bind udp %s in %s", addr, pod.Name)
	}
	t.Cleanup(func() { _ = pc.Close() })
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(append([]byte("re:"), buf[:n]...), from)
		}
	}()
}

// udpAsk sends msg from pod to dst on a fresh socket and waits for the
// echo.
func udpAsk(t *testing.T, pod *proxytest.Pod, dst netip.AddrPort, msg string) error {
	t.Helper()
	var c net.Conn
	pod.NS.MustDo(t, func() error {
		var err error
		c, err = net.Dial("udp", dst.String())
		return err
	})
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		return err
	}
	if string(buf[:n]) != "re:"+msg {
		return fmt.Errorf("reply %q to %q", buf[:n], msg)
	}
	return nil
}

func podStatus(t *testing.T, e *env, name string) dataplane.PodStatus {
	t.Helper()
	for _, s := range e.mgr.Status() {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("no status of pod %s", name)
	return dataplane.PodStatus{}
}

// TestUDPFlowCaps: a UDP port sweep from one pod keeps at most its cap of
// flows (the least recently used gives way, every new flow still works);
// at the node cap the sweeping pod only evicts its own flows, so another
// pod's flow keeps working.
func TestUDPFlowCaps(t *testing.T) {
	const ports = 40
	t.Run("per pod", func(t *testing.T) {
		e := setup(t, dataplane.Config{MaxUDPFlowsPerPod: 8})
		for i := range ports {
			udpEcho(t, e.server, netip.AddrPortFrom(e.server.IP4, uint16(6000+i)))
		}
		for i := range ports {
			if err := udpAsk(t, e.client, netip.AddrPortFrom(e.server.IP4, uint16(6000+i)), fmt.Sprint(i)); err != nil {
				t.Fatalf("sweep datagram %d: %v", i, err)
			}
			if n := podStatus(t, e, "client").UDPFlows; n > 8 {
				t.Fatalf("client holds %d UDP flows, cap 8", n)
			}
		}
		if got := limitHits(e, telemetry.LimitPodUDPFlows); got < ports-8 {
			t.Errorf("pod_udp_flows hits = %v, want at least %d", got, ports-8)
		}
	})
	t.Run("node", func(t *testing.T) {
		e := setup(t, dataplane.Config{MaxUDPFlows: 6})
		for i := range ports {
			udpEcho(t, e.server, netip.AddrPortFrom(e.server.IP4, uint16(6000+i)))
		}
		udpEcho(t, e.client, netip.AddrPortFrom(e.client.IP4, 7000))
		// The other pod's flow, before the sweep; its socket stays open.
		var keep net.Conn
		e.server.NS.MustDo(t, func() error {
			var err error
			keep, err = net.Dial("udp", netip.AddrPortFrom(e.client.IP4, 7000).String())
			return err
		})
		defer keep.Close()
		ask := func(msg string) error {
			_ = keep.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err := keep.Write([]byte(msg)); err != nil {
				return err
			}
			buf := make([]byte, 64)
			n, err := keep.Read(buf)
			if err == nil && string(buf[:n]) != "re:"+msg {
				err = fmt.Errorf("reply %q", buf[:n])
			}
			return err
		}
		if err := ask("before"); err != nil {
			t.Fatal(err)
		}
		for i := range ports {
			if err := udpAsk(t, e.client, netip.AddrPortFrom(e.server.IP4, uint16(6000+i)), fmt.Sprint(i)); err != nil {
				t.Fatalf("sweep datagram %d: %v", i, err)
			}
		}
		if limitHits(e, telemetry.LimitNodeUDPFlows) < 1 {
			t.Error("the node flow cap was never hit")
		}
		if n := podStatus(t, e, "server").UDPFlows; n != 1 {
			t.Errorf("the other pod holds %d flows after the sweep, want its 1", n)
		}
		if err := ask("after"); err != nil {
			t.Fatalf("the other pod's flow broke during the sweep: %v", err)
		}
	})
}

// TestIdleTimeouts: a TCP connection idle both ways is closed after
// TCPIdleTimeout while an active one stays; a DNS flow (port 53) ends
// after DNSIdleTimeout while another flow stays.
func TestIdleTimeouts(t *testing.T) {
	e := setup(t, dataplane.Config{
		TCPIdleTimeout: 400 * time.Millisecond, CheckInterval: 50 * time.Millisecond,
		DNSIdleTimeout: 300 * time.Millisecond, UDPIdleTimeout: time.Minute,
	})
	e.server.Echo(t, 8080)
	dst := netip.AddrPortFrom(e.server.IP4, 8080)
	idle, err := echoOnce(t, e.client, dst)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	active, err := echoOnce(t, e.client, dst)
	if err != nil {
		t.Fatal(err)
	}
	defer active.Close()
	idleClosedWhileActive(t, idle, active)
	if limitHits(e, telemetry.LimitTCPIdle) < 1 {
		t.Error("the idle close was not counted")
	}
	udpEcho(t, e.server, netip.AddrPortFrom(e.server.IP4, 53))
	udpEcho(t, e.server, netip.AddrPortFrom(e.server.IP4, 5353))
	for _, port := range []uint16{53, 5353} {
		if err := udpAsk(t, e.client, netip.AddrPortFrom(e.server.IP4, port), "q"); err != nil {
			t.Fatal(err)
		}
	}
	if err := proxytest.WaitFor(ctx10(t), func() bool { return podStatus(t, e, "client").UDPFlows == 1 }); err != nil {
		t.Fatalf("the DNS flow never ended: %d flows", podStatus(t, e, "client").UDPFlows)
	}
}

func errorsAs(err error, target any) bool { return errors.As(err, target) }

// idleClosedWhileActive echoes a byte on active every 100 ms (each round
// trip must work) until idle, left alone, is closed by the idle timeout
// (a read that ends in an error other than its 10 s deadline).
func idleClosedWhileActive(t *testing.T, idle, active *net.TCPConn) {
	t.Helper()
	_ = idle.SetReadDeadline(time.Now().Add(10 * time.Second))
	closed := make(chan error, 1)
	go func() {
		_, err := idle.Read(make([]byte, 1))
		closed <- err
	}()
	b := []byte{'y'}
	for {
		if _, err := active.Write(b); err != nil {
			t.Fatalf("the active connection broke: %v", err)
		}
		if _, err := active.Read(b); err != nil {
			t.Fatalf("the active connection broke: %v", err)
		}
		select {
		case err := <-closed:
			var ne net.Error
			if err == nil || (errorsAs(err, &ne) && ne.Timeout()) {
				t.Fatalf("the idle connection was not closed: read = %v", err)
			}
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// TestShutdownDrains: when Run's context ends (SIGTERM), every pod stops
// accepting (readiness 503) while established connections keep working
// until they end; Run returns once they did. A connection still open at
// the ShutdownDrain deadline is closed.
func TestShutdownDrains(t *testing.T) {
	t.Run("connections finish", func(t *testing.T) {
		e := setup(t, dataplane.Config{ShutdownDrain: time.Minute})
		e.server.Echo(t, 8080)
		c, err := echoOnce(t, e.client, netip.AddrPortFrom(e.server.IP4, 8080))
		if err != nil {
			t.Fatal(err)
		}
		stopped := make(chan struct{})
		go func() { e.stop(); close(stopped) }()
		e.waitReady(t, e.client, 503)
		// The established connection still works while Run drains.
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		for range 3 {
			b := []byte{'z'}
			if _, err := c.Write(b); err != nil {
				t.Fatalf("write while draining: %v", err)
			}
			if _, err := c.Read(b); err != nil || b[0] != 'z' {
				t.Fatalf("echo while draining = %q, %v", b, err)
			}
			select {
			case <-stopped:
				t.Fatal("Run returned with a connection still open")
			default:
			}
		}
		_ = c.Close()
		select {
		case <-stopped:
		case <-ctx10(t).Done():
			t.Fatal("Run did not return after the last connection ended")
		}
	})
	t.Run("deadline", func(t *testing.T) {
		e := setup(t, dataplane.Config{ShutdownDrain: 300 * time.Millisecond})
		e.server.Echo(t, 8080)
		c, err := echoOnce(t, e.client, netip.AddrPortFrom(e.server.IP4, 8080))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		e.stop()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		var ne net.Error
		if err == nil || errorsAs(err, &ne) && ne.Timeout() {
			t.Fatalf("a connection open past the shutdown deadline was not closed: read = %v", err)
		}
	})
}
