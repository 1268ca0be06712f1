// Package scale holds cluster-scale benchmarks that span components: the
// memory the agent (Service model and workload index) and the proxy
// (proxy/peers) hold for a cluster's Services and their endpoints,
// against go-control-plane's LinearCache holding the same Address
// resources (goals in bench/goals/agent.json and proxy.json).
package scale
