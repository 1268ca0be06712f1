package preflight

import (
	"net"
	"net/netip"
	"testing"

	"github.com/mdlayher/arp"
	"github.com/mdlayher/ndp"
)

var (
	ourMAC   = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x10}
	gwMAC    = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x01}
	otherMAC = net.HardwareAddr{0x02, 0, 0, 0, 0, 0x99}
	ourIP    = netip.MustParseAddr("10.77.0.10")
	gwIP     = netip.MustParseAddr("10.77.0.1")
	our6     = netip.MustParseAddr("fd77::10")
	gw6      = netip.MustParseAddr("fd77::1")
)

func arpBytes(t testing.TB, op arp.Operation, sha net.HardwareAddr, spa netip.Addr, tha net.HardwareAddr, tpa netip.Addr) []byte {
	p, err := arp.NewPacket(op, sha, spa, tha, tpa)
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func naBytes(t testing.TB, src, dst, target netip.Addr, solicited bool) []byte {
	m := &ndp.NeighborAdvertisement{
		Solicited: solicited, Override: true, TargetAddress: target,
		Options: []ndp.Option{&ndp.LinkLayerAddress{Direction: ndp.Target, Addr: gwMAC}},
	}
	icmp, err := ndp.MarshalMessageChecksum(m, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	return buildIPv6(src, dst, icmp)
}

func TestMatchARPReply(t *testing.T) {
	tests := []struct {
		name string
		b    []byte
		want bool
	}{
		{"reply from gateway to us", arpBytes(t, arp.OperationReply, gwMAC, gwIP, ourMAC, ourIP), true},
		{"request not reply", arpBytes(t, arp.OperationRequest, gwMAC, gwIP, ourMAC, ourIP), false},
		{"gratuitous reply from gateway", arpBytes(t, arp.OperationReply, gwMAC, gwIP, net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, gwIP), false},
		{"reply from someone else", arpBytes(t, arp.OperationReply, gwMAC, netip.MustParseAddr("10.77.0.2"), ourMAC, ourIP), false},
		{"reply to another IP", arpBytes(t, arp.OperationReply, gwMAC, gwIP, ourMAC, netip.MustParseAddr("10.77.0.11")), false},
		{"reply to another MAC", arpBytes(t, arp.OperationReply, gwMAC, gwIP, otherMAC, ourIP), false},
		{"truncated", arpBytes(t, arp.OperationReply, gwMAC, gwIP, ourMAC, ourIP)[:20], false},
		{"empty", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := MatchARPReply(tt.b, gwIP, ourIP, ourMAC); got != tt.want {
				t.Errorf("MatchARPReply = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestMatchNA(t *testing.T) {
	ns, _, err := NeighborSolicitation(our6, gw6, ourMAC)
	if err != nil {
		t.Fatal(err)
	}
	una, _, err := UnsolicitedNA(gw6, gwMAC)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		b    []byte
		want bool
	}{
		{"solicited NA for gateway to us", naBytes(t, gw6, our6, gw6, true), true},
		{"NA from link-local source", naBytes(t, netip.MustParseAddr("fe80::1"), our6, gw6, true), true},
		{"unsolicited NA", naBytes(t, gw6, our6, gw6, false), false},
		{"NA for another target", naBytes(t, gw6, our6, netip.MustParseAddr("fd77::2"), true), false},
		{"NA to another address", naBytes(t, gw6, netip.MustParseAddr("fd77::11"), gw6, true), false},
		{"multicast unsolicited NA", una, false},
		{"our own NS", ns, false},
		{"truncated", naBytes(t, gw6, our6, gw6, true)[:50], false},
		{"empty", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := MatchNA(tt.b, gw6, our6); got != tt.want {
				t.Errorf("MatchNA = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestNeighborSolicitationShape(t *testing.T) {
	b, mac, err := NeighborSolicitation(our6, gw6, ourMAC)
	if err != nil {
		t.Fatal(err)
	}
	if mac.String() != "33:33:ff:00:00:01" {
		t.Errorf("dst MAC %s, want 33:33:ff:00:00:01", mac)
	}
	if b[7] != 255 || b[6] != protoICMPv6 {
		t.Errorf("hop limit %d next header %d", b[7], b[6])
	}
	m, err := ndp.ParseMessage(b[ipv6HeaderLen:])
	if err != nil {
		t.Fatal(err)
	}
	ns, ok := m.(*ndp.NeighborSolicitation)
	if !ok || ns.TargetAddress != gw6 {
		t.Fatalf("got %#v", m)
	}
	if src := netip.AddrFrom16([16]byte(b[8:24])); src != our6 {
		t.Errorf("source %s, want %s", src, our6)
	}
}

func FuzzMatchARPReply(f *testing.F) {
	f.Add(arpBytes(f, arp.OperationReply, gwMAC, gwIP, ourMAC, ourIP))
	f.Add(arpBytes(f, arp.OperationRequest, ourMAC, ourIP, gwMAC, gwIP))
	f.Add(arpBytes(f, arp.OperationReply, gwMAC, gwIP, otherMAC, gwIP))
	f.Add([]byte{0, 1, 8, 0, 6, 4, 0, 2})
	f.Fuzz(func(t *testing.T, b []byte) {
		if !MatchARPReply(b, gwIP, ourIP, ourMAC) {
			return
		}
		var p arp.Packet
		if err := p.UnmarshalBinary(b); err != nil {
			t.Fatalf("matched an unparsable packet: %v", err)
		}
		if p.Operation != arp.OperationReply || p.SenderIP != gwIP || p.TargetIP != ourIP || p.TargetHardwareAddr.String() != ourMAC.String() {
			t.Fatalf("matched a wrong packet: %+v", p)
		}
	})
}

func FuzzMatchNA(f *testing.F) {
	f.Add(naBytes(f, gw6, our6, gw6, true))
	f.Add(naBytes(f, gw6, our6, gw6, false))
	ns, _, _ := NeighborSolicitation(our6, gw6, ourMAC)
	f.Add(ns)
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, b []byte) {
		if !MatchNA(b, gw6, our6) {
			return
		}
		if netip.AddrFrom16([16]byte(b[24:40])) != our6 {
			t.Fatal("matched a packet not addressed to us")
		}
		m, err := ndp.ParseMessage(b[ipv6HeaderLen:])
		if err != nil {
			// The payload length may cut trailing bytes; re-parse as matched.
			return
		}
		if na, ok := m.(*ndp.NeighborAdvertisement); ok && na.TargetAddress != gw6 {
			t.Fatalf("matched an NA for %s", na.TargetAddress)
		}
	})
}
