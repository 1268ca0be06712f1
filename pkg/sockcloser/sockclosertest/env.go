package sockclosertest

// OffTag is the build tag that leaves every architecture without a closer
// image (pkg/sockcloser/off_linux.go): a plugin built with it closes its
// sockets itself. Only measurements build with it (test/closergain).
const OffTag = "sockcloser_off"

// EmulatorEnv names the user-mode emulator (a path, for example
// /usr/bin/qemu-aarch64-static) that runs the test binary and the closers
// it starts, when they are of another architecture than the machine
// (test/arm64). CheckCloser then expects the closer's process to be the
// emulator running the closer's memfd.
const EmulatorEnv = "AETHER_TEST_EMULATOR"
