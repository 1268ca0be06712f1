// Package multinode is the multi-node test lane: a real three-member etcd
// cluster, each member a process in its own network namespace on a bridge in
// a "fabric" namespace the test creates, with faults injected per member
// (kill -9 of a member or of the leader, an nftables partition of the leader).
// Members are the test binary re-executed in member mode (see TestMain).
// Traffic is plaintext HTTP inside the test's own namespaces only.
package multinode
