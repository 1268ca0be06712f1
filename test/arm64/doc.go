// Package arm64 runs the linux/arm64 build of aether-node on any machine
// (docs/image.md): it cross-builds every binary of the image for arm64 the
// way `make image` does and runs it under qemu-user (qemu-aarch64-static,
// Debian's qemu-user-static: the tests fail without it), natively on an
// arm64 machine: each binary's --help, eni-vlan's and aether-cni's VERSION
// through the CNI protocol, and pkg/sockcloser's own tests, whose closer
// is hand-assembled arm64 machine code (pkg/sockcloser/README.md).
package arm64
