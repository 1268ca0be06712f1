package meshcontract

import (
	"io/fs"
	"path/filepath"
)

// The UDS contract between the csi.aether.io node plugin (aether-csi),
// aether-agent and aether-proxy: the driver publishes each pod's socket
// directory at PodSocketDir(<uds-csi-root>, <pod uid>), the agent resolves a
// pod's socket to <that dir>/<file>, and the proxy connects to it. All three
// binaries take the root from a flag of the same name and default, so they
// cannot drift.
//
// A pod writes its own socket directory (it is bind-mounted into the pod),
// so the proxy trusts nothing in it: it connects only to a socket (not a
// link, not another file type, one link count) found below the root without
// following any link, whose owner matches the directory as the driver made
// it (SocketOwnerMatches). Who may create the socket follows from the modes
// below: docs/csi.md.
const (
	// CSIDriver is the name of the CSI driver that carries UDS sockets.
	CSIDriver = "csi.aether.io"
	// UDSCSIRootFlag is the flag aether-agent, aether-csi and aether-proxy
	// read <uds-csi-root> from.
	UDSCSIRootFlag = "uds-csi-root"
	// DefaultUDSCSIRoot is the default <uds-csi-root>.
	DefaultUDSCSIRoot = "/run/aether/uds"

	// PodDirMode is a pod socket dir's mode when the pod has no fsGroup:
	// owned by root, so only uid 0 in the pod may create the socket.
	PodDirMode fs.FileMode = 0o700
	// GroupPodDirMode is a pod socket dir's mode with a volume mount group
	// (the pod's fsGroup): owned by root and that group, set-group-ID so
	// the socket takes the group, so any user in the group may create it.
	GroupPodDirMode = fs.ModeSetgid | 0o770
)

// PodSocketDir is the host directory of the pod with uid's sockets:
// <root>/<uid>.
func PodSocketDir(root, uid string) string { return filepath.Join(root, uid) }

// SocketOwnerMatches reports whether a socket owned by sockUID:sockGID in a
// pod socket dir owned by dirUID:dirGID with mode dirMode is one the
// driver's modes let the pod's intended user create: the dir's owner made
// it, or, in a set-group-ID dir (GroupPodDirMode), it has the dir's group.
func SocketOwnerMatches(dirMode fs.FileMode, dirUID, dirGID, sockUID, sockGID uint32) bool {
	if sockUID == dirUID {
		return true
	}
	return dirMode&fs.ModeSetgid != 0 && sockGID == dirGID
}
