package csi

import (
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"aether.io/node/pkg/meshcontract"
)

// Defaults of the driver's flags.
const (
	// DefaultEndpoint is the socket in kubelet's plugin directory that
	// node-driver-registrar announces to kubelet.
	DefaultEndpoint = "/var/lib/kubelet/plugins/" + meshcontract.CSIDriver + "/csi.sock"
	// DefaultKubeletDir is kubelet's --root-dir.
	DefaultKubeletDir = "/var/lib/kubelet"
	// RegistrationDirName is kubelet's plugin watcher directory under its
	// root dir; --registration-dir defaults to <kubelet-dir>/plugins_registry.
	RegistrationDirName = "plugins_registry"
)

// ParseFlags parses the driver's command line. The node name defaults to
// $NODE_NAME, else the hostname; --registration-dir to
// <kubelet-dir>/plugins_registry unless given (empty turns registration
// off); --kubelet-registration-path to --endpoint.
func ParseFlags(args []string, stderr io.Writer) (Config, error) {
	var c Config
	fs := flag.NewFlagSet("aether-csi", flag.ContinueOnError)
	fs.SetOutput(stderr)
	node := os.Getenv("NODE_NAME")
	if node == "" {
		node, _ = os.Hostname()
	}
	fs.StringVar(&c.Endpoint, "endpoint", DefaultEndpoint, "unix socket serving the CSI Identity and Node services (mode 0600; its directory at most 0755)")
	fs.StringVar(&c.NodeName, "node-name", node, "this node's name, returned as the CSI node id (default $NODE_NAME, else the hostname)")
	fs.StringVar(&c.Root, meshcontract.UDSCSIRootFlag, meshcontract.DefaultUDSCSIRoot, "root of the pods' socket dirs: <root>/<pod uid>/; must equal aether-agent's")
	fs.StringVar(&c.KubeletDir, "kubelet-dir", DefaultKubeletDir, "kubelet's root dir; every target path must lie under it")
	fs.StringVar(&c.RegistrationDir, "registration-dir", filepath.Join(DefaultKubeletDir, RegistrationDirName), "kubelet's plugin registration dir, where the driver serves "+RegistrationSocket+" (default <kubelet-dir>/"+RegistrationDirName+"); empty: no registration (use node-driver-registrar)")
	fs.StringVar(&c.KubeletEndpoint, "kubelet-registration-path", "", "the CSI socket's path as kubelet sees it, announced at registration (default: --endpoint)")
	fs.TextVar(&c.LogLevel, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["registration-dir"] {
		c.RegistrationDir = filepath.Join(c.KubeletDir, RegistrationDirName)
	}
	if c.KubeletEndpoint == "" {
		c.KubeletEndpoint = c.Endpoint
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("failed to parse arguments %q: aether-csi takes flags only", fs.Args())
	}
	return c, nil
}
