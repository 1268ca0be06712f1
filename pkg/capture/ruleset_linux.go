package capture

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"aether.io/node/pkg/meshcontract"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Defaults of the divert. The ports keep clear of Istio's 150xx range.
const (
	// TableName is the name of the one inet table the divert installs.
	TableName = "aether_capture"
	// DefaultCapturePort is where the proxy's transparent (IP_TRANSPARENT)
	// TCP and UDP listeners for diverted outbound traffic are bound.
	DefaultCapturePort = meshcontract.CapturePort
	// DefaultOutboundPort is the proxy's outbound listener on 127.0.0.1; it
	// serves the readiness endpoint and is the port captured in scoped mode.
	DefaultOutboundPort = meshcontract.OutboundPort
	// DefaultInboundPort is the proxy's inbound listener: never diverted
	// outbound; with InboundCapture, plaintext inbound TCP is TPROXYed to it.
	DefaultInboundPort = meshcontract.InboundPort
	// DefaultHBONEPort is the proxy's HBONE listener in the pod
	// (proxy/hbone.DefaultPort): inbound HBONE is never redirected.
	DefaultHBONEPort = meshcontract.HBONEPort
	// DefaultBypassMark is the SO_MARK the proxy puts on its own upstream
	// sockets; packets carrying it are never diverted.
	DefaultBypassMark = meshcontract.BypassMark
	// DefaultDivertMark is the fwmark set on diverted packets; the ip rule
	// sends it to DefaultRouteTable.
	DefaultDivertMark = meshcontract.DivertMark
	// DefaultDeliverMark is the SO_MARK of the proxy's source-preserving
	// inbound delivery sockets; the divert routes the app's replies to
	// them back over lo.
	DefaultDeliverMark = meshcontract.DeliverMark
	// DefaultRouteTable holds "local default dev lo" for IPv4 and IPv6.
	DefaultRouteTable = meshcontract.RouteTable
	// DefaultRulePriority is the priority of the fwmark ip rules.
	DefaultRulePriority = 133
	// DefaultCapturedMark is the conntrack mark of the connections a
	// divert with SpareEstablished captured (never a socket mark).
	DefaultCapturedMark = 0xae80
)

// builtinExcluded are destinations never diverted: link-local and multicast.
// Loopback and the pod's own addresses are excluded by "fib daddr type local".
var builtinExcluded = []netip.Prefix{
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("fe80::/10"),
	netip.MustParsePrefix("ff00::/8"),
}

// Config is one pod's divert, after the netconf and the pod's annotations
// were merged. The zero value is not valid; use Normalize.
type Config struct {
	// CapturePort is the transparent listener port diverted packets go to.
	CapturePort uint16
	// Ports are the destination ports diverted when RedirectAll is false.
	Ports []uint16
	// RedirectAll diverts every outbound TCP and UDP destination port.
	RedirectAll bool
	// ExcludePorts are destination ports never diverted.
	ExcludePorts []uint16
	// ExcludeCIDRs are destination ranges (IPv4 or IPv6) never diverted.
	ExcludeCIDRs []netip.Prefix
	// BypassMark marks the proxy's own sockets.
	BypassMark uint32
	// DivertMark is the fwmark of diverted packets.
	DivertMark uint32
	// DeliverMark is the SO_MARK of the proxy's inbound delivery sockets
	// bound to the client's address: saved in the conntrack mark of the
	// connections they open, restored on the app's replies, which the
	// fwmark rule sends to RouteTable (back over lo to the proxy).
	DeliverMark uint32
	// RouteTable is the policy routing table of diverted packets and of
	// the replies to source-preserving deliveries.
	RouteTable int
	// RulePriority is the priority of the fwmark ip rules.
	RulePriority int
	// SpareEstablished leaves the connections that were established
	// before the divert was installed as they are (a divert put into a
	// running pod: live enrolment): only connections that start after it
	// are captured, each marked CapturedMark in conntrack so its later
	// packets follow its first. Without it every packet of a diverted
	// destination goes to the proxy, which resets a connection it never
	// accepted; at CNI ADD the pod has no connection yet.
	SpareEstablished bool
	// CapturedMark is that conntrack mark (SpareEstablished only).
	CapturedMark uint32

	// InboundCapture turns the inbound redirect on: TCP arriving at the
	// pod from outside (not on lo, not a reply, not to HBONEPort, the
	// proxy's own ports or ExcludeInboundPorts, not from
	// InboundAllowCIDRs) is TPROXYed to InboundPort, and dropped while no
	// transparent listener is bound there.
	InboundCapture bool
	// InboundPort is the proxy's (transparent) inbound listener port.
	InboundPort uint16
	// OutboundPort is the proxy's outbound listener port; with
	// CapturePort, InboundPort and HBONEPort it is never redirected
	// inbound.
	OutboundPort uint16
	// HBONEPort is the proxy's HBONE port: inbound HBONE is never
	// redirected.
	HBONEPort uint16
	// ExcludeInboundPorts are destination ports whose inbound TCP is never
	// redirected (it reaches the app directly, whatever the policy).
	ExcludeInboundPorts []uint16
	// InboundAllowCIDRs are source ranges whose inbound TCP is never
	// redirected (the kubelet's probes come from the node's address).
	InboundAllowCIDRs []netip.Prefix
}

// Normalize fills defaults and sorts and de-duplicates the lists, so equal
// configurations render equal rulesets.
func (c Config) Normalize() Config {
	if c.CapturePort == 0 {
		c.CapturePort = DefaultCapturePort
	}
	if c.BypassMark == 0 {
		c.BypassMark = DefaultBypassMark
	}
	if c.DivertMark == 0 {
		c.DivertMark = DefaultDivertMark
	}
	if c.DeliverMark == 0 {
		c.DeliverMark = DefaultDeliverMark
	}
	if c.RouteTable == 0 {
		c.RouteTable = DefaultRouteTable
	}
	if c.RulePriority == 0 {
		c.RulePriority = DefaultRulePriority
	}
	if c.SpareEstablished && c.CapturedMark == 0 {
		c.CapturedMark = DefaultCapturedMark
	}
	if c.InboundPort == 0 {
		c.InboundPort = DefaultInboundPort
	}
	if c.OutboundPort == 0 {
		c.OutboundPort = DefaultOutboundPort
	}
	if c.HBONEPort == 0 {
		c.HBONEPort = DefaultHBONEPort
	}
	c.Ports = sortedPorts(c.Ports)
	c.ExcludePorts = sortedPorts(c.ExcludePorts)
	c.ExcludeInboundPorts = sortedPorts(c.ExcludeInboundPorts)
	c.ExcludeCIDRs = sortedPrefixes(c.ExcludeCIDRs)
	c.InboundAllowCIDRs = sortedPrefixes(c.InboundAllowCIDRs)
	return c
}

// sortedPrefixes returns the masked prefixes of p, sorted, without
// duplicates.
func sortedPrefixes(p []netip.Prefix) []netip.Prefix {
	cidrs := make([]netip.Prefix, 0, len(p))
	for _, x := range p {
		cidrs = append(cidrs, x.Masked())
	}
	slices.SortFunc(cidrs, func(a, b netip.Prefix) int {
		if r := a.Addr().Compare(b.Addr()); r != 0 {
			return r
		}
		return a.Bits() - b.Bits()
	})
	return slices.Compact(cidrs)
}

func sortedPorts(p []uint16) []uint16 {
	out := slices.Clone(p)
	slices.Sort(out)
	return slices.Compact(out)
}

// Validate reports a configuration that cannot be installed.
func (c Config) Validate() error {
	if c.CapturePort == 0 {
		return fmt.Errorf("capture port must be 1-65535")
	}
	if !c.RedirectAll && len(c.Ports) == 0 {
		return fmt.Errorf("no capture ports and redirect_all off: nothing would be captured; set capture.ports or capture.redirect_all")
	}
	if c.DivertMark == 0 || c.DivertMark == c.BypassMark {
		return fmt.Errorf("divert mark %#x must be non-zero and differ from the bypass mark %#x", c.DivertMark, c.BypassMark)
	}
	if c.DeliverMark == 0 || c.DeliverMark == c.BypassMark || c.DeliverMark == c.DivertMark {
		return fmt.Errorf("deliver mark %#x must be non-zero and differ from the bypass mark %#x and the divert mark %#x", c.DeliverMark, c.BypassMark, c.DivertMark)
	}
	if c.SpareEstablished && slices.Contains([]uint32{0, c.BypassMark, c.DivertMark, c.DeliverMark}, c.CapturedMark) {
		return fmt.Errorf("captured mark %#x must be non-zero and differ from the bypass, divert and deliver marks", c.CapturedMark)
	}
	for _, p := range c.Ports {
		if p == 0 {
			return fmt.Errorf("capture port 0 is not a port: use 1-65535")
		}
	}
	if c.InboundCapture && (c.InboundPort == c.CapturePort || c.InboundPort == c.HBONEPort) {
		return fmt.Errorf("inbound port %d must differ from the capture port %d and the HBONE port %d", c.InboundPort, c.CapturePort, c.HBONEPort)
	}
	return nil
}

// Chain is one chain of the table.
type Chain struct {
	// Name is the chain name.
	Name string
	// Type, Hook and Priority are empty/nil for a regular chain.
	Type     nftables.ChainType
	Hook     *nftables.ChainHook
	Priority *nftables.ChainPriority
	// Header is the nft text of the chain's base declaration ("" if regular).
	Header string
	// Rules in order.
	Rules []Rule
}

// Rule is one rule: the expressions the kernel gets and their nft text.
type Rule struct {
	// Exprs are the netlink expressions.
	Exprs []expr.Any
	// Text is the nft-syntax rendering.
	Text string
}

// Ruleset is the whole divert of one configuration.
type Ruleset struct {
	// Config is the normalized configuration it was built from.
	Config Config
	// Chains of the inet table, in install order.
	Chains []Chain
}

type ruleBuilder struct {
	exprs []expr.Any
	text  []string
}

func (b *ruleBuilder) add(text string, e ...expr.Any) *ruleBuilder {
	b.exprs = append(b.exprs, e...)
	if text != "" {
		b.text = append(b.text, text)
	}
	return b
}

func (b *ruleBuilder) rule() Rule {
	return Rule{Exprs: b.exprs, Text: strings.Join(b.text, " ")}
}

func u32(v uint32) []byte {
	b := make([]byte, 4)
	binary.NativeEndian.PutUint32(b, v)
	return b
}

func be16(v uint16) []byte {
	b := make([]byte, 2)
	binary.BigEndian.PutUint16(b, v)
	return b
}

func ifname(n string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, n)
	return b
}

func (b *ruleBuilder) metaMarkEq(mark uint32) *ruleBuilder {
	return b.add(fmt.Sprintf("meta mark 0x%08x", mark),
		&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: u32(mark)})
}

func (b *ruleBuilder) ctDirection(dir byte, name string) *ruleBuilder {
	return b.add("ct direction "+name,
		&expr.Ct{Key: expr.CtKeyDIRECTION, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{dir}})
}

func (b *ruleBuilder) ctMarkEq(mark uint32) *ruleBuilder { return b.ctMark(expr.CmpOpEq, "", mark) }

func (b *ruleBuilder) ctMarkNeq(mark uint32) *ruleBuilder {
	return b.ctMark(expr.CmpOpNeq, "!= ", mark)
}

// ctMark compares the conntrack mark with mark (op, rendered as opText).
func (b *ruleBuilder) ctMark(op expr.CmpOp, opText string, mark uint32) *ruleBuilder {
	return b.add(fmt.Sprintf("ct mark %s0x%08x", opText, mark),
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: u32(mark)})
}

// spareEstablished are the rules that return from the chain for a packet
// of a connection the divert did not capture (its conntrack entry lacks
// mark, which the divert gives every connection it captures): one that
// conntrack saw established, and a TCP segment that does not open a
// connection (no SYN, or an ACK with it), which is how a connection that
// predates conntrack in the namespace shows up: conntrack starts tracking
// only once the divert's table uses it, and picks such a connection up
// mid-stream as a new one.
func spareEstablished(mark uint32) []Rule {
	established := new(ruleBuilder).add("ct state established,related",
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: u32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED), Xor: u32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: u32(0)}).ctMarkNeq(mark).verdict(expr.VerdictReturn, "")
	const syn, ack = 0x02, 0x10
	// nft lists the l4proto match as the tcp header's implied dependency.
	midStream := new(ruleBuilder).add("", &expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}}).add("tcp flags != syn / syn,ack",
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{syn | ack}, Xor: []byte{0}},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{syn}}).ctMarkNeq(mark).verdict(expr.VerdictReturn, "")
	return []Rule{established.rule(), midStream.rule()}
}

// ctStateNew matches the first packet of a connection conntrack has not
// seen before.
func (b *ruleBuilder) ctStateNew() *ruleBuilder {
	return b.add("ct state new",
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: u32(expr.CtStateBitNEW), Xor: u32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: u32(0)})
}

func (b *ruleBuilder) setMetaMark(mark uint32) *ruleBuilder {
	return b.add(fmt.Sprintf("meta mark set 0x%08x", mark),
		&expr.Immediate{Register: 1, Data: u32(mark)},
		&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1})
}

func (b *ruleBuilder) setCtMark(mark uint32) *ruleBuilder {
	return b.add(fmt.Sprintf("ct mark set 0x%08x", mark),
		&expr.Immediate{Register: 1, Data: u32(mark)},
		&expr.Ct{Key: expr.CtKeyMARK, SourceRegister: true, Register: 1})
}

func (b *ruleBuilder) l4proto(proto byte, name string) *ruleBuilder {
	return b.add("meta l4proto "+name,
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
}

func (b *ruleBuilder) nfproto(proto byte, name string) *ruleBuilder {
	return b.add("meta nfproto "+name,
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
}

func (b *ruleBuilder) thDport(port uint16) *ruleBuilder {
	return b.add(fmt.Sprintf("th dport %d", port),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: be16(port)})
}

func (b *ruleBuilder) daddrIn(p netip.Prefix) *ruleBuilder { return b.addrIn("daddr", p) }

func (b *ruleBuilder) saddrIn(p netip.Prefix) *ruleBuilder { return b.addrIn("saddr", p) }

// addrIn matches the packet's field ("saddr" or "daddr") in p.
func (b *ruleBuilder) addrIn(field string, p netip.Prefix) *ruleBuilder {
	family, off, ln := "ip", uint32(16), uint32(4)
	var proto byte = unix.NFPROTO_IPV4
	if p.Addr().Is6() {
		family, off, ln, proto = "ip6", 24, 16, unix.NFPROTO_IPV6
	}
	if field == "saddr" {
		off -= ln
	}
	b.add("", &expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}})
	b.add("", &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: off, Len: ln})
	bits := p.Bits()
	if bits < int(ln)*8 {
		mask := make([]byte, ln)
		for i := 0; i < bits; i++ {
			mask[i/8] |= 0x80 >> (i % 8)
		}
		b.add("", &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: ln, Mask: mask, Xor: make([]byte, ln)})
	}
	text := fmt.Sprintf("%s %s %s", family, field, p.Addr())
	if bits < int(ln)*8 {
		text = fmt.Sprintf("%s %s %s", family, field, p)
	}
	return b.add(text, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()})
}

func (b *ruleBuilder) verdict(kind expr.VerdictKind, chain string) *ruleBuilder {
	text := map[expr.VerdictKind]string{expr.VerdictReturn: "return", expr.VerdictAccept: "accept", expr.VerdictDrop: "drop", expr.VerdictJump: "jump " + chain}[kind]
	return b.add(text, &expr.Verdict{Kind: kind, Chain: chain})
}

// Build returns the ruleset of c (normalized first).
func Build(c Config) Ruleset {
	c = c.Normalize()
	const divert = "divert"
	output := Chain{
		Name: "output", Type: nftables.ChainTypeRoute, Hook: nftables.ChainHookOutput,
		Priority: nftables.ChainPriorityMangle,
		Header:   "type route hook output priority mangle; policy accept;",
	}
	// Source-preserving inbound delivery: the proxy's transparent socket,
	// bound to the client's address, opens the connection to the app with
	// the deliver mark; its conntrack entry keeps it (new connections
	// only, so a direct connection with the same four-tuple is never
	// marked), and the app's replies get it back, so the fwmark rule
	// routes them to lo and into the proxy's socket instead of out of
	// the pod towards the real client.
	output.Rules = append(output.Rules,
		new(ruleBuilder).ctDirection(1, "reply").ctMarkEq(c.DeliverMark).setMetaMark(c.DeliverMark).rule(),
		new(ruleBuilder).metaMarkEq(c.DeliverMark).ctStateNew().setCtMark(c.DeliverMark).rule())
	// The proxy's own upstream sockets carry the bypass mark.
	output.Rules = append(output.Rules, new(ruleBuilder).metaMarkEq(c.BypassMark).verdict(expr.VerdictReturn, "").rule())
	for _, p := range []struct {
		num  byte
		name string
	}{{unix.IPPROTO_TCP, "tcp"}, {unix.IPPROTO_UDP, "udp"}} {
		output.Rules = append(output.Rules, new(ruleBuilder).l4proto(p.num, p.name).verdict(expr.VerdictJump, divert).rule())
	}

	dv := Chain{Name: divert}
	// Replies of connections the pod accepted (inbound, possibly through the
	// proxy's inbound listener) belong to an existing flow and must leave
	// as they are: diverting them would hand a reply to the capture
	// listener and break every inbound connection of a captured pod.
	dv.Rules = append(dv.Rules, new(ruleBuilder).ctDirection(1, "reply").verdict(expr.VerdictReturn, "").rule())
	if c.SpareEstablished {
		dv.Rules = append(dv.Rules, spareEstablished(c.CapturedMark)...)
	}
	// Loopback, the pod's own addresses and the replies of the proxy's
	// transparent sockets (sourced from the original destination, sent to
	// the pod) are local destinations.
	dv.Rules = append(dv.Rules, new(ruleBuilder).add("fib daddr type local",
		&expr.Fib{Register: 1, ResultADDRTYPE: true, FlagDADDR: true},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: u32(unix.RTN_LOCAL)}).verdict(expr.VerdictReturn, "").rule())
	for _, p := range builtinExcluded {
		dv.Rules = append(dv.Rules, new(ruleBuilder).daddrIn(p).verdict(expr.VerdictReturn, "").rule())
	}
	for _, p := range c.ExcludeCIDRs {
		dv.Rules = append(dv.Rules, new(ruleBuilder).daddrIn(p).verdict(expr.VerdictReturn, "").rule())
	}
	for _, port := range c.ExcludePorts {
		dv.Rules = append(dv.Rules, new(ruleBuilder).thDport(port).verdict(expr.VerdictReturn, "").rule())
	}
	setMark := func(b *ruleBuilder) *ruleBuilder {
		if c.SpareEstablished {
			b.setCtMark(c.CapturedMark)
		}
		return b.setMetaMark(c.DivertMark)
	}
	if c.RedirectAll {
		dv.Rules = append(dv.Rules, setMark(new(ruleBuilder)).rule())
	} else {
		for _, port := range c.Ports {
			dv.Rules = append(dv.Rules, setMark(new(ruleBuilder).thDport(port)).rule())
		}
	}

	pre := Chain{
		Name: "prerouting", Type: nftables.ChainTypeFilter, Hook: nftables.ChainHookPrerouting,
		Priority: nftables.ChainPriorityMangle,
		Header:   "type filter hook prerouting priority mangle; policy accept;",
	}
	for _, fam := range []struct {
		num  byte
		name string
	}{{unix.NFPROTO_IPV4, "ip"}, {unix.NFPROTO_IPV6, "ip6"}} {
		for _, p := range []struct {
			num  byte
			name string
		}{{unix.IPPROTO_TCP, "tcp"}, {unix.IPPROTO_UDP, "udp"}} {
			nfname := map[string]string{"ip": "ipv4", "ip6": "ipv6"}[fam.name]
			b := new(ruleBuilder).add(`iifname "lo"`,
				&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname("lo")}).
				metaMarkEq(c.DivertMark).nfproto(fam.num, nfname).l4proto(p.num, p.name)
			b.add(fmt.Sprintf("tproxy %s to :%d", fam.name, c.CapturePort),
				&expr.Immediate{Register: 1, Data: be16(c.CapturePort)},
				&expr.TProxy{Family: fam.num, TableFamily: unix.NFPROTO_INET, RegPort: 1})
			pre.Rules = append(pre.Rules, b.verdict(expr.VerdictAccept, "").rule())
		}
	}
	chains := []Chain{output, dv, pre}
	if c.InboundCapture {
		pre.Rules = append(pre.Rules, new(ruleBuilder).l4proto(unix.IPPROTO_TCP, "tcp").verdict(expr.VerdictJump, inboundChain).rule())
		chains = []Chain{output, dv, pre, inbound(c)}
	}
	return Ruleset{Config: c, Chains: chains}
}

// inboundChain is the regular chain of the inbound redirect.
const inboundChain = "inbound"

// inbound is the inbound redirect of c, jumped to from prerouting for TCP:
// what arrives from outside the pod goes to the proxy's transparent inbound
// listener, which sees the original destination as its local address.
func inbound(c Config) Chain {
	ch := Chain{Name: inboundChain}
	ret := func(b *ruleBuilder) { ch.Rules = append(ch.Rules, b.verdict(expr.VerdictReturn, "").rule()) }
	// The pod's own traffic: the proxy's connections to the app and
	// anything else on loopback.
	ret(new(ruleBuilder).add(`iifname "lo"`,
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname("lo")}))
	// Replies of the pod's own outbound connections (and of the proxy's
	// upstream sockets).
	ret(new(ruleBuilder).ctDirection(1, "reply"))
	if c.SpareEstablished {
		ch.Rules = append(ch.Rules, spareEstablished(c.CapturedMark)...)
	}
	// HBONE (the proxy's :15008 authenticates it) and the proxy's own
	// listeners, then the operator's exclusions.
	for _, port := range sortedPorts([]uint16{c.HBONEPort, c.CapturePort, c.InboundPort, c.OutboundPort}) {
		ret(new(ruleBuilder).thDport(port))
	}
	for _, port := range c.ExcludeInboundPorts {
		ret(new(ruleBuilder).thDport(port))
	}
	for _, p := range c.InboundAllowCIDRs {
		ret(new(ruleBuilder).saddrIn(p))
	}
	for _, fam := range []struct {
		num  byte
		name string
	}{{unix.NFPROTO_IPV4, "ip"}, {unix.NFPROTO_IPV6, "ip6"}} {
		nfname := map[string]string{"ip": "ipv4", "ip6": "ipv6"}[fam.name]
		b := new(ruleBuilder).nfproto(fam.num, nfname).l4proto(unix.IPPROTO_TCP, "tcp")
		if c.SpareEstablished {
			b.setCtMark(c.CapturedMark)
		}
		b.add(fmt.Sprintf("tproxy %s to :%d", fam.name, c.InboundPort),
			&expr.Immediate{Register: 1, Data: be16(c.InboundPort)},
			&expr.TProxy{Family: fam.num, TableFamily: unix.NFPROTO_INET, RegPort: 1})
		ch.Rules = append(ch.Rules, b.verdict(expr.VerdictAccept, "").rule())
	}
	// TPROXY found no transparent listener (the proxy is not serving the
	// pod): drop rather than let plaintext reach the app past the policy.
	// The client's SYN retransmits bridge a proxy restart.
	ch.Rules = append(ch.Rules, new(ruleBuilder).verdict(expr.VerdictDrop, "").rule())
	return ch
}

// Text renders the ruleset as nft syntax, followed by the policy routing as
// `ip rule` / `ip route` lines in comments: the golden form.
func (r Ruleset) Text() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "table inet %s {\n", TableName)
	for i, ch := range r.Chains {
		if i > 0 {
			sb.WriteString("\n")
		}
		fmt.Fprintf(&sb, "\tchain %s {\n", ch.Name)
		if ch.Header != "" {
			fmt.Fprintf(&sb, "\t\t%s\n", ch.Header)
		}
		for _, rl := range ch.Rules {
			fmt.Fprintf(&sb, "\t\t%s\n", rl.Text)
		}
		sb.WriteString("\t}\n")
	}
	sb.WriteString("}\n")
	c := r.Config
	fmt.Fprintf(&sb, "# ip -4 rule: %d: from all fwmark 0x%x lookup %d\n", c.RulePriority, c.DivertMark, c.RouteTable)
	fmt.Fprintf(&sb, "# ip -6 rule: %d: from all fwmark 0x%x lookup %d\n", c.RulePriority, c.DivertMark, c.RouteTable)
	fmt.Fprintf(&sb, "# ip -4 rule: %d: from all fwmark 0x%x lookup %d\n", c.RulePriority, c.DeliverMark, c.RouteTable)
	fmt.Fprintf(&sb, "# ip -6 rule: %d: from all fwmark 0x%x lookup %d\n", c.RulePriority, c.DeliverMark, c.RouteTable)
	fmt.Fprintf(&sb, "# ip -4 route table %d: local default dev lo scope host\n", c.RouteTable)
	fmt.Fprintf(&sb, "# ip -6 route table %d: local default dev lo\n", c.RouteTable)
	return sb.String()
}
