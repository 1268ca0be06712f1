// Package cniinstall is the CNI installer of aether-cni: it copies the plugin
// binaries into the host's CNI bin dir, chains aether-cni as the last plugin
// of the runtime's primary network configuration, repairs that chain when
// another agent rewrites the file, and on uninstall removes only what it
// added (restoring the primary byte for byte when nobody else changed it).
// See README.md for the invariants; cmd/aether-cni-install only wires it.
package cniinstall
