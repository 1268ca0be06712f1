// Package readiness confirms, from inside a pod's network namespace, that the
// proxy's outbound listener serves: an HTTP GET of its readiness endpoint
// until it answers 200 or the budget runs out. A TCP connect alone is not
// enough (the kernel completes handshakes into the accept queue before any
// proxy worker accepts), and a 503 (a draining epoch) is retried.
package readiness
