// Package deploy holds the deployment manifests (aether-node.yaml) and the
// node conflist (cni/10-aether.conflist). Its test checks that they decode
// as the Kubernetes objects and CNI configurations they claim to be, and
// that every flag they pass exists in the binaries.
package deploy
