// Package capture builds, installs and verifies the transparent-capture divert
// that aether-cni puts in a mesh-managed pod's network namespace: one nftables
// table of family inet (IPv4 and IPv6) plus policy routing (an fwmark ip rule
// and a route table holding a local default route on lo), for IPv4 and IPv6.
//
// The ruleset is described once, as a list of rules each carrying both its
// netlink expressions and its nft-syntax text, so the golden rendering in
// testdata/ and what the kernel receives can never drift apart. See
// meshcni/README.md for the contract with the proxy.
//
// The divert's fwmark rules are recognised by their priority (RulePriority)
// with a full-mask fwmark and a table lookup: Install replaces such a rule
// left by an earlier configuration (another divert mark or route table),
// with that table's local routes, and Remove deletes every one, so a netconf
// change between ADDs, or between an ADD and its DEL, leaves nothing behind.
// A change of RulePriority itself is not followed.
package capture
