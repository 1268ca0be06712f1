package dataplane_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/telemetry"
)

// hboneIdleHits is aether_proxy_limit_hits_total{limit="tcp_idle"}.
func hboneIdleHits(e *hboneEnv) float64 {
	return sum(e.metrics, "aether_proxy_limit_hits_total", map[string]string{"limit": telemetry.LimitTCPIdle})
}

// awaitHBONESettled waits up to 10 s until the proxy holds no connection:
// no CONNECT stream served on :15008 and every captured connection counted
// closed.
func awaitHBONESettled(t *testing.T, e *hboneEnv) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		streams := sum(e.metrics, "aether_proxy_hbone_server_streams_active", nil)
		opened := sum(e.metrics, "istio_tcp_connections_opened_total", nil)
		closed := sum(e.metrics, "istio_tcp_connections_closed_total", nil)
		if streams == 0 && opened == closed {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the proxy still holds connections after 10 s: %v CONNECT streams served, %v of %v captured connections closed", streams, closed, opened)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// awaitClosed waits up to 10 s for read to return (an idle close) and
// returns its error; a read that is still blocked fails the test.
func awaitClosed(t *testing.T, read func() error, unblock func()) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- read() }()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		unblock()
		<-done
		t.Fatal("the idle tunnelled connection was not closed within 10 s")
		return nil
	}
}

// TestHBONEIdleTimeout: the proxy's TCP idle timeout applies to tunnelled
// connections like to plain ones. An idle captured connection carried over
// HBONE is reset while an active one on the same pooled connection keeps
// working; each leg is closed on its own: the outbound leg (captured
// connection → HBONE stream, to a server this proxy does not run) and the
// inbound delivery leg (HBONE stream from a client this proxy does not run
// → the app), which resets the stream. Every close is counted
// (limit="tcp_idle").
func TestHBONEIdleTimeout(t *testing.T) {
	e := setupHBONEConfig(t, dataplane.Config{
		ConnectTimeout: 3 * time.Second, TCPIdleTimeout: 400 * time.Millisecond, CheckInterval: 50 * time.Millisecond,
	})
	e.server.Echo(t, 8080)

	t.Run("both legs", func(t *testing.T) {
		before := hboneIdleHits(e)
		dst := netip.AddrPortFrom(e.server.IP4, 8080)
		idle, err := echoOnce(t, e.client, dst)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = idle.Close() }()
		active, err := echoOnce(t, e.client, dst)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = active.Close() }()
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone"}); got != 2 {
			t.Fatalf("outbound path=hbone = %v, want 2 (both connections tunnelled)", got)
		}
		idleClosedWhileActive(t, idle, active)
		_ = active.Close()
		// Both legs of the idle connection time out at about the same
		// moment, so the destination's leg may be counted too; wait until
		// every leg is closed so that no hit lands in the next subtest.
		awaitHBONESettled(t, e)
		if got := hboneIdleHits(e); got < before+1 {
			t.Errorf("tcp_idle hits = %v, want at least %v", got, before+1)
		}
	})

	t.Run("inbound delivery leg", func(t *testing.T) {
		// The test is the source proxy: its own dialer (the client's
		// SVID) from the unmanaged pod, so only the server's side is
		// this manager's.
		d, err := hbone.NewDialer(hbone.DialerConfig{
			Certs: e.certs,
			DialContext: func(ctx context.Context, _, address string) (net.Conn, error) {
				ap, err := netip.ParseAddrPort(address)
				if err != nil {
					return nil, err
				}
				return e.plain.Dial(ctx, ap)
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = d.Close() })
		before := hboneIdleHits(e)
		s, err := d.Dial(ctx10(t), hbone.Request{
			Source: podID(e.client), Proxy: netip.AddrPortFrom(e.server.IP4, 15008),
			Target: netip.AddrPortFrom(e.server.IP4, 8080), Expected: podID(e.server),
		})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.Close() }()
		b := []byte{'x'}
		if _, err := s.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(s, b); err != nil {
			t.Fatal(err)
		}
		err = awaitClosed(t, func() error { _, err := s.Read(b); return err }, func() { _ = s.Close() })
		if err == nil || errors.Is(err, io.EOF) {
			t.Errorf("stream read after the idle timeout = %v, want a reset stream (not a clean end)", err)
		}
		if got := hboneIdleHits(e); got != before+1 {
			t.Errorf("tcp_idle hits = %v, want %v (the delivery leg, once)", got, before+1)
		}
	})

	t.Run("outbound leg", func(t *testing.T) {
		// The destination is the unmanaged pod, now an HBONE workload
		// whose :15008 is the test's own server: only the source side is
		// this manager's.
		svid, err := e.ca.ValidSVID(podID(e.plain))
		if err != nil {
			t.Fatal(err)
		}
		e.certs.SetSVID(svid)
		apps := make(chan net.Conn, 1)
		srv, err := hbone.NewServer(hbone.ServerConfig{
			Identity: podID(e.plain), Certs: e.certs,
			Deliver: func(_ context.Context, _ spiffeid.ID, _ netip.AddrPort) (net.Conn, error) {
				app, proxy := net.Pipe()
				apps <- app
				return proxy, nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		var ln net.Listener
		if err := e.plain.NS.Do(func() error {
			ln, err = net.Listen("tcp4", netip.AddrPortFrom(e.plain.IP4, 15008).String())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(ctx)
		})
		e.idx.Upsert(hboneWorkload(e.plain, true))
		t.Cleanup(func() { e.idx.Upsert(hboneWorkload(e.plain, false)) })

		before := hboneIdleHits(e)
		c, err := e.client.Dial(ctx10(t), netip.AddrPortFrom(e.plain.IP4, 8080))
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = c.Close() }()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write([]byte{'x'}); err != nil {
			t.Fatal(err)
		}
		app := <-apps
		appClosed := make(chan error, 1)
		go func() {
			_, err := io.Copy(app, app) // echo until the stream goes
			_ = app.Close()
			appClosed <- err
		}()
		b := []byte{0}
		if _, err := io.ReadFull(c, b); err != nil || b[0] != 'x' {
			t.Fatalf("echo through the test's hbone server = %q, %v", b, err)
		}
		err = awaitClosed(t, func() error { _, err := c.Read(b); return err }, func() { _ = c.Close() })
		var ne net.Error
		if err == nil || (errors.As(err, &ne) && ne.Timeout()) {
			t.Errorf("client read after the idle timeout = %v, want the connection reset", err)
		}
		select {
		case <-appClosed: // the stream was reset, the test server closed its upstream
		case <-time.After(10 * time.Second):
			t.Error("the destination's stream was not closed after the idle timeout")
		}
		if got := hboneIdleHits(e); got != before+1 {
			t.Errorf("tcp_idle hits = %v, want %v (the outbound leg, once)", got, before+1)
		}
	})
}
