package link

import (
	"errors"
	"net"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
)

// Spec describes the pod link to create.
type Spec struct {
	// MasterIndex is the master's ifindex in the namespace Create runs in.
	MasterIndex int
	// MasterInPod says the master lives in the pod netns (linkInContainer).
	MasterInPod bool
	// VLAN is the 802.1Q VLAN ID (1..4094).
	VLAN int
	// MAC is the sub-ENI MAC the link carries.
	MAC net.HardwareAddr
	// MTU of the link (already resolved against the master's).
	MTU int
	// TempName is the name the link is created under; it is renamed to
	// IfName inside PodNS.
	TempName string
	// IfName is CNI_IFNAME.
	IfName string
	// PodNS is the pod's network namespace.
	PodNS ns.NetNS
}

// Linker creates and verifies pod links.
type Linker interface {
	// Kind names the implementation ("vlan" or "macvlan-surrogate").
	Kind() string
	// Surrogate reports whether this is the test-only surrogate.
	Surrogate() bool
	// Add creates the link under s.TempName directly in s.PodNS (from the
	// namespace holding the master) with MAC and MTU set, still down. It
	// returns ErrVLANExists if the kernel already has a device for this
	// master and VLAN ID.
	Add(s Spec) error
	// Alias is the alias (IFLA_IFALIAS) the link of VLAN vlan carries, set
	// by the caller in the pod netns in the same request that renames the
	// link to CNI_IFNAME (the kernel ignores an alias in the create
	// request); empty for none.
	Alias(vlan int) string
	// Verify checks, in the pod netns, that l is this Linker's kind of link
	// carrying VLAN vlan.
	Verify(l netlink.Link, vlan int) error
}

// ErrVLANExists means a device for the (master, VLAN ID) pair already
// exists, possibly in another namespace (Linux allows one per pair).
var ErrVLANExists = errors.New("a device for this master and VLAN ID already exists")
