// Package deploy holds the deployment: the Helm chart (chart/aether-node,
// rendered by package aether.io/node/deploy/chart), the manifest generated
// from it (aether-node.yaml) and the static node conflist
// (cni/10-aether.conflist). Its tests lint and render the chart, compare the
// renders with golden files, check that every flag the chart passes exists
// in the binaries and that the rendered objects pass a server-side dry-run.
package deploy
