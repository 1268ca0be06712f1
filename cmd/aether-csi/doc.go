// Command aether-csi is the csi.aether.io CSI node plugin; see csi/README.md.
package main
