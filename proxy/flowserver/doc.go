// Package flowserver serves aether-proxy's flows socket (Linux only): the
// protocol of pkg/flowapi over a unix socket opened with the agent's socket
// policy (pkg/unixsock), each peer's uid checked with SO_PEERCRED
// (pkg/peercred) against an allow list, each accepted client a subscriber
// of the proxy's telemetry.Flows hub. A client's goroutine is the only one
// that formats and writes its events, so a client that does not read holds
// up nothing but its own queue, which then drops (telemetry.FlowQueue).
package flowserver
