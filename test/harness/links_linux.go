package harness

import (
	"fmt"
	"net"
	"testing"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

func setLoUp() error {
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("failed to find lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("failed to set lo up: %w", err)
	}
	return nil
}

// Veth creates a veth pair with one end (nameA) in a and the other (nameB) in
// b, both up. Links die with their namespaces, so no cleanup is needed beyond
// the namespaces' own.
func Veth(tb testing.TB, a *NS, nameA string, b *NS, nameB string) {
	tb.Helper()
	a.MustDo(tb, func() error {
		v := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: nameA},
			PeerName:      nameB,
			PeerNamespace: netlink.NsFd(int(b.Fd())),
		}
		if err := netlink.LinkAdd(v); err != nil {
			return fmt.Errorf("failed to add veth %s/%s: %w", nameA, nameB, err)
		}
		return SetUp(nameA)
	})
	b.MustDo(tb, func() error { return SetUp(nameB) })
}

// Bridge creates a bridge named name in n, up.
func Bridge(tb testing.TB, n *NS, name string) {
	tb.Helper()
	n.MustDo(tb, func() error {
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}); err != nil {
			return fmt.Errorf("failed to add bridge %s: %w", name, err)
		}
		return SetUp(name)
	})
}

// Enslave attaches link to bridge inside n.
func Enslave(tb testing.TB, n *NS, link, bridge string) {
	tb.Helper()
	n.MustDo(tb, func() error {
		l, err := netlinksafe.LinkByName(link)
		if err != nil {
			return err
		}
		br, err := netlinksafe.LinkByName(bridge)
		if err != nil {
			return err
		}
		return netlink.LinkSetMaster(l, br)
	})
}

// Macvlan creates a bridge-mode macvlan link name on parent (both in n), up.
// The parent must be a link that carries packets (a veth end here: this kernel
// has no dummy devices).
func Macvlan(tb testing.TB, n *NS, parent, name string) {
	tb.Helper()
	n.MustDo(tb, func() error {
		p, err := netlinksafe.LinkByName(parent)
		if err != nil {
			return fmt.Errorf("failed to find macvlan parent %s: %w", parent, err)
		}
		m := &netlink.Macvlan{
			LinkAttrs: netlink.LinkAttrs{Name: name, ParentIndex: p.Attrs().Index},
			Mode:      netlink.MACVLAN_MODE_BRIDGE,
		}
		if err := netlink.LinkAdd(m); err != nil {
			return fmt.Errorf("failed to add macvlan %s: %w", name, err)
		}
		return SetUp(name)
	})
}

// SetUp sets a link up in the current namespace.
func SetUp(name string) error {
	l, err := netlinksafe.LinkByName(name)
	if err != nil {
		return fmt.Errorf("failed to find %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("failed to set %s up: %w", name, err)
	}
	return nil
}

// AddAddr adds cidr (for example "10.0.0.1/24") to link name inside n.
func AddAddr(tb testing.TB, n *NS, name, cidr string) {
	tb.Helper()
	n.MustDo(tb, func() error {
		l, err := netlinksafe.LinkByName(name)
		if err != nil {
			return err
		}
		a, err := netlink.ParseAddr(cidr)
		if err != nil {
			return err
		}
		// IPv6 test addresses skip DAD so they are usable at once.
		if a.IP.To4() == nil {
			a.Flags |= unix.IFA_F_NODAD
		}
		return netlink.AddrAdd(l, a)
	})
}

// LinkExists reports whether a link named name exists inside n.
func LinkExists(tb testing.TB, n *NS, name string) bool {
	tb.Helper()
	found := false
	n.MustDo(tb, func() error {
		_, err := netlinksafe.LinkByName(name)
		found = err == nil
		return nil
	})
	return found
}

// HardwareAddr returns the MAC of link name inside n.
func HardwareAddr(tb testing.TB, n *NS, name string) net.HardwareAddr {
	tb.Helper()
	var mac net.HardwareAddr
	n.MustDo(tb, func() error {
		l, err := netlinksafe.LinkByName(name)
		if err != nil {
			return err
		}
		mac = l.Attrs().HardwareAddr
		return nil
	})
	return mac
}
