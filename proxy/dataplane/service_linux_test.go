package dataplane_test

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/api/istio/workload"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
)

// serviceOf is a Service named name with one VIP per family, port 80 to
// 8080. The VIPs are in the pods' subnets (the single-node topology has no
// default route) but no pod holds them: only the capture ever sees them.
func serviceOf(name string, vip4, vip6 netip.Addr) *workload.Service {
	return &workload.Service{
		Name: name, Namespace: "default", Hostname: name + ".default.svc.cluster.local",
		Addresses: []*workload.NetworkAddress{{Address: vip4.AsSlice()}, {Address: vip6.AsSlice()}},
		Ports:     []*workload.Port{{ServicePort: 80, TargetPort: 8080}},
	}
}

// member is w naming the Services svcs in its services map.
func member(w *workload.Workload, svcs ...*workload.Service) *workload.Workload {
	w.Services = map[string]*workload.PortList{}
	for _, s := range svcs {
		w.Services[peers.ServiceKey(s)] = &workload.PortList{}
	}
	return w
}

// TestServiceVIP: a captured connection to a Service VIP goes to an
// endpoint the proxy chose, over HBONE for a mesh endpoint and in plain TCP
// for another; a Service without endpoints is reset at once; a chosen
// endpoint that cannot be reached is retried on another before the client
// sees anything.
func TestServiceVIP(t *testing.T) {
	svcs := peers.NewServices()
	e := setupHBONEConfig(t, dataplane.Config{ConnectTimeout: 3 * time.Second, Services: svcs})
	srv := e.server.Serve(t, 8080)
	plain := e.plain.Serve(t, 8080)
	vip4, vip6 := netip.MustParseAddr("10.88.0.200"), netip.MustParseAddr("fd88::200")
	mesh := serviceOf("mesh", vip4, vip6)
	plainSvc := serviceOf("plain", netip.MustParseAddr("10.88.0.201"), netip.MustParseAddr("fd88::201"))
	empty := serviceOf("empty", netip.MustParseAddr("10.88.0.202"), netip.MustParseAddr("fd88::202"))
	for _, s := range []*workload.Service{mesh, plainSvc, empty} {
		svcs.UpsertService(s)
	}
	svcs.UpsertWorkload(member(hboneWorkload(e.server, true), mesh))
	svcs.UpsertWorkload(member(hboneWorkload(e.plain, false), plainSvc))
	svcs.UpsertWorkload(hboneWorkload(e.client, true))

	t.Run("mesh endpoint over HBONE", func(t *testing.T) {
		for i, vip := range []netip.Addr{vip4, vip6} {
			reply, err := roundTrip(ctx10(t), e.client, netip.AddrPortFrom(vip, 80), fmt.Sprintf("svc-%d", i))
			if err != nil {
				t.Fatal(err)
			}
			src := e.client.IP4
			if vip.Is6() {
				src = e.client.IP6
			}
			if want := "got 5 from " + src.String(); reply != want {
				t.Errorf("reply %q, want %q", reply, want)
			}
			if got := <-srv.Got; got != fmt.Sprintf("%s svc-%d", src, i) {
				t.Errorf("server got %q", got)
			}
		}
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "service_hbone"}); got != 2 {
			t.Errorf("outbound path=service_hbone = %v, want 2", got)
		}
	})

	t.Run("plain endpoint in plaintext", func(t *testing.T) {
		reply, err := roundTrip(ctx10(t), e.client, netip.MustParseAddrPort("10.88.0.201:80"), "hi")
		if err != nil {
			t.Fatal(err)
		}
		if want := "got 2 from " + e.client.IP4.String(); reply != want {
			t.Errorf("reply %q, want %q", reply, want)
		}
		<-plain.Got
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "service_plaintext"}); got != 1 {
			t.Errorf("outbound path=service_plaintext = %v, want 1", got)
		}
	})

	t.Run("no endpoint resets at once", func(t *testing.T) {
		_, err := roundTrip(ctx10(t), e.client, netip.MustParseAddrPort("10.88.0.202:80"), "nobody")
		if !isReset(err) {
			t.Errorf("client error %v, want a reset", err)
		}
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "service_no_endpoint"}); got != 1 {
			t.Errorf("outbound path=service_no_endpoint = %v, want 1", got)
		}
	})

	t.Run("unreachable endpoint retried on another", func(t *testing.T) {
		// The unmanaged pod now also claims to serve the mesh Service over
		// HBONE: nothing listens on its :15008, so every connection the
		// proxy sends there first must end at the server.
		svcs.UpsertWorkload(member(hboneWorkload(e.plain, true), mesh, plainSvc))
		t.Cleanup(func() { svcs.UpsertWorkload(member(hboneWorkload(e.plain, false), plainSvc)) })
		const n = 12
		for i := range n {
			if _, err := roundTrip(ctx10(t), e.client, netip.AddrPortFrom(vip4, 80), "retry"); err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			if got := <-srv.Got; got != e.client.IP4.String()+" retry" {
				t.Fatalf("server got %q", got)
			}
		}
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "service_hbone"}); got != 2+n {
			t.Errorf("outbound path=service_hbone = %v, want %d", got, 2+n)
		}
		if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "service_failed"}); got != 0 {
			t.Errorf("outbound path=service_failed = %v, want 0", got)
		}
		select {
		case got := <-plain.Got:
			t.Fatalf("the unmanaged app received %q", got)
		default:
		}
	})

	t.Run("not a VIP: as before", func(t *testing.T) {
		reply, err := roundTrip(ctx10(t), e.client, netip.AddrPortFrom(e.server.IP4, 8080), "direct")
		if err != nil {
			t.Fatal(err)
		}
		if reply != "got 6 from "+e.client.IP4.String() {
			t.Errorf("reply %q", reply)
		}
		<-srv.Got
	})
}

// BenchmarkServiceConnect: connect plus a one-byte round trip from the
// client pod over HBONE to the server pod, dialled at the pod's IP (peer)
// and at a Service VIP the proxy resolves to it (ours), alternated in one
// run; p50/p99. The difference is what resolving and choosing costs.
func BenchmarkServiceConnect(b *testing.B) {
	svcs := peers.NewServices()
	e := setupHBONEConfig(b, dataplane.Config{ConnectTimeout: 3 * time.Second, Services: svcs})
	e.server.Echo(b, 8080)
	vip4 := netip.MustParseAddr("10.88.0.200")
	svc := serviceOf("bench", vip4, netip.MustParseAddr("fd88::200"))
	svcs.UpsertService(svc)
	svcs.UpsertWorkload(member(hboneWorkload(e.server, true), svc))
	for _, mode := range []string{"peer", "ours", "peer-again", "ours-again"} {
		dst := netip.AddrPortFrom(e.server.IP4, 8080)
		if mode == "ours" || mode == "ours-again" {
			dst = netip.AddrPortFrom(vip4, 80)
		}
		b.Run(mode, func(b *testing.B) {
			connectLatency(b, func() *net.TCPConn { return podDial(b, e.client, dst) })
		})
	}
}

// BenchmarkServiceRequestLatency: request/response latency on established
// connections, 1 KiB echoed at 1,000 requests a second, through both
// proxies over HBONE via a Service (ours: the captured client pod on node
// A dials a VIP, A's proxy resolves it and tunnels to the server pod on
// node B, whose proxy delivers to the app) against the same calls direct
// (peer: an uncaptured pod on node A to the server pod's address, no proxy
// on the path), alternated in one run; p50/p90/p99 of each. The difference
// is what the mesh adds per request (Istio publishes +0.17 ms p90 and
// +0.20 ms p99 for a ztunnel pair).
func BenchmarkServiceRequestLatency(b *testing.B) {
	c := proxytest.NewCluster(b,
		proxytest.NodeSpec{Pods: []string{"client", "direct"}, Captured: []string{"client"}},
		proxytest.NodeSpec{Pods: []string{"server"}, Captured: []string{"server"}},
	)
	client, direct, server := c.Nodes[0].Pods[0], c.Nodes[0].Pods[1], c.Nodes[1].Pods[0]
	client.SPIFFEID, server.SPIFFEID = podID(client).String(), podID(server).String()
	ca, err := hbonetest.NewCA(spiffeid.RequireTrustDomainFromString(testTrustDomain))
	if err != nil {
		b.Fatal(err)
	}
	vip4 := netip.MustParseAddr("10.88.0.201")
	svc := serviceOf("echo", vip4, netip.MustParseAddr("fd88::201"))
	fill := func(idx *peers.Index) {
		idx.Upsert(hboneWorkload(client, true))
		idx.Upsert(hboneWorkload(server, true))
		idx.Upsert(hboneWorkload(direct, false))
	}
	svcs := peers.NewServices()
	svcs.UpsertService(svc)
	svcs.UpsertWorkload(member(hboneWorkload(server, true), svc))
	startNodeProxyConfig(b, ca, fill, []*proxytest.Pod{client}, client.Specs(b), dataplane.Config{Services: svcs})
	startNodeProxy(b, ca, fill, []*proxytest.Pod{server}, server.Specs(b))
	server.Echo(b, 8080)
	for _, mode := range []string{"peer", "ours", "peer-again", "ours-again"} {
		from, dst := direct, netip.AddrPortFrom(server.IP4, 8080)
		if mode == "ours" || mode == "ours-again" {
			from, dst = client, netip.AddrPortFrom(vip4, 80)
		}
		b.Run(mode, func(b *testing.B) {
			conn := podDial(b, from, dst)
			defer conn.Close()
			requestLatency(b, conn, 1024, time.Millisecond)
		})
	}
}

// requestLatency sends size bytes and reads the echo back on c, b.N times,
// one request every interval (paced from a schedule; a late request goes
// at once), and reports the p50, p90 and p99 of the round trips.
func requestLatency(b *testing.B, c *net.TCPConn, size int, interval time.Duration) {
	req, resp := make([]byte, size), make([]byte, size)
	for range 10 { // warm: the path, the pool, the proxies' buffers
		if _, err := c.Write(req); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			b.Fatal(err)
		}
	}
	lat := make([]time.Duration, 0, b.N)
	next := time.Now()
	b.ResetTimer()
	for range b.N {
		next = next.Add(interval)
		if d := time.Until(next); d > 0 {
			time.Sleep(d)
		}
		start := time.Now()
		if _, err := c.Write(req); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	for _, q := range []struct {
		name string
		pct  int
	}{{"p50-ns", 50}, {"p90-ns", 90}, {"p99-ns", 99}} {
		b.ReportMetric(float64(lat[len(lat)*q.pct/100].Nanoseconds()), q.name)
	}
}
