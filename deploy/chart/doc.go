// Package chart renders the aether-node Helm chart (the aether-node/
// directory next to this file) with a pinned helm binary. It is the one way
// tests and generators run helm: the deploy tests lint and render it, `make
// generate` writes deploy/aether-node.yaml from it, and the Kubernetes lane
// installs it.
//
// The API is small and stable:
//   - [Dir] is the chart's directory;
//   - [Helm] is the path of helm [HelmVersion], built once per machine;
//   - [Render] is `helm template` of the chart with values files;
//   - [Manifest] is deploy/aether-node.yaml: the default render with its
//     generated-file header.
//
// helm is a binary, not a library linked into this module: `go install
// helm.sh/helm/v4/cmd/helm@HelmVersion` builds it into
// harness.CacheDir()/tools/helm-<HelmVersion>/ under a file lock, so the
// Helm SDK and the Kubernetes modules it pins never enter go.mod, and a warm
// cache needs no network.
package chart
