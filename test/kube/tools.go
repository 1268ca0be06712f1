//go:build tools

// Package kube pins the kube-apiserver the agent's Kubernetes pod-source tests
// run against. It is a separate module so that k8s.io/kubernetes and its
// staging replaces never enter aether.io/node's own go.mod.
package kube

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
