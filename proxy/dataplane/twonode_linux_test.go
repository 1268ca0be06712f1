package dataplane_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/sys/unix"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/test/harness"
	"aether.io/node/xds/listener"
)

// nodeProxy is one node's aether-proxy: its own manager, peers index,
// metrics and certificates (the SVIDs of its node's managed pods only).
type nodeProxy struct {
	mgr     *dataplane.Manager
	metrics *telemetry.Metrics
	logs    *logCount
	// stop ends Run (as SIGTERM does), waits for it and closes the
	// manager; later calls do nothing.
	stop func()
}

// logCount is a slog handler that counts the records at each level and
// message.
type logCount struct {
	mu sync.Mutex
	n  map[string]int // "LEVEL message"
}

// Enabled implements slog.Handler: every level is counted.
func (*logCount) Enabled(context.Context, slog.Level) bool { return true }

// Handle implements slog.Handler.
func (l *logCount) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.n == nil {
		l.n = map[string]int{}
	}
	l.n[r.Level.String()+" "+r.Message]++
	return nil
}

// WithAttrs implements slog.Handler (attributes are not counted).
func (l *logCount) WithAttrs([]slog.Attr) slog.Handler { return l }

// WithGroup implements slog.Handler.
func (l *logCount) WithGroup(string) slog.Handler { return l }

// count returns how many records at level had a message starting with
// prefix.
func (l *logCount) count(level slog.Level, prefix string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for k, v := range l.n {
		if strings.HasPrefix(k, level.String()+" "+prefix) {
			n += v
		}
	}
	return n
}

// startNodeProxy runs a manager with its own peers index (filled by
// fill), serving the listeners of pods (whose SVIDs it holds), and waits for
// the pods' readiness.
func startNodeProxy(t testing.TB, ca *hbonetest.CA, fill func(*peers.Index), pods []*proxytest.Pod, specs []listener.Spec) *nodeProxy {
	t.Helper()
	return startNodeProxyConfig(t, ca, fill, pods, specs, dataplane.Config{})
}

// startNodeProxyConfig is startNodeProxy with cfg's other fields (a
// Services index, say) for the node's manager.
func startNodeProxyConfig(t testing.TB, ca *hbonetest.CA, fill func(*peers.Index), pods []*proxytest.Pod, specs []listener.Spec, cfg dataplane.Config) *nodeProxy {
	t.Helper()
	certs := hbonetest.NewCerts(ca.Bundle())
	for _, p := range pods {
		if p.SPIFFEID == "" {
			continue
		}
		svid, err := ca.ValidSVID(podID(p))
		if err != nil {
			t.Fatal(err)
		}
		certs.SetSVID(svid)
	}
	n := &nodeProxy{metrics: telemetry.New(), logs: &logCount{}}
	idx := peers.NewIndex()
	fill(idx)
	var err error
	cfg.Certs, cfg.ConnectTimeout, cfg.ShutdownDrain = certs, 3*time.Second, time.Second
	n.mgr, err = dataplane.New(cfg, idx, n.metrics, slog.New(n.logs))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = n.mgr.Run(ctx); close(done) }()
	n.stop = sync.OnceFunc(func() { cancel(); <-done; _ = n.mgr.Close() })
	t.Cleanup(n.stop)
	n.mgr.SetListeners(specs)
	env := &env{metrics: n.metrics}
	for _, p := range pods {
		env.waitReady(t, p, 200)
	}
	return n
}

// TestHBONETwoNodes runs two nodes (each its own node netns, bridge, pods
// and aether-proxy) routed to each other over a fabric bridge: managed →
// managed across nodes goes over HBONE (the link between the nodes carries
// only TLS records to :15008, never the app's port nor the payload; the
// destination's metrics name the source's verified principal and the
// source's the destination's), managed → unmanaged stays plain (nothing to
// :15008), the destination's strict inbound policy resets plaintext from an
// unmanaged pod of the other node while HBONE still reaches the app, and
// once the destination's proxy is gone a new connection is reset, never
// sent in plaintext.
func TestHBONETwoNodes(t *testing.T) {
	c := proxytest.NewCluster(t,
		proxytest.NodeSpec{Pods: []string{"client", "plain-a"}, Captured: []string{"client"}},
		proxytest.NodeSpec{Pods: []string{"server", "plain-b"}, Captured: []string{"server"}},
	)
	client, plainA := c.Nodes[0].Pods[0], c.Nodes[0].Pods[1]
	server, plainB := c.Nodes[1].Pods[0], c.Nodes[1].Pods[1]
	client.SPIFFEID, server.SPIFFEID = podID(client).String(), podID(server).String()
	// The server pod's divert also redirects plaintext inbound to its
	// proxy, whose listeners carry the strict policy.
	cfg := capture.Config{RedirectAll: true, InboundCapture: true}
	if err := (capture.Installer{}).Install(server.NS.Path(), capture.Build(cfg)); err != nil {
		t.Fatal(err)
	}
	ca, err := hbonetest.NewCA(spiffeid.RequireTrustDomainFromString(testTrustDomain))
	if err != nil {
		t.Fatal(err)
	}
	// Each proxy's WDS holds the workloads of both nodes.
	fill := func(idx *peers.Index) {
		for _, p := range []*proxytest.Pod{client, server} {
			idx.Upsert(hboneWorkload(p, true))
		}
		for _, p := range []*proxytest.Pod{plainA, plainB} {
			idx.Upsert(hboneWorkload(p, false))
		}
	}
	var strict []listener.Spec
	for _, s := range server.Specs(t) {
		s.InboundPolicy = meshcontract.InboundPolicyStrict
		strict = append(strict, s)
	}
	a := startNodeProxy(t, ca, fill, []*proxytest.Pod{client}, client.Specs(t))
	b := startNodeProxy(t, ca, fill, []*proxytest.Pod{server}, strict)

	const appPort = 8080
	srv := server.Serve(t, appPort)
	plain := plainB.Serve(t, appPort)
	// What node B receives from node A on the link between them.
	link := func(t *testing.T) func() []segment { return sniffLink(t, c.Nodes[1].Node, proxytest.FabricLink) }
	fromClient := func(s segment) bool { return s.src == client.IP4 || s.src == client.IP6 }

	t.Run("managed to managed over HBONE", func(t *testing.T) {
		wire := link(t)
		for i, dst := range []netip.Addr{server.IP4, server.IP6} {
			payload := "secret-" + string(rune('0'+i))
			reply, err := roundTrip(ctx10(t), client, netip.AddrPortFrom(dst, appPort), payload)
			if err != nil {
				t.Fatal(err)
			}
			// B's proxy dials the app from the server's own netns, with
			// the client pod's address as source.
			src := client.IP4
			if dst.Is6() {
				src = client.IP6
			}
			if want := "got 8 from " + src.String(); reply != want {
				t.Errorf("reply %q, want %q", reply, want)
			}
			if got := <-srv.Got; got != src.String()+" "+payload {
				t.Errorf("server got %q", got)
			}
		}
		if got := sum(b.metrics, "aether_inbound_source_total", map[string]string{"outcome": telemetry.SourcePreserved}); got != 2 {
			t.Errorf("B: inbound source preserved = %v, want 2", got)
		}
		var tls, other, app, secret int
		for _, s := range wire() {
			if !fromClient(s) {
				continue
			}
			switch {
			case s.dst.Port() == dataplane.DefaultHBONEPort && s.tlsRecord:
				tls++
			case s.dst.Port() == appPort:
				app++
			case s.dst.Port() != dataplane.DefaultHBONEPort:
				other++
			}
			if s.secret {
				secret++
			}
		}
		t.Logf("link from the client: %d TLS records to :15008", tls)
		if tls == 0 || app != 0 || other != 0 || secret != 0 {
			t.Errorf("link from the client: %d segments to :15008 starting a TLS record, %d to :%d, %d to other ports, %d with the payload; want >0, 0, 0, 0",
				tls, app, appPort, other, secret)
		}
		principals := map[string]string{
			"source_workload": "client", "destination_workload": "server",
			"source_principal": podID(client).String(), "destination_principal": podID(server).String(),
		}
		for _, side := range []struct {
			name     string
			m        *telemetry.Metrics
			reporter string
		}{{"B (destination)", b.metrics, "destination"}, {"A (source)", a.metrics, "source"}} {
			m := map[string]string{"reporter": side.reporter, "connection_security_policy": "mutual_tls", "response_flags": "-"}
			for k, v := range principals {
				m[k] = v
			}
			if err := proxytest.WaitFor(ctx10(t), func() bool {
				return sum(side.m, "istio_tcp_connections_closed_total", m) == 2 &&
					sum(side.m, "istio_tcp_received_bytes_total", m) == float64(2*len("secret-0"))
			}); err != nil {
				t.Errorf("%s %v: closed %v, received %v; want 2, %d", side.name, m,
					sum(side.m, "istio_tcp_connections_closed_total", m), sum(side.m, "istio_tcp_received_bytes_total", m), 2*len("secret-0"))
			}
		}
		if got := sum(a.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone"}); got != 2 {
			t.Errorf("A: outbound path=hbone = %v, want 2", got)
		}
	})

	t.Run("managed to unmanaged plain", func(t *testing.T) {
		wire := link(t)
		for _, dst := range []netip.Addr{plainB.IP4, plainB.IP6} {
			reply, err := roundTrip(ctx10(t), client, netip.AddrPortFrom(dst, appPort), "hi")
			if err != nil {
				t.Fatal(err)
			}
			src := client.IP4
			if dst.Is6() {
				src = client.IP6
			}
			if want := "got 2 from " + src.String(); reply != want {
				t.Errorf("reply %q, want %q (plain from the client's address)", reply, want)
			}
			<-plain.Got
		}
		var hbone, app int
		for _, s := range wire() {
			if !fromClient(s) {
				continue
			}
			if s.dst.Port() == dataplane.DefaultHBONEPort {
				hbone++
			}
			if s.dst.Port() == appPort && (s.dst.Addr() == plainB.IP4 || s.dst.Addr() == plainB.IP6) {
				app++
			}
		}
		t.Logf("link from the client: %d segments to the unmanaged app", app)
		if hbone != 0 || app == 0 {
			t.Errorf("link from the client: %d segments to :15008, %d to the unmanaged app; want 0, >0", hbone, app)
		}
		if got := sum(a.metrics, "aether_outbound_connections_total", map[string]string{"path": "passthrough_not_hbone"}); got != 2 {
			t.Errorf("A: outbound path=passthrough_not_hbone = %v, want 2", got)
		}
	})

	t.Run("strict inbound refuses plaintext", func(t *testing.T) {
		denied := func() float64 {
			return sum(b.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "inbound_policy_denied"})
		}
		before := denied()
		for _, dst := range []netip.Addr{server.IP4, server.IP6} {
			reply, err := roundTrip(ctx10(t), plainA, netip.AddrPortFrom(dst, appPort), "secret-plain")
			if !isReset(err) {
				t.Errorf("plaintext from plain-a to %s = %q, %v; want a reset", dst, reply, err)
			}
		}
		if n := denied() - before; n != 2 {
			t.Errorf("B: inbound_policy_denied counted %v, want 2", n)
		}
		select {
		case got := <-srv.Got:
			t.Errorf("the strict app received %q", got)
		default:
		}
		// HBONE from A's managed pod still reaches the app.
		reply, err := roundTrip(ctx10(t), client, netip.AddrPortFrom(server.IP4, appPort), "secret-x")
		if err != nil || reply != "got 8 from "+client.IP4.String() {
			t.Fatalf("HBONE under strict = %q, %v; want the app's answer", reply, err)
		}
		<-srv.Got
	})

	t.Run("destination proxy gone resets", func(t *testing.T) {
		if !listening(t, server.NS, dataplane.DefaultHBONEPort) {
			t.Fatal("the server's :15008 does not listen before its proxy stops")
		}
		b.stop()
		// Its :15008 is gone from the server's netns.
		if err := proxytest.WaitFor(ctx10(t), func() bool {
			return !listening(t, server.NS, dataplane.DefaultHBONEPort)
		}); err != nil {
			t.Fatal("the server's :15008 still listens after its proxy stopped")
		}
		wire := link(t)
		failed := sum(a.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone_failed"})
		reply, err := roundTrip(ctx10(t), client, netip.AddrPortFrom(server.IP4, appPort), "secret-gone")
		if !isReset(err) {
			t.Errorf("client to the server without its proxy = %q, %v; want a reset", reply, err)
		}
		select {
		case got := <-srv.Got:
			t.Fatalf("the server's app received %q in plaintext", got)
		case <-time.After(200 * time.Millisecond):
		}
		for _, s := range wire() {
			if fromClient(s) && (s.dst.Port() == appPort || s.secret) {
				t.Errorf("plaintext on the link: %s -> %s (payload %v)", s.src, s.dst, s.secret)
			}
		}
		if n := sum(a.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone_failed"}) - failed; n != 1 {
			t.Errorf("A: outbound path=hbone_failed counted %v, want 1", n)
		}
	})
}

// isReset reports whether err is how a reset surfaces at the next call on
// the client's socket: the write, the half-close (ENOTCONN) or the read.
func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.EPIPE)
}

// listening reports whether something listens on TCP port in ns (IPv4).
func listening(t *testing.T, ns *harness.NS, port uint16) bool {
	t.Helper()
	var ok bool
	ns.MustDo(t, func() error {
		c, err := net.DialTimeout("tcp", netip.AddrPortFrom(netip.IPv4Unspecified(), port).String(), time.Second)
		if err == nil {
			_ = c.Close()
			ok = true
		}
		return nil
	})
	return ok
}

// segment is one TCP segment a link sniffer saw.
type segment struct {
	src       netip.Addr
	dst       netip.AddrPort
	tlsRecord bool // the payload starts a TLS record (0x16 0x03)
	secret    bool // the payload carries "secret-"
}

// sniffLink reads copies of the IPv4 and IPv6 TCP segments crossing link in
// ns (an AF_PACKET socket: no tcpdump needed) until the returned function
// is called, which reports them.
func sniffLink(t *testing.T, ns *harness.NS, link string) func() []segment {
	t.Helper()
	var f *os.File
	ns.MustDo(t, func() error {
		ifi, err := net.InterfaceByName(link)
		if err != nil {
			return err
		}
		proto := int(htons(unix.ETH_P_ALL))
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, proto)
		if err != nil {
			return err
		}
		if err := unix.Bind(fd, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: ifi.Index}); err != nil {
			_ = unix.Close(fd)
			return err
		}
		f = os.NewFile(uintptr(fd), "packet:"+link)
		return nil
	})
	t.Cleanup(func() { _ = f.Close() })
	var seen []segment
	done := make(chan struct{})
	go func() {
		defer close(done)
		b := make([]byte, 65536)
		for {
			n, err := f.Read(b)
			if err != nil {
				return
			}
			if s, ok := parseTCP(b[:n]); ok {
				seen = append(seen, s)
			}
		}
	}()
	return func() []segment {
		_ = f.Close()
		<-done
		return seen
	}
}

// parseTCP reads an IPv4 or IPv6 packet carrying TCP (no IPv6 extension
// headers).
func parseTCP(p []byte) (segment, bool) {
	var s segment
	var tcp []byte
	var dst netip.Addr
	switch {
	case len(p) >= 20 && p[0]>>4 == 4 && p[9] == unix.IPPROTO_TCP:
		s.src, dst = netip.AddrFrom4([4]byte(p[12:16])), netip.AddrFrom4([4]byte(p[16:20]))
		tcp = p[min(int(p[0]&0x0f)*4, len(p)):]
	case len(p) >= 40 && p[0]>>4 == 6 && p[6] == unix.IPPROTO_TCP:
		s.src, dst = netip.AddrFrom16([16]byte(p[8:24])), netip.AddrFrom16([16]byte(p[24:40]))
		tcp = p[40:]
	default:
		return s, false
	}
	if len(tcp) < 20 {
		return s, false
	}
	s.dst = netip.AddrPortFrom(dst, binary.BigEndian.Uint16(tcp[2:4]))
	payload := tcp[min(int(tcp[12]>>4)*4, len(tcp)):]
	s.tlsRecord = len(payload) >= 2 && payload[0] == 0x16 && payload[1] == 0x03
	s.secret = bytes.Contains(payload, []byte("secret-"))
	return s, true
}

// htons converts a 16-bit value to network byte order.
func htons(v uint16) uint16 { return v<<8 | v>>8 }
