//go:build aethervm

package smoketest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"aether.io/node/test/harness"
)

func TestMain(m *testing.M) { harness.Main(m) }

// TestVLANOnVeth creates a VLAN link on one end of a veth pair, moves it into
// a pod namespace, and checks the kernel kept its VLAN ID and refuses a second
// link with the same ID on the same master.
func TestVLANOnVeth(t *testing.T) {
	node := harness.NewNS(t, "node")
	fabric := harness.NewNS(t, "fab")
	pod := harness.NewNS(t, "pod")
	harness.Veth(t, node, "aetmaster", fabric, "aetfab")

	node.MustDo(t, func() error {
		master, err := netlinksafe.LinkByName("aetmaster")
		if err != nil {
			return err
		}
		v := &netlink.Vlan{
			LinkAttrs: netlink.LinkAttrs{Name: "aetv100", ParentIndex: master.Attrs().Index},
			VlanId:    100,
		}
		if err := netlink.LinkAdd(v); err != nil {
			return fmt.Errorf("failed to add VLAN 100 on aetmaster: %w", err)
		}
		dup := &netlink.Vlan{
			LinkAttrs: netlink.LinkAttrs{Name: "aetv100b", ParentIndex: master.Attrs().Index},
			VlanId:    100,
		}
		if err := netlink.LinkAdd(dup); err == nil {
			return errors.New("a second VLAN 100 on the same master was accepted, want EEXIST")
		} else if !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("second VLAN 100 on the same master: got %v, want EEXIST", err)
		}
		l, err := netlinksafe.LinkByName("aetv100")
		if err != nil {
			return err
		}
		return netlink.LinkSetNsFd(l, int(pod.Fd()))
	})

	pod.MustDo(t, func() error {
		l, err := netlinksafe.LinkByName("aetv100")
		if err != nil {
			return fmt.Errorf("VLAN link not in the pod namespace: %w", err)
		}
		v, ok := l.(*netlink.Vlan)
		if !ok {
			return fmt.Errorf("link aetv100 is a %s, want vlan", l.Type())
		}
		if v.VlanId != 100 {
			return fmt.Errorf("VLAN ID %d, want 100", v.VlanId)
		}
		if v.VlanProtocol != netlink.VLAN_PROTOCOL_8021Q {
			return fmt.Errorf("VLAN protocol %v, want 802.1Q", v.VlanProtocol)
		}
		return netlink.LinkSetUp(l)
	})
}

// TestARPTableDropsRequests installs, in the namespace playing a fabric
// gateway, an arp-family table whose rule matches ARP requests (payload
// compare on the ARP operation) for target addresses in a set (lookup), counts
// them and drops them; a neighbour on the other end of a veth then sends
// traffic, and the counter must see its ARP requests while its neighbour
// entry never resolves.
func TestARPTableDropsRequests(t *testing.T) {
	client := harness.NewNS(t, "cli")
	gw := harness.NewNS(t, "gw")
	harness.Veth(t, client, "aetcli", gw, "aetgw")
	harness.AddAddr(t, client, "aetcli", "10.99.0.1/24")
	harness.AddAddr(t, gw, "aetgw", "10.99.0.2/24")

	c, err := nftables.New(nftables.WithNetNSFd(int(gw.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	table := c.AddTable(&nftables.Table{Family: nftables.TableFamilyARP, Name: "aetsmoke"})
	chain := c.AddChain(&nftables.Chain{
		Name: "in", Table: table, Type: nftables.ChainTypeFilter,
		// The arp family numbers its hooks NF_ARP_IN=0, NF_ARP_OUT=1:
		// nftables.ChainHookInput (NF_INET_LOCAL_IN=1) would be arp output.
		Hooknum: nftables.ChainHookRef(nfARPIn), Priority: nftables.ChainPriorityFilter,
	})
	set := &nftables.Set{Table: table, Name: "blocked", KeyType: nftables.TypeIPAddr}
	if err := c.AddSet(set, []nftables.SetElement{{Key: net.ParseIP("10.99.0.2").To4()}}); err != nil {
		t.Fatal(err)
	}
	c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: []expr.Any{
		// ARP operation (offset 6) == request
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 6, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0, 1}},
		// target protocol address (offset 24 for Ethernet/IPv4) in @blocked
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 24, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: set.Name, SetID: set.ID},
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: ifname("aetgw")},
		&expr.Counter{},
		&expr.Verdict{Kind: expr.VerdictDrop},
	}})
	if err := c.Flush(); err != nil {
		t.Fatalf("failed to install the arp table: %v", err)
	}

	tables, err := c.ListTablesOfFamily(nftables.TableFamilyARP)
	if err != nil {
		t.Fatal(err)
	}
	if len(tables) != 1 || tables[0].Name != "aetsmoke" {
		t.Fatalf("arp tables %v, want [aetsmoke]", tables)
	}

	// Traffic to the gateway makes the client ARP for it.
	client.MustDo(t, func() error {
		conn, err := net.Dial("udp4", "10.99.0.2:9")
		if err != nil {
			return err
		}
		defer conn.Close()
		_, err = conn.Write([]byte("x"))
		return err
	})

	var packets uint64
	for i := 0; i < 100 && packets == 0; i++ {
		rules, err := c.GetRules(table, chain)
		if err != nil {
			t.Fatal(err)
		}
		if len(rules) != 1 {
			t.Fatalf("%d rules in arp aetsmoke in, want 1", len(rules))
		}
		for _, e := range rules[0].Exprs {
			if cnt, ok := e.(*expr.Counter); ok {
				packets = cnt.Packets
			}
		}
		if packets == 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	if packets == 0 {
		t.Fatal("the ARP request counter stayed at 0: the arp-family rule never matched the client's request")
	}

	client.MustDo(t, func() error {
		l, err := netlinksafe.LinkByName("aetcli")
		if err != nil {
			return err
		}
		// netlinksafe has no neighbour dump; retry an interrupted dump here.
		var neighs []netlink.Neigh
		for range 10 {
			neighs, err = netlink.NeighList(l.Attrs().Index, netlink.FAMILY_V4)
			if !errors.Is(err, netlink.ErrDumpInterrupted) {
				break
			}
		}
		if err != nil {
			return err
		}
		for _, n := range neighs {
			if n.IP.Equal(net.ParseIP("10.99.0.2")) && n.State&(netlink.NUD_REACHABLE|netlink.NUD_STALE|netlink.NUD_PERMANENT) != 0 {
				return fmt.Errorf("the gateway's address resolved (%s, state %#x) although its ARP requests are dropped", n.HardwareAddr, n.State)
			}
		}
		return nil
	})
}

// nfARPIn is NF_ARP_IN from linux/netfilter_arp.h (x/sys/unix lacks it).
const nfARPIn = 0

func ifname(n string) []byte {
	b := make([]byte, 16)
	copy(b, n)
	return b
}

// addVLAN creates VLAN id on master inside n, named name, up.
func addVLAN(t *testing.T, n *harness.NS, master, name string, id int) {
	t.Helper()
	n.MustDo(t, func() error {
		m, err := netlinksafe.LinkByName(master)
		if err != nil {
			return err
		}
		v := &netlink.Vlan{LinkAttrs: netlink.LinkAttrs{Name: name, ParentIndex: m.Attrs().Index}, VlanId: id}
		if err := netlink.LinkAdd(v); err != nil {
			return fmt.Errorf("failed to add VLAN %d on %s: %w", id, master, err)
		}
		return harness.SetUp(name)
	})
}

// TestLibcniMacvlanOnVLAN drives the reference macvlan + host-local chain
// (from AETHER_CNI_BIN_DIR in the VM) through libcni onto a VLAN link of the
// node's master, then connects over TCP from the pod to a gateway that
// exists only on VLAN 200 of the fabric: the frames must carry the tag.
func TestLibcniMacvlanOnVLAN(t *testing.T) {
	ctx := context.Background()
	bin := harness.ReferencePlugins(t)
	node := harness.NewNS(t, "node")
	fabric := harness.NewNS(t, "fab")
	pod := harness.NewNS(t, "pod")
	harness.Veth(t, node, "aetmaster", fabric, "aetfab")
	addVLAN(t, node, "aetmaster", "aetm200", 200)
	addVLAN(t, fabric, "aetfab", "aetf200", 200)
	harness.AddAddr(t, fabric, "aetf200", "10.98.0.1/24")

	var ln net.Listener
	fabric.MustDo(t, func() error {
		var err error
		ln, err = net.Listen("tcp4", "10.98.0.1:0")
		return err
	})
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("vlan200"))
			c.Close()
		}
	}()

	ipam, dataDir := harness.HostLocalIPAM(t, "10.98.0.0/24")
	conf := harness.ConfList(t, "smokevlan", "1.1.0", map[string]any{
		"type": "macvlan", "master": "aetm200", "mode": "bridge", "ipam": ipam,
	})
	rt := harness.NewRuntime(t, node, []string{bin}, conf)
	p := harness.Pod{ContainerID: harness.ContainerID(), NetNS: pod.Path(), Name: "p", Namespace: "ns", UID: "uid-1"}
	res, err := rt.Add(ctx, p)
	if err != nil {
		t.Fatalf("ADD: %v", err)
	}
	r, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.IPs) != 1 || !r.IPs[0].Address.Contains(net.ParseIP("10.98.0.1")) {
		t.Fatalf("ADD result IPs %v, want one address in 10.98.0.0/24", r.IPs)
	}
	pod.MustDo(t, func() error {
		c, err := net.DialTimeout("tcp4", ln.Addr().String(), 30*time.Second)
		if err != nil {
			return fmt.Errorf("failed to reach the VLAN 200 gateway from the pod: %w", err)
		}
		defer c.Close()
		buf := make([]byte, 16)
		n, err := c.Read(buf)
		if err != nil {
			return err
		}
		if string(buf[:n]) != "vlan200" {
			return fmt.Errorf("gateway answered %q", buf[:n])
		}
		return nil
	})
	if err := rt.Check(ctx, p); err != nil {
		t.Fatalf("CHECK: %v", err)
	}
	if err := rt.Del(ctx, p); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	if got := harness.Allocations(t, dataDir, "smokevlan"); len(got) != 0 {
		t.Fatalf("host-local allocations left after DEL: %v", got)
	}
	if harness.LinkExists(t, pod, "eth0") {
		t.Fatal("eth0 still in the pod after DEL")
	}
}

// TestGuestPlumbing checks what test/vm.Run promises the guest command: the
// AETHER_VM marker, an environment variable from Options.Env, one from a
// KEY=VALUE word of the kernel command line, a file from Options.Files, and
// /var/run pointing at /run. TestSmoke passes exactly these values.
func TestGuestPlumbing(t *testing.T) {
	for k, want := range map[string]string{
		"AETHER_VM":         "1",
		"AETHER_SMOKE_ENV":  "from-options",
		"AETHER_SMOKE_KARG": "from-cmdline",
	} {
		if got := os.Getenv(k); got != want {
			t.Errorf("$%s = %q, want %q", k, got, want)
		}
	}
	b, err := os.ReadFile("/etc/aether-smoke.txt")
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != "smoke-file\n" {
		t.Errorf("/etc/aether-smoke.txt holds %q", b)
	}
	if target, err := os.Readlink("/var/run"); err != nil || target != "../run" {
		t.Errorf("/var/run links to %q (%v), want ../run", target, err)
	}
}

// TestLocalhostResolves needs the guest's /etc/hosts (Go's resolver reads it).
func TestLocalhostResolves(t *testing.T) {
	addrs, err := net.LookupHost("localhost")
	if err != nil {
		t.Fatal(err)
	}
	if len(addrs) == 0 {
		t.Fatal("localhost resolved to nothing")
	}
}
