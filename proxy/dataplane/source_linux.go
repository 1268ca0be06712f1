package dataplane

import (
	"context"
	"encoding/binary"
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

// bindAttempts bounds how many kernel-chosen ports bindTransparent tries
// before it gives up (EADDRINUSE: the delivery falls back to the pod's
// address).
const bindAttempts = 8

// bindTransparent makes fd transparent and binds it to from's address with
// a port the kernel chooses, then moves on to another port while the one
// chosen would repeat the four-tuple (from's address and that port, to
// target) of a socket already in the pod: the client's own connection to
// the proxy (from's port, on the plaintext path) or to the app, or another
// of the client's connections the proxy accepted. The kernel checks only
// its own sockets bound the same way, so the lookup (sock_diag) is ours.
// It runs on a thread inside the pod's netns.
func bindTransparent(fd int, from, target netip.AddrPort) error {
	family, level, opt := unix.AF_INET6, unix.SOL_IPV6, unix.IPV6_TRANSPARENT
	var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: from.Addr().As16()}
	if from.Addr().Is4() {
		family, level, opt = unix.AF_INET, unix.SOL_IP, unix.IP_TRANSPARENT
		sa = &unix.SockaddrInet4{Addr: from.Addr().As4()}
	}
	mark, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK)
	if err != nil {
		return fmt.Errorf("failed to read SO_MARK: %w", err)
	}
	var held []int // ports in use elsewhere, held so the kernel picks others
	defer func() {
		for _, h := range held {
			unix.Close(h)
		}
	}()
	cur := fd
	for range bindAttempts {
		if cur != fd {
			if err := unix.SetsockoptInt(cur, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
				return fmt.Errorf("failed to set SO_MARK %#x: %w", mark, err)
			}
		}
		if err := unix.SetsockoptInt(cur, level, opt, 1); err != nil {
			return fmt.Errorf("failed to set IP_TRANSPARENT: %w", err)
		}
		if err := unix.Bind(cur, sa); err != nil {
			return fmt.Errorf("failed to bind to the client address %s: %w", from.Addr(), os.NewSyscallError("bind", err))
		}
		port := boundPort(cur)
		inUse := port == from.Port()
		if !inUse {
			if inUse, err = socketInUse(target, netip.AddrPortFrom(from.Addr(), port)); err != nil {
				return err
			}
		}
		if !inUse {
			if cur != fd {
				err := unix.Dup3(cur, fd, unix.O_CLOEXEC)
				unix.Close(cur)
				if err != nil {
					return fmt.Errorf("failed to move the delivery socket: %w", err)
				}
			}
			return nil
		}
		if cur != fd {
			held = append(held, cur)
		}
		if cur, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
			return os.NewSyscallError("socket", err)
		}
		if cur == fd {
			return fmt.Errorf("failed to create a delivery socket: reused fd %d", fd)
		}
	}
	held = append(held, cur)
	return fmt.Errorf("failed to bind to the client address %s: %d ports in a row repeat a connection in the pod: %w", from.Addr(), bindAttempts, unix.EADDRINUSE)
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

// socketInUse reports whether the calling thread's netns holds a TCP socket,
// other than a listener, whose local address is local and remote address
// remote: a packet from remote to local would be delivered to it. One
// sock_diag request without NLM_F_DUMP (the kernel's exact socket lookup:
// established and time-wait sockets, then listeners).
func socketInUse(local, remote netip.AddrPort) (bool, error) {
	const (
		nlmsgLen     = unix.SizeofNlMsghdr
		reqLen       = 56 // struct inet_diag_req_v2
		tcpListen    = 10 // TCP_LISTEN
		diagNoCookie = 0xffffffff
	)
	s, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return false, fmt.Errorf("failed to open sock_diag: %w", os.NewSyscallError("socket", err))
	}
	defer unix.Close(s)
	b := make([]byte, nlmsgLen+reqLen)
	ne := binary.NativeEndian
	ne.PutUint32(b[0:], uint32(len(b)))
	ne.PutUint16(b[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(b[6:], unix.NLM_F_REQUEST)
	r := b[nlmsgLen:]
	r[0] = unix.AF_INET
	if local.Addr().Is6() {
		r[0] = unix.AF_INET6
	}
	r[1] = unix.IPPROTO_TCP
	ne.PutUint32(r[4:], 0xffffffff) // every state
	binary.BigEndian.PutUint16(r[8:], local.Port())
	binary.BigEndian.PutUint16(r[10:], remote.Port())
	copy(r[12:28], local.Addr().AsSlice())
	copy(r[28:44], remote.Addr().AsSlice())
	ne.PutUint32(r[48:], diagNoCookie)
	ne.PutUint32(r[52:], diagNoCookie)
	if err := unix.Sendto(s, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, fmt.Errorf("failed to query sock_diag: %w", os.NewSyscallError("sendto", err))
	}
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(s, buf, 0)
	if err != nil {
		return false, fmt.Errorf("failed to read sock_diag: %w", os.NewSyscallError("recvfrom", err))
	}
	if n < nlmsgLen+4 {
		return false, fmt.Errorf("failed to read sock_diag: short answer (%d bytes)", n)
	}
	switch ne.Uint16(buf[4:]) {
	case unix.NLMSG_ERROR:
		errno := -int32(ne.Uint32(buf[nlmsgLen:]))
		if errno == 0 || unix.Errno(errno) == unix.ENOENT {
			return false, nil
		}
		return false, fmt.Errorf("failed to look up socket %s -> %s: %w", local, remote, unix.Errno(errno))
	case unix.SOCK_DIAG_BY_FAMILY:
		return buf[nlmsgLen+1] != tcpListen, nil // inet_diag_msg.idiag_state
	}
	return false, fmt.Errorf("failed to read sock_diag: message type %d", ne.Uint16(buf[4:]))
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
	preserved, noRule, err := false, false, error(nil)
	if client.Addr().Is4() == target.Addr().Is4() {
		c, preserved, err = p.dialTCPFrom(ctx, target, client)
		noRule = !preserved
		if preserved && err != nil && ctx.Err() == nil {
			p.log.Debug("source-preserving delivery failed; delivering from the pod's address", "client", client.Addr().String(), "target", target.String(), "error", err.Error())
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
	if noRule && !p.srcLogged.Swap(true) {
		p.log.Error("the capture divert's deliver rule is missing in the pod: inbound connections reach the app from the pod's own address, not the client's (aether-cni has not installed the divert yet, is older than the proxy, or its deliver_mark differs from -deliver-mark); checked again at every connection",
			"deliver_mark", fmt.Sprintf("%#x", p.m.cfg.DeliverMark), "client", client.Addr().String())
	}
	return c, nil
}
