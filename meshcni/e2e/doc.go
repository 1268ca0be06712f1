// Package e2e holds aether-cni's end-to-end tests: the built aether-cni
// binary driven through libcni with a bridge + host-local → aether-cni
// conflist, against the real aether-agent binary on its socket (pod source:
// a directory of Pod manifests the tests write), in real namespaces. The
// tests live in e2e_test.go; this package has no code of its own.
package e2e
