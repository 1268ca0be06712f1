package enivlantest

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"aether.io/node/pkg/filelock"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

// CloudOptions shape a Cloud.
type CloudOptions struct {
	// RealVLAN builds the fabric side with 802.1Q sub-interfaces (one per
	// VLAN ID, each carrying the gateways); it needs a kernel with 8021q.
	RealVLAN bool
	// IPv6 adds an IPv6 subnet (fd77::/64, gateway fd77::1).
	IPv6 bool
	// IPv6Only drops the IPv4 subnet (implies IPv6).
	IPv6Only bool
	// Network is the conflist name ("eni-test" when empty).
	Network string
}

// Cloud is a node namespace whose master ("ens5") reaches a fabric
// namespace over veth, a fake spiderpool-agent, and host-local IPAM state.
// The fabric's gateway answers ARP/NDP only for bound (IP, MAC, VLAN)
// triples: nftables in the fabric drops every other ARP request and
// Neighbor Solicitation, as an IaaS anti-spoofing fabric does.
type Cloud struct {
	// Node plays the host; the plugins run in it.
	Node *harness.NS
	// Fabric plays the cloud network.
	Fabric *harness.NS
	// Master is the ENI in Node; FabricLink is its peer in Fabric.
	Master, FabricLink string
	// Gateway4 and Gateway6 are the gateway addresses with prefix.
	Gateway4, Gateway6 netip.Prefix
	// Agent is the fake spiderpool-agent.
	Agent *Agent
	// IPAM is the host-local section; IPAMDir its data directory.
	IPAM    map[string]any
	IPAMDir string
	// Network is the conflist name.
	Network string
	// StateDir is eni-vlan's ownership-record directory for this cloud.
	StateDir string

	opts     CloudOptions
	tb       testing.TB
	mu       sync.Mutex
	bound    map[string]bool // programmed fabric keys
	vlans    map[int]bool    // fabric VLAN sub-interfaces
	nft      *nftables.Conn
	arpChain *nftables.Chain
	nd6Chain *nftables.Chain
}

// NewCloud builds a cloud for one test; everything is removed in t.Cleanup.
func NewCloud(tb testing.TB, opts CloudOptions) *Cloud {
	tb.Helper()
	if opts.Network == "" {
		opts.Network = "eni-test"
	}
	c := &Cloud{
		Node: harness.NewNS(tb, "node"), Fabric: harness.NewNS(tb, "fab"),
		Master: "ens5", FabricLink: "fab0",
		Gateway4: netip.MustParsePrefix("10.77.0.1/24"),
		Network:  opts.Network, opts: opts, tb: tb,
		bound: map[string]bool{}, vlans: map[int]bool{},
	}
	harness.Veth(tb, c.Node, c.Master, c.Fabric, c.FabricLink)
	var subnets []string
	var routes []map[string]any
	if !opts.IPv6Only {
		subnets = append(subnets, "10.77.0.0/24")
		routes = append(routes, map[string]any{"dst": "0.0.0.0/0"})
	}
	if opts.IPv6 || opts.IPv6Only {
		c.Gateway6 = netip.MustParsePrefix("fd77::1/64")
		subnets = append(subnets, "fd77::/64")
	}
	c.IPAM, c.IPAMDir = harness.HostLocalIPAM(tb, subnets...)
	if c.Gateway6.IsValid() {
		routes = append(routes, map[string]any{"dst": "::/0"})
	}
	c.IPAM["routes"] = routes
	c.StateDir = filepath.Join(tb.TempDir(), "eni-vlan-state")
	if !opts.RealVLAN {
		if err := c.addGateways(c.FabricLink); err != nil {
			tb.Fatal(err)
		}
	}
	// The fabric forwards nothing and answers only bound senders.
	c.Fabric.MustDo(tb, func() error {
		return os.WriteFile("/proc/sys/net/ipv6/conf/all/forwarding", []byte("0"), 0o644)
	})
	var err error
	c.nft, err = nftables.New(nftables.WithNetNSFd(int(c.Fabric.Fd())))
	if err != nil {
		tb.Fatalf("failed to open nftables in fabric: %v", err)
	}
	c.installBaseRules()
	c.Agent = StartAgent(tb)
	c.Agent.Resolve = c.resolve
	return c
}

func (c *Cloud) addGateways(link string) error {
	return c.Fabric.Do(func() error {
		l, err := netlinksafe.LinkByName(link)
		if err != nil {
			return err
		}
		for _, p := range []netip.Prefix{c.Gateway4, c.Gateway6} {
			if !p.IsValid() {
				continue
			}
			a := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
			if p.Addr().Is6() {
				a.Flags = unix.IFA_F_NODAD
			}
			if err := netlink.AddrAdd(l, a); err != nil {
				return fmt.Errorf("failed to add gateway %s to %s: %w", p, link, err)
			}
		}
		return nil
	})
}

// fabricIf is the fabric interface a pod on vlan arrives at.
func (c *Cloud) fabricIf(vlan int) string {
	if c.opts.RealVLAN {
		return fmt.Sprintf("fv%d", vlan)
	}
	return c.FabricLink
}

// ensureVLAN creates the fabric's sub-interface for vlan (real VLAN only).
func (c *Cloud) ensureVLAN(vlan int) error {
	if !c.opts.RealVLAN || c.vlans[vlan] {
		return nil
	}
	name := c.fabricIf(vlan)
	err := c.Fabric.Do(func() error {
		parent, err := netlinksafe.LinkByName(c.FabricLink)
		if err != nil {
			return err
		}
		v := &netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: name, ParentIndex: parent.Attrs().Index}, VlanId: vlan, VlanProtocol: netlink.VLAN_PROTOCOL_8021Q}
		if err := netlink.LinkAdd(v); err != nil {
			return fmt.Errorf("failed to add fabric vlan %s: %w", name, err)
		}
		return harness.SetUp(name)
	})
	if err != nil {
		return err
	}
	if err := c.addGateways(name); err != nil {
		return err
	}
	c.vlans[vlan] = true
	return nil
}

func ifname(name string) []byte {
	b := make([]byte, 16)
	copy(b, name)
	return b
}

func (c *Cloud) installBaseRules() {
	arpT := c.nft.AddTable(&nftables.Table{Family: nftables.TableFamilyARP, Name: "fabric"})
	// The arp family numbers its hooks NF_ARP_IN/OUT, not NF_INET_*.
	c.arpChain = c.nft.AddChain(&nftables.Chain{
		Name: "in", Table: arpT, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookRef(0 /* NF_ARP_IN */), Priority: nftables.ChainPriorityFilter,
	})
	// Default: drop every ARP packet no binding accepted.
	c.nft.AddRule(&nftables.Rule{Table: arpT, Chain: c.arpChain, Exprs: []expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}}})

	ip6T := c.nft.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv6, Name: "fabric"})
	c.nd6Chain = c.nft.AddChain(&nftables.Chain{
		Name: "in", Table: ip6T, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter,
	})
	c.nft.AddRule(&nftables.Rule{Table: ip6T, Chain: c.nd6Chain, Exprs: append(isNS(), &expr.Verdict{Kind: expr.VerdictDrop})})
	if err := c.nft.Flush(); err != nil {
		c.tb.Fatalf("failed to install fabric rules: %v", err)
	}
}

func isNS() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_ICMPV6}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{135}},
	}
}

// program lets (ip, mac) through on the fabric interface of vlan.
func (c *Cloud) program(vlan int, mac net.HardwareAddr, ip netip.Addr) error {
	k := fmt.Sprintf("%d/%s/%s", vlan, mac, ip)
	if c.bound[k] {
		return nil
	}
	if err := c.ensureVLAN(vlan); err != nil {
		return err
	}
	iif := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname(c.fabricIf(vlan))},
	}
	if ip.Is4() {
		a := ip.As4()
		ex := append(iif,
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 6},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(mac)},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 14, Len: 4},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]},
			&expr.Verdict{Kind: expr.VerdictAccept})
		c.nft.InsertRule(&nftables.Rule{Table: c.arpChain.Table, Chain: c.arpChain, Exprs: ex})
	} else {
		a := ip.As16()
		ex := append(iif, isNS()...)
		ex = append(ex,
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 6, Len: 6},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(mac)},
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 8, Len: 16},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]},
			&expr.Verdict{Kind: expr.VerdictAccept})
		c.nft.InsertRule(&nftables.Rule{Table: c.nd6Chain.Table, Chain: c.nd6Chain, Exprs: ex})
	}
	if err := c.nft.Flush(); err != nil {
		return fmt.Errorf("failed to bind %s in fabric: %w", k, err)
	}
	c.bound[k] = true
	return nil
}

// BindFabric pushes an (IP, MAC, VLAN) binding to the fabric directly,
// without the agent (benchmarks and pre-flight tests).
func (c *Cloud) BindFabric(vlan int, mac net.HardwareAddr, ip netip.Addr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.program(vlan, mac, ip)
}

// Allocated returns the addresses (CIDR) host-local holds for containerID.
func (c *Cloud) Allocated(containerID string) (v4, v6 string) {
	dir := filepath.Join(c.IPAMDir, c.Network)
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		a, err := netip.ParseAddr(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil || !bytes.HasPrefix(b, []byte(containerID+"\r\n")) {
			continue
		}
		if a.Is4() {
			v4 = netip.PrefixFrom(a, c.Gateway4.Bits()).String()
		} else if c.Gateway6.IsValid() {
			v6 = netip.PrefixFrom(a, c.Gateway6.Bits()).String()
		}
	}
	return v4, v6
}

// resolve fills the binding's IPs from host-local's store (spiderpool-agent
// knows what its IPAM allocated) and pushes the binding to the fabric, as
// spiderpool's IaaS provider mode does on allocation.
func (c *Cloud) resolve(b *Binding) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if b.IPv4 == "" && b.IPv6 == "" && b.ContainerID != "" {
		b.IPv4, b.IPv6 = c.Allocated(b.ContainerID)
	}
	if b.IPv4 != "" && b.IPv4Gateway == "" {
		b.IPv4Gateway = c.Gateway4.Addr().String()
	}
	if b.IPv6 != "" && b.IPv6Gateway == "" {
		b.IPv6Gateway = c.Gateway6.Addr().String()
	}
	if b.NotEffective {
		return nil
	}
	vlan, macS := b.VLAN, b.MAC
	if b.FabricVLAN != 0 {
		vlan = b.FabricVLAN
	}
	if b.FabricMAC != "" {
		macS = b.FabricMAC
	}
	mac, err := net.ParseMAC(macS)
	if err != nil {
		return err
	}
	for _, s := range []string{b.IPv4, b.IPv6} {
		if s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return err
		}
		if err := c.program(vlan, mac, p.Addr()); err != nil {
			return err
		}
	}
	return nil
}

// Bind tells the agent about pod (VLAN and MAC in b; identity from pod).
func (c *Cloud) Bind(pod harness.Pod, b Binding) {
	b.Namespace, b.Name, b.UID, b.ContainerID = pod.Namespace, pod.Name, pod.UID, pod.ContainerID
	if b.IfName == "" {
		b.IfName = pod.IfName
	}
	c.Agent.Set(b)
}

// PluginConf returns the eni-vlan plugin object for this cloud with
// validation on; extra keys override.
func (c *Cloud) PluginConf(extra map[string]any) map[string]any {
	m := map[string]any{
		"type":                  "eni-vlan",
		"master":                c.Master,
		"validateIaasNetConfig": true,
		"validationRetries":     3,
		"validationTimeoutMs":   500,
		"spiderpoolSocket":      c.Agent.Socket,
		"endpointTimeoutMs":     5000,
		"stateDir":              c.StateDir,
		"ipam":                  c.IPAM,
	}
	for k, v := range extra {
		m[k] = v
	}
	return m
}

// Links returns the names and kinds of the links in n (lo excluded).
func Links(tb testing.TB, n *harness.NS) []string {
	tb.Helper()
	var out []string
	n.MustDo(tb, func() error {
		ls, err := netlinksafe.LinkList()
		if err != nil {
			return err
		}
		for _, l := range ls {
			if l.Attrs().Name != "lo" {
				out = append(out, l.Attrs().Name+":"+l.Type())
			}
		}
		return nil
	})
	return out
}

// Records returns eni-vlan's ownership records in the cloud's state dir.
func (c *Cloud) Records() []string {
	entries, _ := os.ReadDir(c.StateDir)
	var out []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".json") {
			out = append(out, e.Name())
		}
	}
	return out
}

// SurrogateTag is the build tag selecting the macvlan surrogate link.
const SurrogateTag = "enivlan_surrogate_link"

var (
	surrogateMu  sync.Mutex
	surrogateDir string
)

// BuildSurrogate builds ./cmd/eni-vlan with SurrogateTag (once per process,
// into a fixed directory under the harness cache, under a lock) and returns
// the directory. Only for kernels without 802.1Q; production builds never
// carry the tag.
func BuildSurrogate(tb testing.TB) string {
	tb.Helper()
	surrogateMu.Lock()
	defer surrogateMu.Unlock()
	if surrogateDir != "" {
		return surrogateDir
	}
	d := filepath.Join(harness.CacheDir(), "eni-vlan-surrogate")
	if err := os.MkdirAll(d, 0o755); err != nil {
		tb.Fatal(err)
	}
	unlock, err := filelock.Lock(filepath.Join(d, ".lock"), 0o644)
	if err != nil {
		tb.Fatal(err)
	}
	defer unlock()
	cmd := exec.Command("go", "build", "-tags", SurrogateTag, "-trimpath", "-o", filepath.Join(d, "eni-vlan"), "./cmd/eni-vlan")
	cmd.Dir = harness.ModuleRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("go build -tags %s: %v\n%s", SurrogateTag, err, out)
	}
	surrogateDir = d
	return d
}
