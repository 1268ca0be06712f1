//go:build enivlan_surrogate_link

package link

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
)

// SurrogateBanner is printed by builds that use the surrogate link.
const SurrogateBanner = "TEST BUILD: enivlan_surrogate_link — pod links are macvlan (bridge) surrogates, NOT 802.1Q VLANs; never deploy this binary"

// aliasPrefix marks the VLAN ID on the surrogate link (IFLA_IFALIAS), so
// CHECK can verify it although a macvlan carries no tag.
const aliasPrefix = "eni-vlan-surrogate:vlan="

// Macvlan is the test-only Linker: a bridge-mode macvlan on the master with
// the sub-ENI MAC; the VLAN ID is recorded in the link alias.
type Macvlan struct{}

// Kind implements Linker.
func (Macvlan) Kind() string { return "macvlan-surrogate" }

// Surrogate implements Linker.
func (Macvlan) Surrogate() bool { return true }

// Add implements Linker. The VLAN ID goes into the link's alias (Alias)
// when the caller renames the link in the pod netns: one request there
// instead of a second netns entry, lookup and request here, so the
// surrogate costs what the VLAN link costs.
func (Macvlan) Add(s Spec) error {
	attrs := netlink.LinkAttrs{Name: s.TempName, ParentIndex: s.MasterIndex, MTU: s.MTU, HardwareAddr: s.MAC}
	if !s.MasterInPod {
		attrs.Namespace = netlink.NsFd(int(s.PodNS.Fd()))
	}
	m := &netlink.Macvlan{LinkAttrs: attrs, Mode: netlink.MACVLAN_MODE_BRIDGE}
	if err := netlink.LinkAdd(m); err != nil {
		return fmt.Errorf("failed to add surrogate macvlan link %q (VLAN %d): %w", s.TempName, s.VLAN, err)
	}
	return nil
}

// Alias implements Linker: the surrogate records the VLAN ID in its alias,
// so that CHECK can verify it although a macvlan carries no tag.
func (Macvlan) Alias(vlan int) string { return aliasPrefix + strconv.Itoa(vlan) }

// Verify implements Linker.
func (Macvlan) Verify(l netlink.Link, vlan int) error {
	if _, ok := l.(*netlink.Macvlan); !ok {
		return fmt.Errorf("link %q is a %s, want a macvlan surrogate", l.Attrs().Name, l.Type())
	}
	got, ok := strings.CutPrefix(l.Attrs().Alias, aliasPrefix)
	if !ok {
		return fmt.Errorf("link %q carries no surrogate VLAN record", l.Attrs().Name)
	}
	if got != strconv.Itoa(vlan) {
		return fmt.Errorf("link %q has VLAN ID %s, want %d", l.Attrs().Name, got, vlan)
	}
	return nil
}

// Default is the Linker of this build: the surrogate.
func Default() Linker { return Macvlan{} }
