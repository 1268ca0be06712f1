// Package kubetest runs a real kube-apiserver on an embedded etcd for the
// tests that need one (the agent's pod source, the chart's server-side
// dry-run, the Kubernetes lane). Both binaries come from the scratch module
// test/kube (its own go.mod, so k8s.io/kubernetes never enters this module's
// go.mod) and are built once per machine into harness.CacheDir()/kube/<versions>/.
// A cold build takes about 8–13 minutes on 2 cores.
package kubetest
