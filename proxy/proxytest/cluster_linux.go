package proxytest

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"testing"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"

	"aether.io/node/pkg/capture"
	"aether.io/node/test/harness"
)

// FabricLink is the name, in every node netns of a Cluster, of the veth
// that joins the node to the fabric bridge.
const FabricLink = "fab0"

// NodeSpec describes one node of a Cluster: its pods and which of them get
// the divert.
type NodeSpec struct {
	Pods     []string
	Captured []string
}

// Cluster is N node topologies routed to each other: node i holds pods in
// 10.88.i.0/24 and fd88:0:0:i::/64 (its bridge br0 answers .1 / ::1, the
// pods' default gateway) and reaches the fabric netns's bridge over
// FabricLink with 10.99.0.(i+1) and fd99::(i+1), with a route to every
// other node's pod subnets via that node's fabric address. Node netns
// forward both families; nothing else of the machine is touched.
type Cluster struct {
	Fabric *harness.NS
	Nodes  []*Topology
}

// NodeGateway returns node i's address on its bridge for the family of
// IPv4 (true) or IPv6.
func NodeGateway(i int, v4 bool) netip.Addr {
	if v4 {
		return netip.AddrFrom4([4]byte{10, 88, byte(i), 1})
	}
	return netip.MustParseAddr(fmt.Sprintf("fd88:0:0:%x::1", i))
}

// FabricAddr returns node i's address on the fabric for IPv4 (true) or
// IPv6.
func FabricAddr(i int, v4 bool) netip.Addr {
	if v4 {
		return netip.AddrFrom4([4]byte{10, 99, 0, byte(i + 1)})
	}
	return netip.MustParseAddr(fmt.Sprintf("fd99::%x", i+1))
}

// NewCluster creates the fabric and one node per spec, with its pods
// (captured ones get the divert as in New).
func NewCluster(tb testing.TB, specs ...NodeSpec) *Cluster {
	tb.Helper()
	c := &Cluster{Fabric: harness.NewNS(tb, "fabric")}
	harness.Bridge(tb, c.Fabric, "br0")
	for i, s := range specs {
		node := harness.NewNS(tb, "node")
		node.MustDo(tb, func() error {
			for file, v := range map[string]string{
				"/proc/sys/net/ipv6/conf/default/accept_dad": "0",
				"/proc/sys/net/ipv4/ip_forward":              "1",
				"/proc/sys/net/ipv6/conf/all/forwarding":     "1",
			} {
				if err := os.WriteFile(file, []byte(v), 0o644); err != nil {
					return fmt.Errorf("failed to write %q: %w", file, err)
				}
			}
			return nil
		})
		t := &Topology{Node: node}
		harness.Bridge(tb, node, "br0")
		host := fmt.Sprintf("fab%d", i)
		harness.Veth(tb, node, FabricLink, c.Fabric, host)
		harness.Enslave(tb, c.Fabric, host, "br0")
		for _, v4 := range []bool{true, false} {
			harness.AddAddr(tb, node, "br0", prefix(NodeGateway(i, v4), v4))
			harness.AddAddr(tb, node, FabricLink, prefix(FabricAddr(i, v4), v4))
		}
		t.addPods(tb, i, s.Pods, s.Captured)
		for _, p := range t.Pods {
			p.NS.MustDo(tb, func() error {
				return defaultRoutes(NodeGateway(i, true), NodeGateway(i, false))
			})
		}
		c.Nodes = append(c.Nodes, t)
	}
	for i, t := range c.Nodes {
		t.Node.MustDo(tb, func() error {
			for j := range c.Nodes {
				if j == i {
					continue
				}
				for _, v4 := range []bool{true, false} {
					dst := netip.PrefixFrom(NodeGateway(j, v4), 24).Masked()
					if !v4 {
						dst = netip.PrefixFrom(NodeGateway(j, v4), 64).Masked()
					}
					if err := addRoute(dst, FabricAddr(j, v4)); err != nil {
						return err
					}
				}
			}
			return nil
		})
	}
	return c
}

// prefix is a's CIDR in the cluster's subnets (/24 or /64).
func prefix(a netip.Addr, v4 bool) string {
	if v4 {
		return a.String() + "/24"
	}
	return a.String() + "/64"
}

// defaultRoutes adds default routes via gw4 and gw6 through eth0 in the
// current netns.
func defaultRoutes(gw4, gw6 netip.Addr) error {
	l, err := netlinksafe.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("failed to find link %q: %w", "eth0", err)
	}
	for _, gw := range []netip.Addr{gw4, gw6} {
		r := &netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw.AsSlice()}
		if err := netlink.RouteAdd(r); err != nil {
			return fmt.Errorf("failed to add default route via %q: %w", gw, err)
		}
	}
	return nil
}

// addRoute adds a route to dst via gw in the current netns.
func addRoute(dst netip.Prefix, gw netip.Addr) error {
	r := &netlink.Route{
		Dst: &net.IPNet{IP: dst.Addr().AsSlice(), Mask: net.CIDRMask(dst.Bits(), dst.Addr().BitLen())},
		Gw:  gw.AsSlice(),
	}
	if err := netlink.RouteAdd(r); err != nil {
		return fmt.Errorf("failed to add route to %q via %q: %w", dst, gw, err)
	}
	return nil
}

// installDivert installs the default capture divert (redirect-all) in ns.
func installDivert(tb testing.TB, ns *harness.NS, name string) {
	tb.Helper()
	if err := (capture.Installer{}).Install(ns.Path(), capture.Build(capture.Config{RedirectAll: true})); err != nil {
		tb.Fatalf("failed to install the capture divert in %s: %v", name, err)
	}
}
