package preflight

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/mdlayher/packet"
	"golang.org/x/sys/unix"

	"aether.io/node/pkg/sockcloser"
)

var broadcast = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Spec is one pre-flight: from IP/MAC on Link to Gateway.
type Spec struct {
	// Link is the pod's new interface (in the current netns).
	Link *net.Interface
	// MAC is the link's real MAC (sender hardware address).
	MAC net.HardwareAddr
	// IP is the allocated address (sender protocol address).
	IP netip.Addr
	// Gateway is the address that must answer.
	Gateway netip.Addr
	// Attempts is the number of requests sent before giving up.
	Attempts int
	// Timeout is how long each request waits for a matching reply.
	Timeout time.Duration
}

// Result describes a successful pre-flight.
type Result struct {
	// Attempts is the number of requests sent.
	Attempts int
	// RTT is the time from the last request to the matching reply.
	RTT time.Duration
	// GatewayMAC is the gateway's hardware address (ARP only).
	GatewayMAC net.HardwareAddr
}

// NoReplyError means the gateway did not answer any attempt.
type NoReplyError struct {
	// Spec is the probe that failed.
	Spec Spec
	// Family is "arp" or "ndp".
	Family string
}

func (e *NoReplyError) Error() string {
	return fmt.Sprintf("no %s reply from gateway %s to %s (MAC %s) on %q after %d attempt(s) of %s",
		e.Family, e.Spec.Gateway, e.Spec.IP, e.Spec.MAC, e.Spec.Link.Name, e.Spec.Attempts, e.Spec.Timeout)
}

// Conn holds the packet sockets of one link: ARP (IPv4) and IPv6, opened
// on demand. A probe and the announcement after it share them. Closing an
// AF_PACKET socket waits for an RCU grace period in the kernel
// (synchronize_net in packet_release, unconditional; measured 8-16 ms on
// the CI machines, up to ~50 ms under load), so each socket is opened once
// per ADD, and Close hands them to a closer (sockcloser.Taker: another
// process pays the wait) or, without one, closes them in parallel.
type Conn struct {
	link   *net.Interface
	closer sockcloser.Taker
	arp    *packet.Conn
	ip6    *packet.Conn
}

// Open prepares a Conn on link. It must be called with the thread inside the
// link's netns: sockets are created on first use, by Probe or Announce, so
// call those from inside the netns too (reads afterwards are poller-driven).
func Open(link *net.Interface) *Conn { return &Conn{link: link} }

// OpenWithCloser is Open with Close handing the sockets to cl.
func OpenWithCloser(link *net.Interface, cl sockcloser.Taker) *Conn {
	return &Conn{link: link, closer: cl}
}

func (c *Conn) sock(v4 bool) (*packet.Conn, error) {
	p, proto, name := &c.arp, unix.ETH_P_ARP, "arp"
	if !v4 {
		p, proto, name = &c.ip6, unix.ETH_P_IPV6, "ipv6"
	}
	if *p != nil {
		return *p, nil
	}
	pc, err := packet.Listen(c.link, packet.Datagram, proto, nil)
	if err != nil {
		return nil, fmt.Errorf("failed to open %s packet socket on %q: %w", name, c.link.Name, err)
	}
	*p = pc
	return pc, nil
}

// Close releases the sockets: with a closer, by handing them to it; without
// one, or when the hand-off fails, by closing them here, in parallel.
func (c *Conn) Close() error {
	var herr error
	if c.closer != nil {
		if herr = c.handOff(c.closer); herr == nil {
			return nil
		}
		herr = fmt.Errorf("failed to hand packet sockets to a closer (closing them here): %w", herr)
	}
	return errors.Join(herr, c.closeParallel())
}

// closeParallel closes the sockets here, in parallel.
func (c *Conn) closeParallel() error {
	var errs [2]error
	done := make(chan struct{})
	go func() {
		if c.ip6 != nil {
			errs[1] = c.ip6.Close()
		}
		close(done)
	}()
	if c.arp != nil {
		errs[0] = c.arp.Close()
	}
	<-done
	c.arp, c.ip6 = nil, nil
	return errors.Join(errs[:]...)
}

// Probe opens a Conn on s.Link, runs one pre-flight and closes it.
func Probe(ctx context.Context, s Spec) (Result, error) {
	c := Open(s.Link)
	r, err := c.Probe(ctx, s)
	return r, errors.Join(err, c.Close())
}

// Probe runs the ARP (IPv4 gateway) or NDP (IPv6 gateway) pre-flight:
// s.Attempts requests, each waiting s.Timeout for a matching reply.
func (c *Conn) Probe(ctx context.Context, s Spec) (Result, error) {
	if s.Attempts < 1 {
		s.Attempts = 1
	}
	if s.Gateway.Is4() != s.IP.Is4() {
		return Result{}, fmt.Errorf("failed to probe gateway %s from %s: address families differ", s.Gateway, s.IP)
	}
	family := "arp"
	if !s.IP.Is4() {
		family = "ndp"
	}
	pc, err := c.sock(s.IP.Is4())
	if err != nil {
		return Result{}, err
	}
	var req []byte
	var dstMAC net.HardwareAddr
	if family == "arp" {
		req, err = ARPRequest(s.IP, s.Gateway, s.MAC)
		dstMAC = broadcast
	} else {
		req, dstMAC, err = NeighborSolicitation(s.IP, s.Gateway, s.MAC)
	}
	if err != nil {
		return Result{}, fmt.Errorf("failed to build %s request for %s: %w", family, s.Gateway, err)
	}
	defer func() { _ = pc.SetReadDeadline(time.Time{}) }()
	buf := make([]byte, 1500)
	for attempt := 1; attempt <= s.Attempts; attempt++ {
		sent := time.Now()
		if _, err := pc.WriteTo(req, &packet.Addr{HardwareAddr: dstMAC}); err != nil {
			return Result{}, fmt.Errorf("failed to send %s request on %q: %w", family, s.Link.Name, err)
		}
		deadline := sent.Add(s.Timeout)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		if err := pc.SetReadDeadline(deadline); err != nil {
			return Result{}, fmt.Errorf("failed to set read deadline on %q: %w", s.Link.Name, err)
		}
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				if errors.Is(err, os.ErrDeadlineExceeded) {
					break // this attempt timed out
				}
				if errors.Is(err, unix.EINTR) {
					continue // never a timeout
				}
				return Result{}, fmt.Errorf("failed to read %s reply on %q: %w", family, s.Link.Name, err)
			}
			ok := false
			if family == "arp" {
				ok = MatchARPReply(buf[:n], s.Gateway, s.IP, s.MAC)
			} else {
				ok = MatchNA(buf[:n], s.Gateway, s.IP)
			}
			if ok {
				r := Result{Attempts: attempt, RTT: time.Since(sent)}
				if pa, isPA := from.(*packet.Addr); isPA {
					r.GatewayMAC = pa.HardwareAddr
				}
				return r, nil
			}
		}
		if ctx.Err() != nil {
			return Result{}, fmt.Errorf("failed to probe gateway %s: %w (after %d attempt(s))", s.Gateway, ctx.Err(), attempt)
		}
	}
	return Result{}, &NoReplyError{Spec: s, Family: family}
}

// Announce sends a gratuitous ARP for an IPv4 address or an unsolicited
// Neighbor Advertisement for an IPv6 address from mac, so neighbours and
// the fabric learn the (possibly recreated) pod's MAC at once.
func (c *Conn) Announce(mac net.HardwareAddr, ip netip.Addr) error {
	pc, err := c.sock(ip.Is4())
	if err != nil {
		return err
	}
	var b []byte
	dst := broadcast
	if ip.Is4() {
		b, err = ARPRequest(ip, ip, mac)
	} else {
		b, dst, err = UnsolicitedNA(ip, mac)
	}
	if err != nil {
		return fmt.Errorf("failed to build announcement for %s: %w", ip, err)
	}
	if _, err := pc.WriteTo(b, &packet.Addr{HardwareAddr: dst}); err != nil {
		return fmt.Errorf("failed to announce %s on %q: %w", ip, c.link.Name, err)
	}
	return nil
}
