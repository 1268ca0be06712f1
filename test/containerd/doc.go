// Package containerd is the containerd lane: Debian's containerd 1.6 and
// runc, started by the test with their own root, state, socket, runc root
// and cgroup parent, inside a node netns the test creates, run pods through
// this module's conflist (bridge + host-local → aether-cni, with the real
// aether-agent), exactly as a Kubernetes node does. See containerd_test.go.
package containerd
