// Package containerd is the containerd lane and its runtime helper:
// Debian's containerd 1.6 and runc, started by Start with their own root,
// state, socket, runc root and cgroup parent, inside a node netns the test
// creates. The lane's tests run pods through this module's conflist
// (bridge + host-local → aether-cni, with the real aether-agent), exactly
// as a Kubernetes node does; the Kubernetes lane (test/kubernetes) starts
// its containerd through Start too.
package containerd
