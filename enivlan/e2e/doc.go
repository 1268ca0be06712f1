// Package e2e is eni-vlan's real-VLAN end-to-end suite: the production
// binary (no surrogate tag) creates real 802.1Q links, driven by libcni,
// against the cloud-fabric fixture whose gateway sits on per-VLAN
// sub-interfaces. It is pure Go (CGO_ENABLED=0 buildable, no ip/nft exec)
// and runs in the VM lane (test/vm), where AETHER_CNI_BIN_DIR supplies
// eni-vlan and host-local. On a kernel without 802.1Q every test skips and
// says so.
package e2e
