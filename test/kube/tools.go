//go:build tools

// Package kube pins the Kubernetes binaries the tests run: kube-apiserver for
// the agent's pod-source tests, and kube-controller-manager, kube-scheduler
// and kubelet for the Kubernetes lane (test/kubernetes). It is a separate
// module so that k8s.io/kubernetes and its staging replaces never enter
// aether.io/node's own go.mod.
package kube

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
