// Package capture builds, installs and verifies the transparent-capture divert
// that aether-cni puts in a mesh-managed pod's network namespace at CNI ADD
// (and, with SpareEstablished, one for a pod that is already running): one nftables
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
//
// A divert put into a running pod sets Config.SpareEstablished: a
// connection open before the install would otherwise have its next segment
// handed to the proxy's capture listener, which has no socket for it and
// resets it. With it, every connection the divert captures carries
// CapturedMark in conntrack, and a packet of any other connection that is
// not a new one (conntrack saw it established, or a TCP segment that is not
// a bare SYN: conntrack starts tracking in the namespace only with the
// divert's table and picks an older connection up mid-stream) leaves the
// divert untouched. Such connections stay outside the mesh until they
// close.
package capture
