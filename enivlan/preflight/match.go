// Package preflight is eni-vlan's pre-flight validation of a cloud binding: an
// ARP request (IPv4) or a Neighbor Solicitation (IPv6) sent from inside the
// pod netns, on the new link, with sender IP = the allocated IP and sender
// MAC = the link's real MAC, to the gateway, before any IP is configured.
// Only a reply from the gateway IP addressed to our IP (and, for ARP, our
// MAC) counts. Reads use deadlines on a poller-backed packet socket, so an
// interrupted syscall never ends an attempt early. After the IPs are
// configured, Announce sends a gratuitous ARP and an unsolicited NA.
package preflight

import (
	"bytes"
	"encoding/binary"
	"net"
	"net/netip"

	"github.com/mdlayher/arp"
	"github.com/mdlayher/ndp"
)

// MatchARPReply reports whether b (an ARP payload, without Ethernet header)
// is a reply from gw to ourIP/ourMAC. A gratuitous reply from the gateway
// (target IP = gateway) or a reply to someone else does not count.
func MatchARPReply(b []byte, gw, ourIP netip.Addr, ourMAC net.HardwareAddr) bool {
	var p arp.Packet
	if err := p.UnmarshalBinary(b); err != nil {
		return false
	}
	return p.Operation == arp.OperationReply &&
		p.SenderIP == gw &&
		p.TargetIP == ourIP &&
		bytes.Equal(p.TargetHardwareAddr, ourMAC)
}

const (
	ipv6HeaderLen = 40
	protoICMPv6   = 58
)

// MatchNA reports whether b (an IPv6 packet, without Ethernet header) is a
// solicited Neighbor Advertisement for gw sent to ourIP.
func MatchNA(b []byte, gw, ourIP netip.Addr) bool {
	if len(b) < ipv6HeaderLen+24 || b[0]>>4 != 6 || b[6] != protoICMPv6 {
		return false
	}
	plen := int(binary.BigEndian.Uint16(b[4:6]))
	if plen > len(b)-ipv6HeaderLen {
		return false
	}
	dst := netip.AddrFrom16([16]byte(b[24:40]))
	if dst != ourIP {
		return false
	}
	m, err := ndp.ParseMessage(b[ipv6HeaderLen : ipv6HeaderLen+plen])
	if err != nil {
		return false
	}
	na, ok := m.(*ndp.NeighborAdvertisement)
	return ok && na.Solicited && na.TargetAddress == gw
}

// buildIPv6 wraps an ICMPv6 message in an IPv6 header (hop limit 255, as
// NDP requires).
func buildIPv6(src, dst netip.Addr, icmp []byte) []byte {
	b := make([]byte, ipv6HeaderLen+len(icmp))
	b[0] = 6 << 4
	binary.BigEndian.PutUint16(b[4:6], uint16(len(icmp)))
	b[6] = protoICMPv6
	b[7] = 255
	s, d := src.As16(), dst.As16()
	copy(b[8:24], s[:])
	copy(b[24:40], d[:])
	copy(b[40:], icmp)
	return b
}

// multicastMAC is the Ethernet address of an IPv6 multicast group.
func multicastMAC(group netip.Addr) net.HardwareAddr {
	a := group.As16()
	return net.HardwareAddr{0x33, 0x33, a[12], a[13], a[14], a[15]}
}

// NeighborSolicitation returns the IPv6 packet of a solicitation for gw from
// src/mac, addressed to gw's solicited-node group, and that group's MAC.
func NeighborSolicitation(src, gw netip.Addr, mac net.HardwareAddr) ([]byte, net.HardwareAddr, error) {
	dst, err := ndp.SolicitedNodeMulticast(gw)
	if err != nil {
		return nil, nil, err
	}
	m := &ndp.NeighborSolicitation{
		TargetAddress: gw,
		Options:       []ndp.Option{&ndp.LinkLayerAddress{Direction: ndp.Source, Addr: mac}},
	}
	icmp, err := ndp.MarshalMessageChecksum(m, src, dst)
	if err != nil {
		return nil, nil, err
	}
	return buildIPv6(src, dst, icmp), multicastMAC(dst), nil
}

// UnsolicitedNA returns the IPv6 packet announcing ip at mac to all nodes
// (override set), and the all-nodes MAC.
func UnsolicitedNA(ip netip.Addr, mac net.HardwareAddr) ([]byte, net.HardwareAddr, error) {
	dst := netip.MustParseAddr("ff02::1")
	m := &ndp.NeighborAdvertisement{
		Override:      true,
		TargetAddress: ip,
		Options:       []ndp.Option{&ndp.LinkLayerAddress{Direction: ndp.Target, Addr: mac}},
	}
	icmp, err := ndp.MarshalMessageChecksum(m, ip, dst)
	if err != nil {
		return nil, nil, err
	}
	return buildIPv6(ip, dst, icmp), multicastMAC(dst), nil
}

// ARPRequest returns the ARP payload asking for target from senderIP/mac.
// A gratuitous ARP is ARPRequest(ip, ip, mac).
func ARPRequest(senderIP, target netip.Addr, mac net.HardwareAddr) ([]byte, error) {
	p, err := arp.NewPacket(arp.OperationRequest, mac, senderIP, net.HardwareAddr{0, 0, 0, 0, 0, 0}, target)
	if err != nil {
		return nil, err
	}
	return p.MarshalBinary()
}
