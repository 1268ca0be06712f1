// Package handover passes a running aether-proxy's listening sockets to the
// proxy that succeeds it, over a root-only unix socket in the proxy's run
// dir, as descriptors (SCM_RIGHTS): the successor accepts on the very
// kernel sockets the old proxy bound, so no connection is refused and none
// queued is lost. The old proxy offers (Serve), the successor takes (Take),
// starts accepting, then acknowledges (Session.Ack); only then does the old
// proxy stop accepting. The protocol, its failure cases and why not
// SO_REUSEPORT: proxy/README.md "Hand-over to a successor".
package handover
