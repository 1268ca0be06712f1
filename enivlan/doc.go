// Package enivlan is eni-vlan, the IaaS sub-ENI CNI plugin: IPAM delegate →
// spiderpool-agent GetWorkloadEndpoint (VLAN ID + sub-ENI MAC) → VLAN link
// with the real MAC in the pod netns, up, no IP → ARP/NDP pre-flight of the
// IP/VLAN/MAC triple → IPs, routes, gratuitous ARP / unsolicited NA. A
// failed pre-flight fails closed (IPAM released, link deleted). See
// README.md for the netconf, the invariants and the error codes.
package enivlan
