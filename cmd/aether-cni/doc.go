// Command aether-cni is the chained mesh CNI plugin (logic in meshcni/). It
// reports pods to aether-agent, pins their netns, probes the proxy and
// installs the transparent-capture divert. It writes results only to stdout
// and logs to stderr (or the netconf's log_file).
package main
