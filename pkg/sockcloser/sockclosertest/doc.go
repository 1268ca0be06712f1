// Package sockclosertest holds the /proc helpers that the tests of socket
// closers share (pkg/sockcloser, enivlan/preflight, pkg/capture): what a
// process's descriptors are open on, who holds a socket, waiting for a
// closer to hold what it was sent, and reaping it.
package sockclosertest
