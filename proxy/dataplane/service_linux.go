package dataplane

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
)

// ServiceChooser balances connections to Service VIPs (peers.Services).
type ServiceChooser interface {
	// Choose picks an endpoint for a connection from src to dst, never
	// exclude unless it is the only one.
	Choose(src netip.Addr, dst, exclude netip.AddrPort) (peers.Endpoint, peers.ServiceRef, peers.Verdict)
	// ServiceOf returns the Service the workload at dst's address serves
	// dst's port for (the destination side's destination_service).
	ServiceOf(dst netip.AddrPort) (peers.ServiceRef, bool)
}

// Outbound paths of a connection to a Service VIP
// (aether_outbound_connections_total{path}).
const (
	// pathServiceHBONE: tunnelled to the chosen mesh endpoint.
	pathServiceHBONE = "service_hbone"
	// pathServicePlain: plain TCP to the chosen endpoint (not in the mesh,
	// or the client pod has no identity yet).
	pathServicePlain = "service_plaintext"
	// pathServiceNoEndpoint: the Service had no usable endpoint: reset.
	pathServiceNoEndpoint = "service_no_endpoint"
	// pathServiceFailed: the chosen endpoint, and the one retried after
	// it, could not be reached: reset.
	pathServiceFailed = "service_failed"
)

// balanceTCP sends a captured connection whose original destination is a
// Service VIP and port to an endpoint the Service table chooses: HBONE to a
// mesh endpoint (its SPIFFE ID verified), plain TCP with the bypass mark to
// another. A dial that fails is retried once on another endpoint before the
// client is reset; a Service without endpoints is reset at once. It reports
// false when dst is no Service VIP (or the Service asks for passthrough):
// the caller connects to dst as dialled.
func (p *pod) balanceTCP(down *net.TCPConn, src, dst netip.AddrPort) bool {
	if p.m.cfg.Services == nil {
		return false
	}
	e, ref, v := p.m.cfg.Services.Choose(src.Addr(), dst, netip.AddrPort{})
	switch v {
	case peers.Chosen:
	case peers.NoEndpoint:
		p.m.metrics.Outbound(pathServiceNoEndpoint)
		info := p.sourceInfo(src, dst, peers.Peer{})
		info.Service = ref
		p.m.metrics.Refused(info, telemetry.ReasonNoEndpoint, fmt.Errorf("service %s/%s has no usable endpoint", ref.Namespace, ref.Name))
		p.log.Debug("service has no usable endpoint; resetting the connection", "src", src.String(), "dst", dst.String(),
			"service", ref.Namespace+"/"+ref.Name)
		reset(down)
		return true
	default:
		return false
	}
	up, err := p.dialEndpoint(e)
	if err != nil {
		p.log.Debug("service endpoint connect failed; trying another", "src", src.String(), "dst", dst.String(),
			"service", ref.Namespace+"/"+ref.Name, "endpoint", e.Addr.String(), "error", err.Error())
		if again, _, v := p.m.cfg.Services.Choose(src.Addr(), dst, e.Addr); v == peers.Chosen && again.Addr != e.Addr {
			e = again
			up, err = p.dialEndpoint(e)
		}
	}
	info := p.sourceInfo(src, e.Addr, p.lookup(e.Addr.Addr()))
	info.Service, info.Path = ref, telemetry.PathPlaintext
	if e.HBONE && p.m.tunnel != nil && p.hb != nil {
		info.MTLS, info.Path, info.SourcePrincipal = true, telemetry.PathHBONE, p.hb.id.String()
	}
	if err != nil {
		p.m.metrics.Outbound(pathServiceFailed)
		p.m.metrics.Failed(failedServiceDial)
		p.m.metrics.Refused(info, telemetry.ReasonConnectFailed, err)
		p.log.Debug("service endpoint connect failed", "src", src.String(), "dst", dst.String(),
			"service", ref.Namespace+"/"+ref.Name, "endpoint", e.Addr.String(), "error", err.Error())
		reset(down)
		return true
	}
	switch up := up.(type) {
	case *hbone.Stream:
		p.m.metrics.Outbound(pathServiceHBONE)
		p.pipeStream(down, up, info)
	case *net.TCPConn:
		p.m.metrics.Outbound(pathServicePlain)
		p.pipeTCP(down, up, info)
	}
	return true
}

// failedServiceDial is aether_connections_failed_total{reason} for a
// Service connection no endpoint accepted.
const failedServiceDial = "service_connect"

// dialEndpoint connects to a chosen Service endpoint: an HBONE stream when
// the endpoint is in the mesh and this pod has an identity, plain TCP
// otherwise. The result is a *hbone.Stream or a *net.TCPConn.
func (p *pod) dialEndpoint(e peers.Endpoint) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.WithValue(p.ctx, podCtxKey{}, p), p.m.cfg.ConnectTimeout)
	defer cancel()
	if !e.HBONE || p.m.tunnel == nil || p.hb == nil {
		return p.dialTCP(ctx, e.Addr)
	}
	var expected spiffeid.ID
	if e.Identity != "" {
		id, err := spiffeid.FromString(e.Identity)
		if err != nil {
			return nil, err
		}
		expected = id
	}
	return p.m.tunnel.Dial(ctx, hbone.Request{
		Source: p.hb.id, Proxy: netip.AddrPortFrom(e.Addr.Addr(), p.m.cfg.HBONEPort), Target: e.Addr,
		Expected: expected, Origin: p.hb.origin,
	})
}
