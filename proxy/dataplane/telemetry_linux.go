package dataplane

import (
	"net/netip"

	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
)

// Telemetry of a connection (proxy/telemetry): each side of the data plane
// reports what it sees, as ztunnel does. The capturing pod's side is the
// source reporter (its client, the original destination, the Service it
// balanced through); the destination pod's side (an HBONE stream delivered to
// the app, plaintext on the inbound listener) is the destination reporter,
// with the Service its workload serves that port for.

// ender is a tracked connection that records why it is aborted, so its
// telemetry names the cause (idle timeout, drain deadline, pod closed)
// rather than the reset it causes.
type ender interface{ endWith(r telemetry.CloseReason) }

// abortFor records r on c (when it records reasons) and aborts it.
func abortFor(c closer, r telemetry.CloseReason) {
	if e, ok := c.(ender); ok {
		e.endWith(r)
	}
	c.abort()
}

// sourceInfo describes a captured connection from src to dst (the original
// destination, or the endpoint a Service chose) whose destination workload is
// dstPeer: plain TCP until the caller says otherwise; to a workload WDS knows
// it is plaintext, to anything else passthrough.
func (p *pod) sourceInfo(src, dst netip.AddrPort, dstPeer peers.Peer) telemetry.ConnInfo {
	path := telemetry.PathPassthrough
	if dstPeer.UID != "" {
		path = telemetry.PathPlaintext
	}
	return telemetry.ConnInfo{
		Reporter: telemetry.ReporterSource, Src: src, Dst: dst,
		Source: p.lookup(src.Addr()), Destination: dstPeer, Path: path,
	}
}

// destinationInfo describes a connection from src (zero: unknown) to dst,
// one of the pod's addresses and an app port, on the pod's inbound side:
// plaintext until the caller says otherwise, with the Service the pod's
// workload serves dst's port for (peers.Services.ServiceOf), as ztunnel
// guesses it for its inbound metrics.
func (p *pod) destinationInfo(src, dst netip.AddrPort) telemetry.ConnInfo {
	i := telemetry.ConnInfo{
		Reporter: telemetry.ReporterDestination, Src: src, Dst: dst,
		Destination: p.lookup(dst.Addr()), Path: telemetry.PathPlaintext,
	}
	if src.IsValid() {
		i.Source = p.lookup(src.Addr())
	}
	if p.m.cfg.Services != nil {
		if ref, ok := p.m.cfg.Services.ServiceOf(dst); ok {
			i.Service = ref
		}
	}
	return i
}

// closeErr is the error a connection's telemetry reports: the copy's error
// when it ended in a reset of its own, none when it ended cleanly or was
// aborted for a reason of the proxy's (whose error is the abort's echo).
func closeErr(r telemetry.CloseReason, err error) error {
	if r == telemetry.ReasonReset {
		return err
	}
	return nil
}
