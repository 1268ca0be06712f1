package dataplane

import (
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/proxy/hbone"
	"aether.io/node/xds/listener"
)

// HBONE to declared ports only (Config.HBONEDeclaredPortsOnly,
// -hbone-declared-ports-only): the destination side of HBONE reaches every
// port of the pod, and a NetworkPolicy sees only :15008 (docs/networkpolicy.md),
// so with the switch on a stream whose CONNECT names a port none of the
// pod's containers declares is refused before any connection to the app.

// reasonHBONEPortNotDeclared is the aether_tcp_connections_failed_total
// reason of an HBONE stream refused because the destination pod does not
// declare its port.
const reasonHBONEPortNotDeclared = "hbone_port_not_declared"

// Bounds of the refusal log: at most one line per refusalLogInterval per
// pod, each (pod, port) logged once, and at most maxLoggedPorts ports
// remembered per pod (beyond that only the metric counts).
const (
	refusalLogInterval = time.Second
	maxLoggedPorts     = 64
)

// declaredPorts are the pod's declared TCP ports, as its listeners carry
// them (listener.Spec.DeclaredPortsKnown, DeclaredTCPPorts).
type declaredPorts struct {
	known bool
	tcp   []uint16 // ascending
}

// portGate is the pod's state for HBONEDeclaredPortsOnly.
type portGate struct {
	// ports changes in place when the agent sends new ports (adopt).
	ports atomic.Pointer[declaredPorts]
	// unknownLogged: the pod's ports are unknown and that was logged.
	unknownLogged atomic.Bool
	log           refusalLog
}

// setDeclaredPorts takes the declared ports of the pod's listeners (every
// listener of a pod carries the same).
func (p *pod) setDeclaredPorts(specs []listener.Spec) {
	d := &declaredPorts{}
	if len(specs) > 0 && specs[0].DeclaredPortsKnown {
		d.known = true
		d.tcp = slices.Sorted(slices.Values(specs[0].DeclaredTCPPorts))
	}
	p.gate.ports.Store(d)
}

// refuseUndeclaredPort returns the refusal of an HBONE stream from src to
// target when HBONEDeclaredPortsOnly is on and the pod does not declare
// target's port: 403 (the CONNECT is answered, the stream ends, the app
// never sees a connection), counted reason="hbone_port_not_declared" and
// logged once per pod and port. It returns nil when the switch is off, when
// target is not one of the pod's addresses (deliverInbound answers that
// one), and when the pod's ports are unknown (an agent that predates them:
// delivered as without the switch, logged once per pod).
func (p *pod) refuseUndeclaredPort(src spiffeid.ID, target netip.AddrPort) error {
	if !p.m.cfg.HBONEDeclaredPortsOnly || !slices.Contains(p.ips, target.Addr().Unmap()) {
		return nil
	}
	d := p.gate.ports.Load()
	if d == nil || !d.known {
		if !p.gate.unknownLogged.Swap(true) {
			p.log.Warn("hbone-declared-ports-only: the pod's declared ports are unknown (its record predates them); delivering to every port",
				"target", target.String())
		}
		return nil
	}
	if _, ok := slices.BinarySearch(d.tcp, target.Port()); ok {
		return nil
	}
	p.m.metrics.Failed(reasonHBONEPortNotDeclared)
	if ok, suppressed := p.gate.log.allow(target.Port(), time.Now()); ok {
		p.log.Warn("hbone stream refused: the pod declares no such TCP port (-hbone-declared-ports-only)",
			"target", target.String(), "source_id", src.String(), "declared_ports", d.tcp, "suppressed", suppressed)
	}
	return &hbone.StatusError{Code: http.StatusForbidden, Err: fmt.Errorf("failed to deliver to %s: pod %s/%s declares no TCP port %d",
		target, p.namespace, p.name, target.Port())}
}

// refusalLog rate-limits the refusal lines of one pod.
type refusalLog struct {
	mu         sync.Mutex
	logged     map[uint16]struct{}
	next       time.Time
	suppressed uint64
}

// allow reports whether the refusal of port at now gets a line: the first
// of each port, unless a line went out less than refusalLogInterval ago or
// maxLoggedPorts ports were logged already. suppressed is the number of
// refusals held back since the last line (a port already logged is not
// counted: its refusals are the metric's).
func (r *refusalLog) allow(port uint16, now time.Time) (ok bool, suppressed uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, done := r.logged[port]; done {
		return false, 0
	}
	if now.Before(r.next) || len(r.logged) >= maxLoggedPorts {
		r.suppressed++
		return false, 0
	}
	if r.logged == nil {
		r.logged = map[uint16]struct{}{}
	}
	r.logged[port] = struct{}{}
	r.next = now.Add(refusalLogInterval)
	suppressed, r.suppressed = r.suppressed, 0
	return true, suppressed
}
