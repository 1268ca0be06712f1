package link

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// VLAN is the production Linker: a real 802.1Q sub-interface of the master.
type VLAN struct{}

// Kind implements Linker.
func (VLAN) Kind() string { return "vlan" }

// Surrogate implements Linker.
func (VLAN) Surrogate() bool { return false }

// Add implements Linker.
func (VLAN) Add(s Spec) error {
	attrs := netlink.LinkAttrs{Name: s.TempName, ParentIndex: s.MasterIndex, MTU: s.MTU, HardwareAddr: s.MAC}
	if !s.MasterInPod {
		attrs.Namespace = netlink.NsFd(int(s.PodNS.Fd()))
	}
	v := &netlink.Vlan{LinkAttrs: attrs, VlanId: s.VLAN, VlanProtocol: netlink.VLAN_PROTOCOL_8021Q}
	if err := netlink.LinkAdd(v); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("failed to add vlan link %q (VLAN %d): %w", s.TempName, s.VLAN, ErrVLANExists)
		}
		return fmt.Errorf("failed to add vlan link %q (VLAN %d): %w", s.TempName, s.VLAN, err)
	}
	return nil
}

// Alias implements Linker: a VLAN link carries its VLAN ID in its own
// attributes and needs no alias.
func (VLAN) Alias(int) string { return "" }

// Verify implements Linker.
func (VLAN) Verify(l netlink.Link, vlan int) error {
	v, ok := l.(*netlink.Vlan)
	if !ok {
		return fmt.Errorf("link %q is a %s, want a vlan", l.Attrs().Name, l.Type())
	}
	if v.VlanId != vlan {
		return fmt.Errorf("link %q has VLAN ID %d, want %d", l.Attrs().Name, v.VlanId, vlan)
	}
	return nil
}
