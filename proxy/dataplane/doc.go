// Package dataplane is aether-proxy's data plane: it binds each pod's
// listeners inside the pod's network namespace, answers the readiness probe,
// forwards captured TCP connections (and UDP datagrams) to their original
// destination from the pod's namespace with the bypass mark, labels every
// connection with WDS peer metadata, and drains a pod's listeners when they
// are removed.
//
// Contract with pkg/capture (the divert aether-cni installs):
//   - the capture listeners are IP_TRANSPARENT (IPV6_TRANSPARENT) sockets
//     on 0.0.0.0 and [::] at the capture port (18001), TCP and UDP; the
//     divert's TPROXY rule hands them diverted packets, so an accepted TCP
//     socket's local address IS the original destination, and a UDP
//     datagram's original destination comes from IP_ORIGDSTADDR /
//     IPV6_ORIGDSTADDR;
//   - every upstream socket carries SO_MARK = the bypass mark (0xae7e), which
//     the divert's output chain returns on, so proxied traffic is not
//     captured again;
//   - an inbound delivery to the app (HBONE, plaintext inbound) is made from
//     the client's address by a transparent socket with SO_MARK = the
//     deliver mark (0xae7d) when the divert's deliver rule routes the app's
//     replies back over lo (checked per connection, source_linux.go), else
//     from the pod's address;
//   - the readiness endpoint is GET http://127.0.0.1:18081/aether/readyz
//     (and [::1] when the pod has IPv6) inside the pod netns.
//
// Sockets are created on a locked OS thread that enters the pod's netns only
// for the socket(2) call (and the connect of an upstream dial); they are then
// served from ordinary goroutines. The package holds the pod's netns open by
// fd and watches the pinned path: when it disappears (or names another
// namespace) the pod's listeners are closed.
package dataplane
