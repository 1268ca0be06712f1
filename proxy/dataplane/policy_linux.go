package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"slices"

	"aether.io/node/pkg/authz"

	"aether.io/node/pkg/meshcontract"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/xds/listener"
)

// Reasons of aether_tcp_connections_failed_total for the inbound listener.
const (
	// reasonInboundPolicyDenied: a plaintext connection to a pod whose
	// inbound policy is strict (only HBONE is accepted).
	reasonInboundPolicyDenied = "inbound_policy_denied"
	// reasonInboundNotPod: the original destination is not one of the
	// pod's addresses, or is one of the proxy's own listener ports.
	reasonInboundNotPod = "inbound_not_pod"
	// reasonInboundDeliver: the app could not be reached.
	reasonInboundDeliver = "inbound_deliver"
)

// setPolicy takes the inbound policy of the pod's listeners (every listener
// of a pod carries the same; listener.Parse makes an unknown value strict).
func (p *pod) setPolicy(specs []listener.Spec) {
	strict := false
	for _, s := range specs {
		strict = strict || s.InboundPolicy == meshcontract.InboundPolicyStrict
	}
	p.strict.Store(strict)
}

// adopt reports whether want are the pod's listeners, the inbound policy
// and the declared ports aside; if so the pod takes want's policy and
// ports at once, so an annotation change (or ports filled in for a record
// that predates them) applies from the next connection without rebinding
// (which would drain the pod and, under the inbound redirect, drop new
// connections meanwhile).
func (p *pod) adopt(want []listener.Spec) bool {
	if len(want) != len(p.specs) {
		return false
	}
	for i := range want {
		w := want[i]
		w.InboundPolicy = p.specs[i].InboundPolicy
		w.DeclaredPortsKnown, w.DeclaredTCPPorts = p.specs[i].DeclaredPortsKnown, p.specs[i].DeclaredTCPPorts
		if !reflect.DeepEqual(w, p.specs[i]) {
			return false
		}
	}
	p.setPolicy(want)
	p.setDeclaredPorts(want)
	return true
}

// serveInbound handles one plaintext connection on the inbound listener.
// aether-cni's inbound redirect TPROXYs it here, so its local address is the
// original destination: one of the pod's addresses and the app's port. A
// strict pod resets it (counted reason="inbound_policy_denied"); a
// permissive pod delivers it to the app as HBONE's destination side does
// (DeliverInbound: the pod's UDS socket, else TCP with the bypass mark) and
// copies both ways. A destination that is not the pod's, or one of the
// proxy's own ports (a direct connection to :18008), is reset.
func (p *pod) serveInbound(down *net.TCPConn, l *tcpListener) {
	dst := addrPort(down.LocalAddr())
	src := addrPort(down.RemoteAddr())
	if !slices.Contains(p.ips, dst.Addr()) || slices.ContainsFunc(p.tcp, func(o *tcpListener) bool { return o.port == dst.Port() }) {
		p.m.metrics.Failed(reasonInboundNotPod)
		p.m.metrics.Misdirected(p.destinationInfo(src, dst), errInboundNotPod)
		p.log.Debug("inbound connection not for the pod's app", "src", src, "dst", dst, "listener", l.spec.Name)
		reset(down)
		return
	}
	info := p.destinationInfo(src, dst)
	if p.strict.Load() {
		p.m.metrics.Failed(reasonInboundPolicyDenied)
		info.Policy = telemetry.PolicyInboundStrict
		p.m.metrics.Refused(info, telemetry.ReasonDenied, errInboundStrict)
		p.log.Debug("plaintext inbound connection refused: inbound policy strict", "src", src, "dst", dst)
		reset(down)
		return
	}
	if !p.authorize(src, "", dst, &info) { // plaintext: no identity
		reset(down)
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.m.cfg.ConnectTimeout)
	up, err := p.deliverInbound(ctx, dst, src)
	cancel()
	if err != nil {
		p.m.metrics.Failed(reasonInboundDeliver)
		p.m.metrics.Refused(info, telemetry.ReasonConnectFailed, err)
		p.log.Debug("inbound delivery failed", "src", src, "dst", dst, "error", err)
		reset(down)
		return
	}
	us, ok := up.(upstream) // *net.TCPConn or *net.UnixConn
	if !ok {
		_ = up.Close()
		p.m.metrics.Failed(reasonInboundDeliver)
		p.m.metrics.Refused(info, telemetry.ReasonConnectFailed, fmt.Errorf("failed to deliver to %s: %T has no half-close", dst, up))
		reset(down)
		return
	}
	if _, ok := us.(*net.UnixConn); ok {
		info.Path = telemetry.PathUDS
	}
	pair := &tcpPair{down: down, up: us, az: &authz.Conn{Source: src.Addr().Unmap(), Dest: dst}, tc: p.m.metrics.Open(info)}
	if !p.track(pair) {
		pair.abort()
		pair.tc.Close(telemetry.ReasonPodClosed, nil)
		return
	}
	defer p.untrack(pair)
	pair.tc.Close(pipe(&p.m.pipes, pair, pair.tc))
}

// Errors the access log gives refused inbound connections.
var (
	errInboundNotPod = errors.New("inbound destination is not the pod's app (not its address, or one of the proxy's own ports): reset")
	errInboundStrict = errors.New("plaintext refused: the pod's inbound policy is strict (only HBONE is accepted)")
)
