package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"aether.io/node/proxy/telemetry"
)

// ErrNotServing is returned by DeliverInbound for a pod the data plane does
// not serve (unknown, or draining).
var ErrNotServing = errors.New("pod not served by this proxy")

// ErrNotThisPod is returned by DeliverInbound for a target that is not one
// of the pod's addresses.
var ErrNotThisPod = errors.New("inbound target is not an address of the pod")

// DeliverInbound connects an inbound connection for target to the app of
// the pod with key (its container id), as the destination side of a tunnel
// (HBONE) does:
//   - when the pod's listeners name a UDS socket (the agent resolved the
//     pod's csi.aether.io volume, seed 000), over that unix socket;
//   - otherwise, or when the socket is missing or refuses (logged at ERROR
//     and counted via="uds_fallback": never a dropped connection), or is
//     not a socket the proxy may trust (a link, another file type, outside
//     the pod's own socket dir, another owner: dialPodSocket; counted
//     via="uds_refused"), over TCP to target from inside the pod's netns
//     with the bypass mark.
//
// target must be one of the pod's addresses.
func (m *Manager) DeliverInbound(ctx context.Context, key string, target netip.AddrPort) (net.Conn, error) {
	m.mu.Lock()
	p := m.pods[key]
	m.mu.Unlock()
	if p == nil || p.draining.Load() {
		return nil, fmt.Errorf("failed to deliver to %s: pod %q: %w", target, key, ErrNotServing)
	}
	return p.deliverInbound(ctx, target, netip.AddrPort{})
}

// deliverInbound is DeliverInbound for a connection from client (zero:
// unknown); over TCP the app sees client's address where the divert allows
// it (deliverTCP).
func (p *pod) deliverInbound(ctx context.Context, target, client netip.AddrPort) (net.Conn, error) {
	target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	if !slices.Contains(p.ips, target.Addr()) {
		return nil, fmt.Errorf("failed to deliver to %s in pod %s/%s (addresses %v): %w", target, p.namespace, p.name, p.ips, ErrNotThisPod)
	}
	via := telemetry.ViaTCP
	if sock := p.specs[0].UDSSocket; sock != "" {
		c, err := dialPodSocket(ctx, p.m.cfg.UDSRoot, p.specs[0].UID, sock)
		if err == nil {
			p.m.metrics.Delivered(telemetry.ViaUDS)
			return c, nil
		}
		if errors.Is(err, ErrUnsafeSocket) {
			via = telemetry.ViaUDSRefused
			p.log.Error("refused the pod's UDS socket as unsafe; delivering over TCP", "socket", sock, "target", target.String(), "error", err.Error())
		} else {
			via = telemetry.ViaUDSFallback
			p.log.Error("inbound delivery over the pod's UDS socket failed; falling back to TCP", "socket", sock, "target", target.String(), "error", err.Error())
		}
	}
	c, err := p.deliverTCP(ctx, target, client)
	if err != nil {
		p.m.metrics.Delivered(telemetry.ViaFailed)
		return nil, fmt.Errorf("failed to deliver to %s in pod %s/%s: %w", target, p.namespace, p.name, err)
	}
	p.m.metrics.Delivered(via)
	return c, nil
}
