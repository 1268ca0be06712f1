// Package smoketest holds the kernel checks the VM lane boots to prove
// itself: a veth pair, a real 802.1Q VLAN link, an nftables table of the arp
// family that drops ARP requests, and a libcni chain run from the binaries in
// AETHER_CNI_BIN_DIR. They need 8021q, which the CI host kernel lacks, so the
// tests carry the aethervm build tag: `go test ./...` on the host sees none,
// and vm.CompileTest builds them (with -tags aethervm) for the guest.
package smoketest
