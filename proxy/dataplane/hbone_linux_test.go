package dataplane_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/api/istio/workload"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

const testTrustDomain = "cluster.local"

// hboneEnv is a node with three pods: client and server are managed and
// captured with SPIFFE identities (HBONE in WDS); plain is not managed.
type hboneEnv struct {
	client, server, plain *proxytest.Pod
	mgr                   *dataplane.Manager
	metrics               *telemetry.Metrics
	idx                   *peers.Index
	certs                 *hbonetest.Certs
	ca                    *hbonetest.CA
}

func podID(p *proxytest.Pod) spiffeid.ID {
	return spiffeid.RequireFromString("spiffe://" + testTrustDomain + "/ns/default/sa/" + p.Name)
}

// hboneWorkload is the WDS record of p: HBONE when tunnel is set.
func hboneWorkload(p *proxytest.Pod, tunnel bool) *workload.Workload {
	w := p.Workload()
	w.TrustDomain, w.ServiceAccount = testTrustDomain, p.Name
	if tunnel {
		w.TunnelProtocol = workload.TunnelProtocol_HBONE
	}
	return w
}

func setupHBONE(t testing.TB) *hboneEnv {
	t.Helper()
	return setupHBONEConfig(t, dataplane.Config{ConnectTimeout: 3 * time.Second})
}

// setupHBONEConfig is setupHBONE with the manager's cfg (Certs is set here).
func setupHBONEConfig(t testing.TB, cfg dataplane.Config) *hboneEnv {
	t.Helper()
	return setupHBONEMetrics(t, cfg, telemetry.New())
}

// setupHBONEMetrics is setupHBONEConfig with the manager's metrics (an
// access log).
func setupHBONEMetrics(t testing.TB, cfg dataplane.Config, m *telemetry.Metrics) *hboneEnv {
	t.Helper()
	topo := proxytest.New(t, []string{"client", "server", "plain"}, "client", "server")
	ca, err := hbonetest.NewCA(spiffeid.RequireTrustDomainFromString(testTrustDomain))
	if err != nil {
		t.Fatal(err)
	}
	e := &hboneEnv{
		client: topo.Pods[0], server: topo.Pods[1], plain: topo.Pods[2], metrics: m,
		idx: peers.NewIndex(), certs: hbonetest.NewCerts(ca.Bundle()), ca: ca,
	}
	for _, p := range []*proxytest.Pod{e.client, e.server} {
		p.SPIFFEID = podID(p).String()
		svid, err := ca.ValidSVID(podID(p))
		if err != nil {
			t.Fatal(err)
		}
		e.certs.SetSVID(svid)
		e.idx.Upsert(hboneWorkload(p, true))
	}
	e.idx.Upsert(hboneWorkload(e.plain, false))
	cfg.Certs = e.certs
	e.mgr, err = dataplane.New(cfg, e.idx, e.metrics, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = e.mgr.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done; _ = e.mgr.Close() })
	e.mgr.SetListeners(append(e.client.Specs(t), e.server.Specs(t)...))
	env := &env{metrics: e.metrics}
	for _, p := range []*proxytest.Pod{e.client, e.server} {
		env.waitReady(t, p, 200)
	}
	return e
}

// roundTrip sends payload from the client pod to dst, half-closes, and
// returns the answer.
func roundTrip(ctx context.Context, from *proxytest.Pod, dst netip.AddrPort, payload string) (string, error) {
	c, err := from.Dial(ctx, dst)
	if err != nil {
		return "", err
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(payload)); err != nil {
		return "", err
	}
	if err := c.CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// TestHBONE: managed → managed goes over HBONE (delivered by the
// destination's :15008 from inside its netns, metrics naming the verified
// principals on both sides); managed → unmanaged stays plain; a destination
// WDS marks HBONE whose proxy does not listen resets the client, never
// plaintext.
func TestHBONE(t *testing.T) {
	e := setupHBONE(t)
	srv := e.server.Serve(t, 8080)
	plain := e.plain.Serve(t, 8080)

	t.Run("managed to managed", func(t *testing.T) {
		// What the server's eth0 carries (the proxy's delivery to the
		// app, from the client's address, stays on the netns's lo).
		wire := sniffLink(t, e.server.NS, "eth0")
		replied := 0 // bytes the app sent back, over both streams
		for i, dst := range []netip.Addr{e.server.IP4, e.server.IP6} {
			ctx := ctx10(t)
			payload := fmt.Sprintf("secret-%d", i)
			reply, err := roundTrip(ctx, e.client, netip.AddrPortFrom(dst, 8080), payload)
			if err != nil {
				t.Fatal(err)
			}
			// The destination proxy dials the app from the server's own
			// netns with the client's address (the divert's deliver
			// rule): the app sees the client, not its own address.
			src := e.client.IP4
			if dst.Is6() {
				src = e.client.IP6
			}
			if want := fmt.Sprintf("got %d from %s", len(payload), src); reply != want {
				t.Errorf("reply %q, want %q", reply, want)
			}
			replied += len(reply)
			if got := <-srv.Got; got != src.String()+" "+payload {
				t.Errorf("server got %q", got)
			}
		}
		if got := sum(e.metrics, "aether_inbound_source_total", map[string]string{"outcome": telemetry.SourcePreserved}); got != 2 {
			t.Errorf("inbound source preserved = %v, want 2", got)
		}
		// On the wire (what the server's eth0 received from the client,
		// both families): TLS records to :15008, nothing to the app's
		// port, and never the payload in plaintext.
		var tls, toApp, plaintext int
		for _, seg := range wire() {
			if seg.src != e.client.IP4 && seg.src != e.client.IP6 {
				continue
			}
			if seg.dst.Port() == dataplane.DefaultHBONEPort && seg.tlsRecord {
				tls++
			}
			if seg.dst.Port() == 8080 {
				toApp++
			}
			if seg.secret {
				plaintext++
			}
		}
		if tls == 0 || toApp != 0 || plaintext != 0 {
			t.Errorf("wire from the client: %d segments to :15008 starting a TLS record, %d to :8080, %d with the plaintext payload; want >0, 0, 0",
				tls, toApp, plaintext)
		}
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone"}); got != 2 {
			t.Errorf("outbound path=hbone = %v, want 2", got)
		}
		in := map[string]string{
			"reporter": "destination", "source_workload": "client", "destination_workload": "server",
			"source_principal": podID(e.client).String(), "destination_principal": podID(e.server).String(),
		}
		out := map[string]string{
			"reporter": "source", "source_workload": "client", "destination_workload": "server",
			"source_principal": podID(e.client).String(), "destination_principal": podID(e.server).String(),
		}
		for _, m := range []map[string]string{in, out} {
			if err := proxytest.WaitFor(ctx10(t), func() bool {
				// Sent: on the inbound side the HBONE server reads the app
				// socket itself (hbone.SocketConn) and reports every read.
				return sum(e.metrics, "istio_tcp_connections_closed_total", m) == 2 &&
					sum(e.metrics, "istio_tcp_received_bytes_total", m) == float64(2*len("secret-0")) &&
					sum(e.metrics, "istio_tcp_sent_bytes_total", m) == float64(replied)
			}); err != nil {
				t.Errorf("connections/bytes %v: closed %v, received %v, sent %v (want %d)", m, sum(e.metrics, "istio_tcp_connections_closed_total", m),
					sum(e.metrics, "istio_tcp_received_bytes_total", m), sum(e.metrics, "istio_tcp_sent_bytes_total", m), replied)
			}
		}
		if got := sum(e.metrics, "aether_inbound_deliveries_total", map[string]string{"via": telemetry.ViaTCP}); got != 2 {
			t.Errorf("inbound deliveries via tcp = %v, want 2", got)
		}
	})

	t.Run("managed to unmanaged", func(t *testing.T) {
		ctx := ctx10(t)
		reply, err := roundTrip(ctx, e.client, netip.AddrPortFrom(e.plain.IP4, 8080), "hi")
		if err != nil {
			t.Fatal(err)
		}
		if want := "got 2 from " + e.client.IP4.String(); reply != want {
			t.Errorf("reply %q, want %q (plain passthrough from the client's address)", reply, want)
		}
		<-plain.Got
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "passthrough_not_hbone"}); got != 1 {
			t.Errorf("outbound path=passthrough_not_hbone = %v, want 1", got)
		}
	})

	t.Run("dial failure resets", func(t *testing.T) {
		// WDS now claims the unmanaged pod speaks HBONE: nothing listens
		// on its :15008.
		e.idx.Upsert(hboneWorkload(e.plain, true))
		t.Cleanup(func() { e.idx.Upsert(hboneWorkload(e.plain, false)) })
		ctx := ctx10(t)
		_, err := roundTrip(ctx, e.client, netip.AddrPortFrom(e.plain.IP4, 8080), "must-not-leak")
		if !isReset(err) {
			t.Errorf("client error %v, want a reset", err)
		}
		select {
		case got := <-plain.Got:
			t.Fatalf("the unmanaged app received %q in plaintext", got)
		case <-time.After(200 * time.Millisecond):
		}
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone_failed"}); got != 1 {
			t.Errorf("outbound path=hbone_failed = %v, want 1", got)
		}
	})
}

// TestHBONEDeliversToUDS: a destination pod whose listeners name a UDS
// socket gets the HBONE stream on that socket; once the socket is gone the
// stream goes over TCP (counted uds_fallback).
func TestHBONEDeliversToUDS(t *testing.T) {
	udsRoot := t.TempDir()
	e := setupHBONEConfig(t, dataplane.Config{ConnectTimeout: 3 * time.Second, UDSRoot: udsRoot})
	sock := proxytest.PodSocketPath(t, udsRoot, "uid-server", "app.sock")
	ln := proxytest.ServeUnix(t, sock, func(c net.Conn) {
		b, _ := io.ReadAll(c)
		_, _ = fmt.Fprintf(c, "uds got %s", b)
	})
	e.server.Serve(t, 8080)
	specs := e.server.Specs(t)
	for i := range specs {
		specs[i].UID, specs[i].UDSSocket = "uid-server", sock
	}
	e.mgr.SetListeners(append(e.client.Specs(t), specs...))
	// The server pod is re-bound with the socket (drained, then served).
	// SetListeners is applied by the manager's loop: wait for the serving
	// pod that carries the socket, not for the one it replaces.
	if err := proxytest.WaitFor(ctx10(t), func() bool {
		st := e.mgr.Status()
		if len(st) != 2 || st[0].State != dataplane.StateServing {
			return false
		}
		for _, s := range st {
			if s.Name == e.server.Name && s.UDSSocket == sock && s.State == dataplane.StateServing && e.mgr.Ready(s.Key) {
				return true
			}
		}
		return false
	}); err != nil {
		t.Fatalf("pods never served again: %+v", e.mgr.Status())
	}
	dst := netip.AddrPortFrom(e.server.IP4, 8080)
	var reply string
	var err error
	if err := proxytest.WaitFor(ctx10(t), func() bool {
		reply, err = roundTrip(ctx10(t), e.client, dst, "via-uds")
		return err == nil
	}); err != nil {
		t.Fatalf("round trip: %v", err)
	}
	if reply != "uds got via-uds" {
		t.Errorf("reply %q, want the UDS app's answer", reply)
	}
	if got := sum(e.metrics, "aether_inbound_deliveries_total", map[string]string{"via": telemetry.ViaUDS}); got != 1 {
		t.Errorf("deliveries via uds = %v, want 1", got)
	}
	_ = ln.Close() // removes the socket file
	reply, err = roundTrip(ctx10(t), e.client, dst, "fallback")
	if err != nil || reply != fmt.Sprintf("got 8 from %s", e.client.IP4) {
		t.Errorf("after the socket is gone: %q, %v; want the TCP app's answer", reply, err)
	}
	if got := sum(e.metrics, "aether_inbound_deliveries_total", map[string]string{"via": telemetry.ViaUDSFallback}); got != 1 {
		t.Errorf("deliveries via uds_fallback = %v, want 1", got)
	}
}

// TestHBONERotation: a live tunnelled connection keeps flowing while the
// client's SVID rotates, and a new connection after the rotation works (it
// shares the pooled HTTP/2 connection; that a new pooled connection reads
// the rotated SVID per handshake is proxy/hbone's own test).
func TestHBONERotation(t *testing.T) {
	e := setupHBONE(t)
	e.server.Echo(t, 9090)
	ctx := ctx10(t)
	c, err := e.client.Dial(ctx, netip.AddrPortFrom(e.server.IP4, 9090))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	echo := func(s string) {
		t.Helper()
		if _, err := c.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, len(s))
		if _, err := io.ReadFull(c, b); err != nil || string(b) != s {
			t.Fatalf("echo %q: got %q, %v", s, b, err)
		}
	}
	echo("before")
	// Rotate the client's SVID (a new key and serial) while c is open.
	svid, err := e.ca.SVID(podID(e.client), time.Now().Add(-time.Minute), time.Now().Add(2*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	e.certs.SetSVID(svid)
	echo("after")
	// The live connection still flows; a new one works with the new SVID.
	reply, err := roundTrip(ctx, e.client, netip.AddrPortFrom(e.server.IP4, 9090), "new")
	if err != nil || reply != "new" {
		t.Fatalf("new connection after rotation: %q, %v", reply, err)
	}
}

// TestHBONEDrainDeadline: a captured connection tunnelled over HBONE that
// is still open when its pod's drain deadline passes ends cleanly: the
// client reads EOF (a FIN, no reset) and the app's side reads EOF too (the
// stream ended with END_STREAM, not RST_STREAM).
func TestHBONEDrainDeadline(t *testing.T) {
	e := setupHBONEConfig(t, dataplane.Config{ConnectTimeout: 3 * time.Second, DrainTimeout: 300 * time.Millisecond})
	appEnd := make(chan error, 1)
	e.server.Handle(t, 7071, func(c net.Conn) {
		_, err := io.Copy(c, c)
		appEnd <- err
	})
	c := dialPing(t, e.client, netip.AddrPortFrom(e.server.IP4, 7071))
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	e.mgr.SetListeners(e.server.Specs(t)) // the client pod is removed: its drain starts
	if _, err := io.ReadAll(c); err != nil {
		t.Fatalf("the tunnelled connection at the drain deadline ended with %v, want a FIN (EOF)", err)
	}
	select {
	case err := <-appEnd:
		if err != nil {
			t.Fatalf("the app's side ended with %v, want EOF (END_STREAM)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the app's side did not end")
	}
}

// dialPing connects from pod from to dst (closed at the test's end, within
// 10 s) and writes "ping".
func dialPing(t *testing.T, from *proxytest.Pod, dst netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := from.Dial(ctx10(t), dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	return c
}
