// Package arch holds the architecture tests of this module; it has no code of
// its own. They run `go list -deps` and read docs/CONTRIBUTING.md, and fail
// when:
//
//   - a component imports another it must not (agent and proxy never import
//     each other; xds and registry import neither; the CNI plugins import
//     neither), naming the import chain;
//   - a CNI plugin binary links a package it never needs at runtime
//     (validators, metrics, tracing SDKs, Kubernetes and etcd clients, YAML,
//     test helpers), naming the chain from the plugin's main;
//   - the layout table in docs/CONTRIBUTING.md misses a top-level directory
//     holding Go packages or docs, or names a path that does not exist,
//     naming the row to add or fix.
//
// One test parses Go files instead (go/ast) and fails when one of the verbs
// kept on one screen (TestVerbsFitOnOneScreen names each) grows past 80
// lines.
package arch
