// Package node holds cross-component tests of one node: the CNI chain, the
// agent and what the agent serves over xDS, all as real processes in real
// namespaces.
package node
