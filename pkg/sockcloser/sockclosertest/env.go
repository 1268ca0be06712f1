package sockclosertest

// OffTag is the build tag that leaves every architecture without a closer
// image (pkg/sockcloser/off_linux.go): a plugin built with it closes its
// sockets itself. Only measurements build with it (test/closergain).
const OffTag = "sockcloser_off"
