package dataplane_test

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/proxytest"
)

// TestHBONEDeclaredPortsOnly: over real HBONE between two pods, with
// -hbone-declared-ports-only on, a stream to a port the destination pod
// does not declare is refused (the client is reset, the app on that port
// never sees a connection, counted reason="hbone_port_not_declared") while
// a declared port is delivered; a pod declaring no ports at all gets
// nothing; a pod whose ports are unknown (an agent that predates them) and
// every pod with the switch off get every port.
func TestHBONEDeclaredPortsOnly(t *testing.T) {
	const declared, undeclared = 8080, 9090
	for _, tc := range []struct {
		name   string
		on     bool
		known  bool
		ports  []uint16
		refuse bool // undeclared is refused (declared is then delivered unless ports is empty)
	}{
		{name: "on, refuses the undeclared port", on: true, known: true, ports: []uint16{declared}, refuse: true},
		{name: "on, pod declares none", on: true, known: true, refuse: true},
		{name: "on, ports unknown", on: true},
		{name: "off", known: true, ports: []uint16{declared}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := setupHBONEConfig(t, dataplane.Config{ConnectTimeout: 3 * time.Second, HBONEDeclaredPortsOnly: tc.on})
			apps := map[uint16]*atomic.Int64{declared: {}, undeclared: {}}
			for port, n := range apps {
				e.server.Handle(t, port, func(c net.Conn) {
					n.Add(1)
					_, _ = io.ReadAll(c)
					_, _ = fmt.Fprintf(c, "app %d", port)
				})
			}
			specs := e.server.Specs(t)
			for i := range specs {
				specs[i].DeclaredPortsKnown, specs[i].DeclaredTCPPorts = tc.known, tc.ports
			}
			e.mgr.SetListeners(append(e.client.Specs(t), specs...))
			// The ports apply in place (no rebind): wait for the serving
			// pod to carry them.
			if err := proxytest.WaitFor(ctx10(t), func() bool {
				for _, s := range e.mgr.Status() {
					if s.Name == e.server.Name && s.State == dataplane.StateServing &&
						s.DeclaredPortsKnown == tc.known && slices.Equal(s.DeclaredTCPPorts, tc.ports) {
						return true
					}
				}
				return false
			}); err != nil {
				t.Fatalf("the server pod never took the declared ports: %+v", e.mgr.Status())
			}

			for _, ip := range []netip.Addr{e.server.IP4, e.server.IP6} {
				for _, port := range []uint16{declared, undeclared} {
					dst := netip.AddrPortFrom(ip, port)
					reply, err := roundTrip(ctx10(t), e.client, dst, "x")
					refused := tc.refuse && (port == undeclared || len(tc.ports) == 0)
					switch {
					case refused && !isReset(err):
						t.Errorf("%s: %q, %v; want a reset (refused)", dst, reply, err)
					case !refused && (err != nil || reply != fmt.Sprintf("app %d", port)):
						t.Errorf("%s: %q, %v; want the app's answer", dst, reply, err)
					}
				}
			}
			wantRefused := 0
			wantApp := map[uint16]int64{declared: 2, undeclared: 2}
			if tc.refuse {
				wantRefused, wantApp[undeclared] = 2, 0
				if len(tc.ports) == 0 {
					wantRefused, wantApp[declared] = 4, 0
				}
			}
			// A delivered connection reaches the app before its answer
			// comes back; a refused one is answered before any dial.
			for port, want := range wantApp {
				if got := apps[port].Load(); got != want {
					t.Errorf("app on :%d saw %d connections, want %d", port, got, want)
				}
			}
			if got := sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "hbone_port_not_declared"}); got != float64(wantRefused) {
				t.Errorf("failed reason=hbone_port_not_declared = %v, want %d", got, wantRefused)
			}
			if got := sum(e.metrics, "aether_outbound_connections_total", map[string]string{"path": "hbone"}); got != float64(4-wantRefused) {
				t.Errorf("outbound path=hbone = %v, want %d (a refused stream is hbone_failed)", got, 4-wantRefused)
			}
		})
	}
}
