package dataplane_test

import (
	"log/slog"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone/hbonetest"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/proxytest"
	"aether.io/node/proxy/telemetry"
)

// missingRuleLog starts the proxy's ERROR for a pod whose divert lacks the
// deliver rule.
const missingRuleLog = "the capture divert's deliver rule is missing"

// TestInboundSourceTwoNodes: the destination proxy delivers to the app with
// the client's address as source, over HBONE and the plaintext inbound
// redirect, on both families, across two nodes. The server pod is bound by
// its proxy before aether-cni installs its divert (the real order: the agent
// serves the listeners at AddPod, the divert follows the readiness probe):
// until then the deliver rule is missing and every connection still works,
// from the pod's own address, counted as fallback; once the divert is in,
// the next connections preserve the client's address, without a rebind.
func TestInboundSourceTwoNodes(t *testing.T) {
	c := proxytest.NewCluster(t,
		proxytest.NodeSpec{Pods: []string{"client", "plain-a"}, Captured: []string{"client"}},
		proxytest.NodeSpec{Pods: []string{"server"}}, // no divert yet
	)
	client, plainA := c.Nodes[0].Pods[0], c.Nodes[0].Pods[1]
	server := c.Nodes[1].Pods[0]
	client.SPIFFEID, server.SPIFFEID = podID(client).String(), podID(server).String()
	ca, err := hbonetest.NewCA(spiffeid.RequireTrustDomainFromString(testTrustDomain))
	if err != nil {
		t.Fatal(err)
	}
	fill := func(idx *peers.Index) {
		idx.Upsert(hboneWorkload(client, true))
		idx.Upsert(hboneWorkload(server, true))
		idx.Upsert(hboneWorkload(plainA, false))
	}
	startNodeProxy(t, ca, fill, []*proxytest.Pod{client}, client.Specs(t))
	b := startNodeProxy(t, ca, fill, []*proxytest.Pod{server}, server.Specs(t))
	const appPort = 8080
	srv := server.Serve(t, appPort)
	source := func(outcome string) float64 {
		return sum(b.metrics, "aether_inbound_source_total", map[string]string{"outcome": outcome})
	}
	// check sends from `from` to the server's app at dst and wants the app
	// to have seen the connection come from seen.
	check := func(t *testing.T, from *proxytest.Pod, dst, seen netip.Addr, payload string) {
		t.Helper()
		reply, err := roundTrip(ctx10(t), from, netip.AddrPortFrom(dst, appPort), payload)
		if err != nil {
			t.Fatalf("%s to %s: %v", from.Name, dst, err)
		}
		if want := "got " + strconv.Itoa(len(payload)) + " from " + seen.String(); reply != want {
			t.Errorf("%s to %s: reply %q, want %q", from.Name, dst, reply, want)
		}
		if got := <-srv.Got; got != seen.String()+" "+payload {
			t.Errorf("%s to %s: the app got %q", from.Name, dst, got)
		}
	}
	family := func(p *proxytest.Pod, like netip.Addr) netip.Addr {
		if like.Is4() {
			return p.IP4
		}
		return p.IP6
	}

	t.Run("bound before the divert: fallback", func(t *testing.T) {
		for _, dst := range []netip.Addr{server.IP4, server.IP6} {
			check(t, client, dst, dst, "hbone-early") // the pod's own address
		}
		if p, f := source(telemetry.SourcePreserved), source(telemetry.SourceFallback); p != 0 || f != 2 {
			t.Errorf("inbound source preserved %v, fallback %v; want 0, 2", p, f)
		}
		// Two fallbacks (one per family), one ERROR for the pod.
		if n := b.logs.count(slog.LevelError, missingRuleLog); n != 1 {
			t.Errorf("%d ERROR records %q for one pod, want 1", n, missingRuleLog)
		}
	})

	// aether-cni's ADD reaches the divert step after the proxy bound the pod.
	cfg := capture.Config{RedirectAll: true, InboundCapture: true}
	if err := (capture.Installer{}).Install(server.NS.Path(), capture.Build(cfg)); err != nil {
		t.Fatal(err)
	}

	t.Run("HBONE after the divert: client's address", func(t *testing.T) {
		for _, dst := range []netip.Addr{server.IP4, server.IP6} {
			check(t, client, dst, family(client, dst), "hbone-late")
		}
		if p, f := source(telemetry.SourcePreserved), source(telemetry.SourceFallback); p != 2 || f != 2 {
			t.Errorf("inbound source preserved %v, fallback %v; want 2, 2", p, f)
		}
		if n := b.logs.count(slog.LevelError, missingRuleLog); n != 1 {
			t.Errorf("%d ERROR records %q after the divert, want still 1", n, missingRuleLog)
		}
	})

	t.Run("plaintext inbound: client's address", func(t *testing.T) {
		for _, dst := range []netip.Addr{server.IP4, server.IP6} {
			check(t, plainA, dst, family(plainA, dst), "plaintext")
		}
		if p, f := source(telemetry.SourcePreserved), source(telemetry.SourceFallback); p != 4 || f != 2 {
			t.Errorf("inbound source preserved %v, fallback %v; want 4, 2", p, f)
		}
	})
}

// TestDeliverMarkValidated: a deliver mark equal to the bypass mark or the
// divert mark is refused at New, naming the values.
func TestDeliverMarkValidated(t *testing.T) {
	for _, cfg := range []dataplane.Config{
		{DeliverMark: dataplane.DefaultBypassMark},
		{BypassMark: 7, DeliverMark: 7},
		{DeliverMark: meshcontract.DivertMark},
	} {
		_, err := dataplane.New(cfg, peers.NewIndex(), nil, nil)
		if err == nil || !strings.Contains(err.Error(), "invalid DeliverMark") || !strings.Contains(err.Error(), "must differ") {
			t.Errorf("New(%+v) = %v, want the deliver mark refused", cfg, err)
		}
	}
	m, err := dataplane.New(dataplane.Config{DeliverMark: 0xae7c}, peers.NewIndex(), nil, nil)
	if err != nil {
		t.Fatalf("New with a distinct deliver mark: %v", err)
	}
	_ = m.Close()
}
