// Package csi is aether-csi, the csi.aether.io CSI node plugin: it gives each
// pod that declares an inline csi.aether.io volume a socket directory at
// <uds-csi-root>/<pod uid>/ and bind-mounts it at the volume's target path,
// so the app's UDS socket is reachable by aether-proxy on the host at
// <uds-csi-root>/<pod uid>/<file>, the path aether-agent resolves. It serves
// the CSI Identity and Node services; there is no Controller service. See
// README.md for the invariants.
package csi

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"regexp"
	"sync"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"

	"aether.io/node/pkg/meshcontract"
)

// Volume context keys kubelet sets on an inline volume's NodePublishVolume
// (the second needs podInfoOnMount: true on the CSIDriver object).
const (
	// ContextEphemeral is "true" for an inline (ephemeral) volume.
	ContextEphemeral = "csi.storage.k8s.io/ephemeral"
	// ContextPodUID is the uid of the pod the volume is published for.
	ContextPodUID = "csi.storage.k8s.io/pod.uid"
)

// Modes of the directories the driver creates.
const (
	// RootMode is <uds-csi-root>'s mode when the driver creates it: only
	// root on the host looks inside; pods see their own directory through
	// the bind mount, which never traverses the root.
	RootMode fs.FileMode = 0o700
	// PodDirMode is <root>/<uid>/ without a volume mount group, owned
	// root:root: only uid 0 in the pod can create its socket (a non-root app
	// sets the pod's fsGroup). Never world-writable: the proxy delivers to
	// this directory (meshcontract.PodDirMode).
	PodDirMode = meshcontract.PodDirMode
	// GroupPodDirMode is <root>/<uid>/ with a volume mount group (the pod's
	// fsGroup), owned root:<group>: only the pod's users in that group can
	// create sockets, and setgid gives each socket the group
	// (meshcontract.GroupPodDirMode).
	GroupPodDirMode = meshcontract.GroupPodDirMode
	// TargetMode is the mode of a target directory the driver creates.
	TargetMode fs.FileMode = 0o750
)

// podUID accepts Kubernetes pod uids (UUIDs, and the hex hashes of static
// pods): one path segment of letters, digits and dashes.
var podUID = regexp.MustCompile(`^[0-9A-Za-z][0-9A-Za-z-]{0,63}$`)

// Mounter is the kernel's mount table, as the driver uses it.
type Mounter interface {
	// Bind bind-mounts dir at target (nosuid, nodev, noexec).
	Bind(dir, target string) error
	// Unmount unmounts target.
	Unmount(target string) error
	// MountPoints lists the mount points of this mount namespace.
	MountPoints() ([]string, error)
}

// Config is the driver's configuration (one field per flag).
type Config struct {
	// Endpoint is the unix socket the CSI services are served on.
	Endpoint string
	// NodeName is returned as the node id by NodeGetInfo.
	NodeName string
	// Root is <uds-csi-root>; it must equal aether-agent's --uds-csi-root.
	Root string
	// KubeletDir is kubelet's root directory; every target path must lie
	// under it.
	KubeletDir string
	// RegistrationDir is kubelet's plugins_registry directory, where the
	// driver serves kubelet's plugin registration; empty turns it off (an
	// external node-driver-registrar registers the driver instead).
	RegistrationDir string
	// KubeletEndpoint is the CSI socket's path as kubelet sees it, announced
	// by the registration; empty means Endpoint (the same path in the
	// driver's container and on the host).
	KubeletEndpoint string
	// Version is reported by GetPluginInfo.
	Version string
	// LogLevel is the lowest level logged.
	LogLevel slog.Level
}

// Driver implements the CSI Identity and Node services of csi.aether.io.
type Driver struct {
	csipb.UnimplementedIdentityServer
	csipb.UnimplementedNodeServer

	cfg   Config
	mount Mounter
	log   *slog.Logger
	// mu serializes publish and unpublish: they read the mount table and
	// then change it and the pod directories.
	mu sync.Mutex
}

// New returns a driver; it does no I/O.
func New(cfg Config, mount Mounter, log *slog.Logger) (*Driver, error) {
	for name, p := range map[string]string{"--" + meshcontract.UDSCSIRootFlag: cfg.Root, "--kubelet-dir": cfg.KubeletDir} {
		if !filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/" {
			return nil, fmt.Errorf("failed to configure %s %q: it must be a clean absolute path other than /", name, p)
		}
	}
	for name, p := range map[string]string{"--registration-dir": cfg.RegistrationDir, "--kubelet-registration-path": cfg.KubeletEndpoint} {
		if p != "" && (!filepath.IsAbs(p) || filepath.Clean(p) != p || p == "/") {
			return nil, fmt.Errorf("failed to configure %s %q: it must be empty or a clean absolute path other than /", name, p)
		}
	}
	if cfg.NodeName == "" {
		return nil, errors.New("failed to configure --node-name: it is empty; set it or $NODE_NAME")
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	return &Driver{cfg: cfg, mount: mount, log: log}, nil
}
