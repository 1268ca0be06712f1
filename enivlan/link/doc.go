// Package link creates and verifies eni-vlan's pod link behind one small
// interface, Linker. Production builds use a real 802.1Q VLAN link on the
// master (VLAN). Builds with the tag enivlan_surrogate_link (tests on
// kernels without 802.1Q only) use a bridge-mode macvlan carrying the
// sub-ENI MAC instead, and say so loudly; a production build cannot select
// it.
package link
