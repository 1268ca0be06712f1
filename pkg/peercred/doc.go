// Package peercred reads the credentials of the process at the other end
// of a unix socket connection (SO_PEERCRED, Linux only): the one helper
// the agent's sockets (CNI, admin, Workload API) and aether-proxy's flows
// socket check their callers' uid with. It imports nothing of the agent or
// the proxy, so both use it.
package peercred
