// Package demo is the whole-node demo of aether-node (issue 7) as a test:
// TestNodeDemo builds a node in network namespaces (a cloud fabric with an
// anti-spoofing gateway that routes between VLANs, a fake spiderpool-agent,
// the node's master link), starts aether-agent and aether-proxy as
// processes, brings pods up through the real conflist eni-vlan → aether-cni
// with libcni, prints a short report and asserts every outcome.
//
// TestNodeDemo needs a kernel with 802.1Q. It runs when AETHER_DEMO=1 (make
// demo on such a kernel) or inside the VM lane (AETHER_VM=1); otherwise it
// skips and says so. TestNodeDemoInVM runs the same test binary in one qemu
// VM (test/vm) and is what CI runs (go test ./test/demo). See README.md.
package demo
