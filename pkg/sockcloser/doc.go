// Package sockcloser releases sockets outside a short-lived process's wait:
// ExecCloser starts a tiny static closer process (a few hundred bytes of
// hand-assembled machine code, no Go runtime, from a sealed memfd) that
// receives duplicates of the sockets over SCM_RIGHTS and holds them until
// the process that sent them exits. The kernel releases a socket when its
// last descriptor closes; a release that waits (an RCU grace period for an
// AF_PACKET socket, nf_tables' destroy work for a netfilter netlink socket
// after a commit that removed anything) then happens in the closer's exit,
// which nobody waits for, instead of in the plugin's, which the container
// runtime waits for. Linux only (amd64 and arm64: Supported).
//
// Users: eni-vlan's pre-flight packet sockets (enivlan/preflight) and
// aether-cni's netfilter socket after a divert commit that removed rules
// (pkg/capture). See README.md here (the contract, and the measured
// gain that keeps it) and enivlan/README.md, "Socket closer".
package sockcloser
