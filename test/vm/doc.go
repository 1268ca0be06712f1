// Package vm is the VM (802.1Q) test lane: it boots Debian's
// linux-image-amd64 kernel under qemu (TCG, microvm, uncompressed PVH
// vmlinux) with an initramfs holding a static Go /init, the kernel modules
// the tests need (8021q, veth, nf_tables, … with their dependencies), a
// static test binary and any other binaries, runs the test binary as the
// guest's only command and reports its exit code from the "TEST-EXIT <code>"
// marker on the serial console.
//
// Use Run for one binary, RunSuite for a whole test package with this
// module's commands and the reference CNI plugins in AETHER_CNI_BIN_DIR,
// CompileTest and BuildStatic for static builds, FetchKernel for the
// kernel and its modules, and Archive for initramfs images. The lane fails,
// never skips, when qemu or the kernel package cannot be had. See README.md.
package vm
