package cniinstall

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path"
	"path/filepath"
	"strings"

	"aether.io/node/pkg/meshcontract"
)

// Defaults of the chained aether-cni entry; they match meshcni's netconf
// defaults and deploy/cni (checked by a test).
const (
	// DefaultAgentSocket is aether-agent's CNIService socket.
	DefaultAgentSocket = "/run/aether/agent/cni.sock"
	// DefaultPinDir holds the netns pins; aether-cni creates it 0700.
	DefaultPinDir = "/run/aether/netns"
	// DefaultSourceDir holds the plugin binaries in the installer image.
	DefaultSourceDir = "/opt/aether/bin"
	// EniVlanBinary is the optional primary plugin's binary.
	EniVlanBinary = "eni-vlan"
	// CRISocketNone as EntryOptions.CRISocket turns aether-cni's CRI PID
	// lookup off (`"cri_socket": ""`).
	CRISocketNone = "none"
)

// EntryOptions are the netconf keys of the generated aether-cni entry.
type EntryOptions struct {
	// AgentSocket is agent_socket.
	AgentSocket string
	// PinDir is netns_pin_dir.
	PinDir string
	// CRISocket is cri_socket, the runtime's CRI endpoint aether-cni asks
	// for a pod's PID when the netns path is not usable: "" leaves the
	// plugin's default (containerd's), CRISocketNone turns the lookup
	// off, anything else must be unix:///<absolute path>.
	CRISocket string
	// RedirectAll is capture.redirect_all.
	RedirectAll bool
	// LogLevel is the plugin's log_level ("" = the plugin's default).
	LogLevel string
	// CaptureFailure is capture_failure: "fail", "open" or "" (the
	// plugin's default, fail).
	CaptureFailure string
	// InboundCapture is capture.inbound_capture: the inbound redirect
	// every pod needs for a strict inbound policy.
	InboundCapture bool
	// InboundPlaintextAllowCIDRs is capture.inbound_plaintext_allow_cidrs:
	// sources (the node's address: the kubelet's probes) the inbound
	// redirect leaves alone.
	InboundPlaintextAllowCIDRs []string
	// HBONEPort is capture.hbone_port, aether-proxy's -hbone-port: the
	// port the capture never redirects. 0 or meshcontract.HBONEPort
	// (15008) leaves the key out (the plugin's default).
	HBONEPort int
}

// Entry renders the aether-cni plugin object (one line of JSON, keys in a
// fixed order), with the pod-annotations capability the per-pod capture
// annotations need.
func (o EntryOptions) Entry() ([]byte, error) {
	type capture struct {
		RedirectAll                bool     `json:"redirect_all,omitempty"`
		InboundCapture             bool     `json:"inbound_capture,omitempty"`
		InboundPlaintextAllowCIDRs []string `json:"inbound_plaintext_allow_cidrs,omitempty"`
		HBONEPort                  int      `json:"hbone_port,omitempty"`
	}
	e := struct {
		Type         string          `json:"type"`
		AgentSocket  string          `json:"agent_socket"`
		PinDir       string          `json:"netns_pin_dir"`
		CRISocket    *string         `json:"cri_socket,omitempty"`
		Capture      capture         `json:"capture"`
		Failure      string          `json:"capture_failure,omitempty"`
		LogLevel     string          `json:"log_level,omitempty"`
		Capabilities map[string]bool `json:"capabilities"`
	}{
		Type:        PluginType,
		AgentSocket: o.AgentSocket,
		PinDir:      o.PinDir,
		Capture: capture{
			RedirectAll: o.RedirectAll, InboundCapture: o.InboundCapture, InboundPlaintextAllowCIDRs: o.InboundPlaintextAllowCIDRs,
		},
		Failure:      o.CaptureFailure,
		LogLevel:     o.LogLevel,
		Capabilities: map[string]bool{"io.kubernetes.cri.pod-annotations": true},
	}
	switch cri := o.CRISocket; {
	case cri == "":
	case cri == CRISocketNone:
		e.CRISocket = new("")
	case strings.HasPrefix(cri, "unix:///") && path.Clean(strings.TrimPrefix(cri, "unix://")) == strings.TrimPrefix(cri, "unix://"):
		e.CRISocket = &cri
	default:
		return nil, fmt.Errorf("invalid CRI socket %q: must be unix:///<clean absolute path> (the runtime's CRI endpoint, such as k3s's unix:///run/k3s/containerd/containerd.sock), %s (no CRI PID lookup), or empty (the plugin's default, unix:///run/containerd/containerd.sock)", cri, CRISocketNone)
	}
	for _, p := range []struct{ key, v string }{{"agent_socket", o.AgentSocket}, {"netns_pin_dir", o.PinDir}} {
		if !filepath.IsAbs(p.v) {
			return nil, fmt.Errorf("invalid %s %q: must be an absolute path", p.key, p.v)
		}
	}
	switch o.LogLevel {
	case "", "debug", "info", "warn", "error":
	default:
		return nil, fmt.Errorf("invalid plugin log level %q: must be debug, info, warn or error", o.LogLevel)
	}
	for _, c := range o.InboundPlaintextAllowCIDRs {
		if _, err := netip.ParsePrefix(c); err != nil {
			if _, err := netip.ParseAddr(c); err != nil {
				return nil, fmt.Errorf("invalid inbound plaintext allow CIDR %q: must be an IPv4 or IPv6 CIDR or address, such as the node's 192.0.2.10", c)
			}
		}
	}
	switch {
	case o.HBONEPort < 0 || o.HBONEPort > 65535:
		return nil, fmt.Errorf("invalid HBONE port %d: must be a port number, 1-65535 (aether-proxy's -hbone-port; 0 = %d)", o.HBONEPort, meshcontract.HBONEPort)
	case o.HBONEPort != meshcontract.HBONEPort:
		e.Capture.HBONEPort = o.HBONEPort
	}
	switch o.CaptureFailure {
	case "", "fail", "open":
	default:
		return nil, fmt.Errorf("invalid capture failure policy %q: must be fail (a pod whose divert or readiness probe fails does not start) or open (it starts uncaptured)", o.CaptureFailure)
	}
	return json.Marshal(e)
}

// Options are the installer's command-line options.
type Options struct {
	// Config is the installer's configuration.
	Config Config
	// LogLevel is the installer's own log level.
	LogLevel string
	// CheckReady is probe mode (--check-ready): report whether
	// Config.ReadyFile exists and exit.
	CheckReady bool
}

// ParseFlags parses the installer's flags; usage and errors go to out.
func ParseFlags(args []string, out io.Writer) (*Options, error) {
	fs := flag.NewFlagSet("aether-cni-install", flag.ContinueOnError)
	fs.SetOutput(out)
	o := &Options{}
	var (
		entry      EntryOptions
		withVlan   bool
		pluginConf string
	)
	fs.StringVar(&o.Config.BinDir, "cni-bin-dir", DefaultBinDir, "host CNI bin dir the plugins are copied into")
	fs.StringVar(&o.Config.ConfDir, "cni-conf-dir", DefaultConfDir, "host CNI conf dir holding the primary network configuration")
	fs.StringVar(&o.Config.SourceDir, "source-dir", DefaultSourceDir, "directory of the plugin binaries in the image")
	fs.StringVar(&o.Config.StateFile, "state-file", DefaultStateFile, "file recording what to restore on uninstall (host path outside the conf dir)")
	fs.BoolVar(&withVlan, "install-eni-vlan", false, "also copy the eni-vlan plugin (aether-cni is always copied)")
	fs.StringVar(&entry.AgentSocket, "agent-socket", DefaultAgentSocket, "agent_socket of the chained aether-cni entry")
	fs.StringVar(&entry.PinDir, "netns-pin-dir", DefaultPinDir, "netns_pin_dir of the chained aether-cni entry")
	fs.StringVar(&entry.CRISocket, "cri-socket", "", "cri_socket of the chained aether-cni entry: the runtime's CRI endpoint (unix:///<path>) for the PID lookup when a netns path is not usable; none turns the lookup off; empty = the plugin's default, containerd's unix:///run/containerd/containerd.sock")
	fs.BoolVar(&entry.RedirectAll, "redirect-all", true, "capture.redirect_all of the chained aether-cni entry")
	fs.StringVar(&entry.CaptureFailure, "capture-failure", "", "capture_failure of the chained aether-cni entry: fail (a pod whose divert or readiness probe fails does not start) or open (it starts uncaptured); empty = the plugin's default, fail")
	fs.BoolVar(&entry.InboundCapture, "inbound-capture", false, "capture.inbound_capture of the chained aether-cni entry: redirect plaintext inbound TCP to the proxy (needed for a strict inbound policy)")
	var allow string
	fs.StringVar(&allow, "inbound-plaintext-allow-cidrs", "", "comma-separated capture.inbound_plaintext_allow_cidrs of the chained aether-cni entry: sources the inbound redirect leaves alone (the node's address, for the kubelet's probes)")
	fs.IntVar(&entry.HBONEPort, "hbone-port", meshcontract.HBONEPort, "capture.hbone_port of the chained aether-cni entry: the pods' HBONE port, never redirected; must equal aether-proxy's -hbone-port")
	fs.StringVar(&entry.LogLevel, "plugin-log-level", "", "log_level of the chained aether-cni entry (debug, info, warn, error; empty = plugin default)")
	fs.StringVar(&pluginConf, "plugin-config", "", "file with the whole aether-cni plugin object (JSON, \"type\": \"aether-cni\"); overrides the entry flags")
	fs.StringVar(&o.LogLevel, "log-level", "info", "installer log level: debug, info, warn or error")
	fs.StringVar(&o.Config.ReadyFile, "ready-file", "", "file that exists while aether-cni is chained (for a startup probe; empty = none)")
	fs.BoolVar(&o.CheckReady, "check-ready", false, "probe mode: exit 0 if --ready-file exists, 1 otherwise, and do nothing else")
	uninstall := fs.String("uninstall-on-exit", string(UninstallAuto),
		"on SIGTERM: auto (keep everything while the pod's DaemonSet exists and is not being deleted, a rolling update; uninstall otherwise), always, or never")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q: aether-cni-install takes flags only", strings.Join(fs.Args(), " "))
	}
	for c := range strings.SplitSeq(allow, ",") {
		if c = strings.TrimSpace(c); c != "" {
			entry.InboundPlaintextAllowCIDRs = append(entry.InboundPlaintextAllowCIDRs, c)
		}
	}
	o.Config.Binaries = []string{PluginType}
	if withVlan {
		o.Config.Binaries = append(o.Config.Binaries, EniVlanBinary)
	}
	var err error
	if pluginConf != "" {
		if o.Config.Entry, err = os.ReadFile(pluginConf); err != nil {
			return nil, fmt.Errorf("failed to read plugin config %q: %w", pluginConf, err)
		}
		if err := ValidateEntry(o.Config.Entry); err != nil {
			return nil, err
		}
		var compact bytes.Buffer
		if err := json.Compact(&compact, o.Config.Entry); err != nil {
			return nil, fmt.Errorf("failed to compact plugin config %q: %w", pluginConf, err)
		}
		o.Config.Entry = compact.Bytes()
	} else if o.Config.Entry, err = entry.Entry(); err != nil {
		return nil, err
	}
	if _, err := parseLevel(o.LogLevel); err != nil {
		return nil, err
	}
	if o.Config.UninstallOnExit, err = ParseUninstallMode(*uninstall); err != nil {
		return nil, err
	}
	return o, nil
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil || !validLevel(s) {
		return 0, fmt.Errorf("invalid log level %q: must be debug, info, warn or error", s)
	}
	return l, nil
}

func validLevel(s string) bool {
	switch s {
	case "debug", "info", "warn", "error":
		return true
	}
	return false
}

// NewLogger returns a text logger on w at level (debug, info, warn, error).
func NewLogger(w io.Writer, level string) (*slog.Logger, error) {
	l, err := parseLevel(level)
	if err != nil {
		return nil, err
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}
