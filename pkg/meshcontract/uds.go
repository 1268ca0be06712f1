package meshcontract

// The UDS contract between the csi.aether.io node plugin (aether-csi) and
// aether-agent: the driver publishes each pod's socket directory at
// <uds-csi-root>/<pod uid>/ and the agent resolves a pod's socket to
// <uds-csi-root>/<pod uid>/<file>. Both binaries take the root from a flag
// of the same name and default, so the two cannot drift.
const (
	// CSIDriver is the name of the CSI driver that carries UDS sockets.
	CSIDriver = "csi.aether.io"
	// UDSCSIRootFlag is the flag both aether-agent and aether-csi read
	// <uds-csi-root> from.
	UDSCSIRootFlag = "uds-csi-root"
	// DefaultUDSCSIRoot is the default <uds-csi-root>.
	DefaultUDSCSIRoot = "/run/aether/uds"
)
