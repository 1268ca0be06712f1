// Package multinode is the multi-node test lane: a real three-member etcd
// cluster, each member a process in its own network namespace on a bridge in
// a "fabric" namespace the test creates; three aether-agent processes, one
// per node namespace, on that cluster (--registry=etcd, each through its own
// etcd proxy); pods added through the real aether-cni; and a checker that
// follows every agent's xDS and asserts the lane's invariants while faults
// are injected (etcd members killed or partitioned, etcd without quorum or
// slow, a compaction during a watch outage, agents killed or restarted).
// Members are the test binary re-executed in member mode (see TestMain).
// Traffic is plaintext HTTP inside the test's own namespaces only.
package multinode
