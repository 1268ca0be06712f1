package dataplane

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/proxy/telemetry"
)

// Source-IP preservation on inbound delivery: the app sees the client's
// address, as with Istio ambient's ztunnel. The delivery socket is
// transparent (IP_TRANSPARENT / IPV6_TRANSPARENT), bound to the client's
// address and marked with the deliver mark; aether-cni's divert saves the
// mark in the connection's conntrack entry, restores it on the app's replies
// and routes them (ip rule fwmark <deliver mark> lookup <route table>, a
// local default route on lo) back into the proxy's socket instead of out of
// the pod. Without that rule the replies would leave the pod towards the
// real client and the connection would never complete, so the proxy checks
// for it first and otherwise delivers from the pod's own address.
//
// The check is per connection and cheap: a positive answer is cached for the
// pod's life (per family; the divert goes only with the netns), a negative
// one is asked again at the next connection (one RTM_GETROUTE on the thread
// that is in the pod's netns to create the socket anyway). The proxy usually
// binds a pod before aether-cni has installed the divert (the agent serves
// the listeners at AddPod; the divert follows the readiness probe), so a
// decision taken once at bind time would stick at "fallback" forever.

// sourceRuleInstalled reports whether the divert's deliver rule routes the
// replies to client back over lo: a route lookup with the deliver mark must
// give a local route. It must run on a thread inside the pod's netns.
func (p *pod) sourceRuleInstalled(client netip.Addr) bool {
	fam := 0
	if client.Is6() {
		fam = 1
	}
	if p.srcRule[fam].Load() {
		return true
	}
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE) // the calling thread's netns: the pod's
	if err != nil {
		return false
	}
	defer h.Close()
	routes, err := h.RouteGetWithOptions(client.AsSlice(), &netlink.RouteGetOptions{Mark: p.m.cfg.DeliverMark})
	ok := err == nil && len(routes) > 0 && routes[0].Type == unix.RTN_LOCAL
	if ok {
		p.srcRule[fam].Store(true)
	}
	return ok
}

// bindTransparent makes fd transparent and binds it to from's address with
// a port the kernel chooses. If that port is from's own, the four-tuple to
// the app would be the client's connection to the proxy (the plaintext
// inbound path: the accepted socket is local app address, remote from), so
// another port is taken while the first is held.
func bindTransparent(fd int, from netip.AddrPort) error {
	level, opt := unix.SOL_IP, unix.IP_TRANSPARENT
	if from.Addr().Is6() {
		level, opt = unix.SOL_IPV6, unix.IPV6_TRANSPARENT
	}
	if err := unix.SetsockoptInt(fd, level, opt, 1); err != nil {
		return fmt.Errorf("failed to set IP_TRANSPARENT: %w", err)
	}
	var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: from.Addr().As16()}
	if from.Addr().Is4() {
		sa = &unix.SockaddrInet4{Addr: from.Addr().As4()}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return fmt.Errorf("failed to bind to the client address %s: %w", from.Addr(), os.NewSyscallError("bind", err))
	}
	if from.Port() == 0 || boundPort(fd) != from.Port() {
		return nil
	}
	// Hold the colliding port while the kernel picks another for a fresh
	// socket, then move that socket onto fd.
	nfd, err := unix.Socket(map[bool]int{true: unix.AF_INET6, false: unix.AF_INET}[from.Addr().Is6()], unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return os.NewSyscallError("socket", err)
	}
	defer unix.Close(nfd)
	mark, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK)
	if err == nil {
		err = unix.SetsockoptInt(nfd, unix.SOL_SOCKET, unix.SO_MARK, mark)
	}
	if err == nil {
		err = unix.SetsockoptInt(nfd, level, opt, 1)
	}
	if err == nil {
		err = unix.Bind(nfd, sa)
	}
	if err == nil {
		err = unix.Dup3(nfd, fd, unix.O_CLOEXEC)
	}
	if err != nil {
		return fmt.Errorf("failed to bind to the client address %s: %w", from.Addr(), err)
	}
	return nil
}

// boundPort is the local port of fd (0 if unknown).
func boundPort(fd int) uint16 {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return 0
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return uint16(a.Port)
	case *unix.SockaddrInet6:
		return uint16(a.Port)
	}
	return 0
}

// deliverTCP connects an inbound connection from client to the app at
// target, preserving the client's address when it can (see above), else
// from the pod's address. A client of the other family than target, or
// none (DeliverInbound), is delivered from the pod's address. A delivery
// with the client's address that fails before ctx ends (the kernel has no
// free port for that address: EADDRINUSE, or the app refused) is tried
// once more from the pod's address. Counted in
// aether_inbound_source_total{outcome}; a missing deliver rule is logged at
// ERROR once per pod.
func (p *pod) deliverTCP(ctx context.Context, target, client netip.AddrPort) (*net.TCPConn, error) {
	client = netip.AddrPortFrom(client.Addr().Unmap(), client.Port())
	if !client.IsValid() {
		return p.dialTCP(ctx, target)
	}
	var c *net.TCPConn
	preserved, err := false, error(nil)
	if client.Addr().Is4() == target.Addr().Is4() {
		c, preserved, err = p.dialTCPFrom(ctx, target, client)
		if preserved && err != nil && ctx.Err() == nil {
			p.log.Warn("source-preserving delivery failed; delivering from the pod's address", "client", client.Addr().String(), "target", target.String(), "error", err.Error())
			c, preserved, err = nil, false, nil
		}
	}
	if c == nil && err == nil {
		c, err = p.dialTCP(ctx, target)
	}
	if err != nil {
		return nil, err
	}
	if preserved {
		p.m.metrics.InboundSource(telemetry.SourcePreserved)
		return c, nil
	}
	p.m.metrics.InboundSource(telemetry.SourceFallback)
	if client.Addr().Is4() == target.Addr().Is4() && !p.srcLogged.Swap(true) {
		p.log.Error("the capture divert's deliver rule is missing in the pod: inbound connections reach the app from the pod's own address, not the client's (aether-cni older than the proxy, or deliver_mark differs from -deliver-mark); checked again at every connection",
			"deliver_mark", fmt.Sprintf("%#x", p.m.cfg.DeliverMark), "client", client.Addr().String())
	}
	return c, nil
}
