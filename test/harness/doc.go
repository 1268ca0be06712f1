// Package harness is the test harness every integration test in this module
// uses: network namespaces (bind-mounted for CNI_NETNS, or held by fd for
// benchmarks), veth pairs, bridges and macvlan links inside them, a CNI
// runtime on libcni that calls plugins exactly as containerd does, the
// reference plugins from containernetworking/plugins at the version pinned in
// go.mod, builds of this module's own binaries (also stripped, as `make
// build` builds the release ones), whole-process CNI benchmarks (ExecBench:
// the plugins' latency, CPU time and peak RSS, ours and a peer interleaved
// per operation), and a leak check that fails
// the test binary when a namespace, link or mount made by a test is left.
//
// Everything a test creates is released in t.Cleanup, also when the test
// fails. Tests that need root call RequireRoot, which skips with a message
// when not root (CI runs as root, so nothing skips there).
//
// Tests never touch the machine's own network: a "node" is a namespace the
// test creates, and the CNI runtime runs the plugins inside it.
package harness
