// Package agentproc runs the real aether-agent binary for tests: on a socket
// in a temp dir, inside a netns the test made, with a directory of Pod
// manifests as its pod source that the test writes pods into.
package agentproc
