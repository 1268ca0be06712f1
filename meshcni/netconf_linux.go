package meshcni

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"aether.io/node/pkg/meshcontract"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/cniutil"
)

// Defaults of the netconf.
const (
	// DefaultAgentSocket is aether-agent's CNIService socket.
	DefaultAgentSocket = "/run/aether/agent/cni.sock"
	// DefaultCRISocket is the CRI endpoint of the PID fallback.
	DefaultCRISocket = "unix:///run/containerd/containerd.sock"
	// DefaultPinDir holds the netns pins; aether-cni creates it 0700.
	DefaultPinDir = "/run/aether/netns"
	// DefaultUnpinDelay is how long a pin outlives DEL.
	DefaultUnpinDelay = 60 * time.Second
	// CaptureFailureFail and CaptureFailureOpen are the values of
	// capture_failure.
	CaptureFailureFail = "fail"
	CaptureFailureOpen = "open"
	// DefaultProbeBudget bounds the readiness probe.
	DefaultProbeBudget = 5 * time.Second
	// DefaultAgentTimeout bounds one agent RPC attempt.
	DefaultAgentTimeout = 2 * time.Second
	// DefaultAddAttempts is how often AddPod/RemovePod are tried.
	DefaultAddAttempts = 3
	// DefaultCRITimeout bounds the CRI PID lookup.
	DefaultCRITimeout = 200 * time.Millisecond
	// DefaultReportTimeout bounds ReportAddResult.
	DefaultReportTimeout = 500 * time.Millisecond
	// DefaultReadinessPath is the proxy's readiness endpoint.
	DefaultReadinessPath = meshcontract.ReadinessPath

	maxProbeBudget  = 60 * time.Second
	maxAgentTimeout = 30 * time.Second
	maxAddAttempts  = 10
	maxUnpinDelay   = 3600 * time.Second
)

// Pod annotations that adjust the divert per pod.
const (
	// AnnotationRedirectAll is "true" or "false"; anything else keeps the
	// netconf's capture.redirect_all.
	AnnotationRedirectAll = "capture.aether.io/redirect-all"
	// AnnotationExcludePorts is a comma-separated list of destination ports.
	AnnotationExcludePorts = "capture.aether.io/exclude-outbound-ports"
	// AnnotationExcludeCIDRs is a comma-separated list of IPv4/IPv6 CIDRs
	// (a bare address means /32 or /128).
	AnnotationExcludeCIDRs = "capture.aether.io/exclude-outbound-ip-ranges"
	// AnnotationExcludeInboundPorts is a comma-separated list of
	// destination ports the inbound redirect leaves alone.
	AnnotationExcludeInboundPorts = "capture.aether.io/exclude-inbound-ports"
	// AnnotationInboundPolicy is the pod's inbound policy (the agent
	// enforces it); any value but "permissive" turns the inbound redirect
	// on for the pod, because strict (and an invalid value, which the
	// agent serves as strict) cannot be enforced without it.
	AnnotationInboundPolicy = meshcontract.InboundPolicyAnnotation
)

// CaptureConf is the "capture" section of the netconf.
type CaptureConf struct {
	// CapturePort is the proxy's transparent listener port (18001).
	CapturePort *int `json:"capture_port,omitempty"`
	// OutboundPort is the proxy's outbound listener on 127.0.0.1, which
	// serves the readiness endpoint (18081).
	OutboundPort *int `json:"outbound_port,omitempty"`
	// ReadinessPath is the readiness endpoint's path (/aether/readyz).
	ReadinessPath string `json:"readiness_path,omitempty"`
	// Ports are the destination ports diverted when redirect_all is off
	// ([outbound_port] when absent).
	Ports []int `json:"ports,omitempty"`
	// RedirectAll diverts every outbound TCP/UDP port (node default).
	RedirectAll bool `json:"redirect_all,omitempty"`
	// ExcludePorts are never diverted.
	ExcludePorts []int `json:"exclude_ports,omitempty"`
	// ExcludeCIDRs are never diverted (IPv4 and IPv6).
	ExcludeCIDRs []string `json:"exclude_cidrs,omitempty"`
	// BypassMark is the SO_MARK of the proxy's own sockets (0xae7e).
	BypassMark *uint32 `json:"bypass_mark,omitempty"`
	// DivertMark is the fwmark of diverted packets (0xae7f).
	DivertMark *uint32 `json:"divert_mark,omitempty"`
	// DeliverMark is the SO_MARK of the proxy's source-preserving inbound
	// delivery sockets (0xae7d); must equal aether-proxy's -deliver-mark.
	DeliverMark *uint32 `json:"deliver_mark,omitempty"`
	// RouteTable is the policy routing table (133).
	RouteTable *int `json:"route_table,omitempty"`
	// RulePriority is the ip rule priority (133).
	RulePriority *int `json:"rule_priority,omitempty"`
	// InboundCapture turns on the inbound redirect for every pod: TCP
	// arriving from outside the pod goes to the proxy's inbound listener,
	// which enforces the pod's inbound policy (off by default; a pod
	// annotated with a strict policy gets it anyway).
	InboundCapture bool `json:"inbound_capture,omitempty"`
	// InboundPort is the proxy's transparent inbound listener (18008).
	InboundPort *int `json:"inbound_port,omitempty"`
	// HBONEPort is the proxy's HBONE listener in every pod
	// (meshcontract.HBONEPort, 15008): inbound HBONE is never redirected.
	// It must equal aether-proxy's -hbone-port.
	HBONEPort *int `json:"hbone_port,omitempty"`
	// ExcludeInboundPorts are destination ports the inbound redirect
	// leaves alone (they reach the app in plaintext whatever the policy).
	ExcludeInboundPorts []int `json:"exclude_inbound_ports,omitempty"`
	// InboundPlaintextAllowCIDRs are source ranges the inbound redirect
	// leaves alone: the node's address, so the kubelet's probes reach the
	// app under a strict policy.
	InboundPlaintextAllowCIDRs []string `json:"inbound_plaintext_allow_cidrs,omitempty"`
}

// NetConf is aether-cni's network configuration.
type NetConf struct {
	types.PluginConf

	// AgentSocket is the agent's CNIService unix socket.
	AgentSocket string `json:"agent_socket,omitempty"`
	// AgentTimeoutMs bounds each agent RPC attempt.
	AgentTimeoutMs *int `json:"agent_timeout_ms,omitempty"`
	// AddAttempts is how many times AddPod is tried on Unavailable or
	// DeadlineExceeded.
	AddAttempts *int `json:"add_attempts,omitempty"`
	// CRISocket is the CRI endpoint used for the PID when the netns path
	// carries none; "" disables the lookup.
	CRISocket *string `json:"cri_socket,omitempty"`
	// CRITimeoutMs bounds the CRI lookup.
	CRITimeoutMs *int `json:"cri_timeout_ms,omitempty"`
	// NetnsPinDisabled turns netns pinning off.
	NetnsPinDisabled bool `json:"netns_pin_disabled,omitempty"`
	// NetnsPinDir holds the pins (bind mounts), one per container.
	NetnsPinDir string `json:"netns_pin_dir,omitempty"`
	// NetnsUnpinDelaySeconds is how long a pin outlives DEL; 0 unpins at
	// once.
	NetnsUnpinDelaySeconds *int `json:"netns_unpin_delay_seconds,omitempty"`
	// ReadinessProbeDisabled skips the readiness probe.
	ReadinessProbeDisabled bool `json:"readiness_probe_disabled,omitempty"`
	// ReadinessProbeBudgetMs bounds the readiness probe.
	ReadinessProbeBudgetMs *int `json:"readiness_probe_budget_ms,omitempty"`
	// Capture configures the divert.
	Capture CaptureConf `json:"capture,omitempty"`
	// CaptureFailure is what a failed divert or a readiness probe that
	// never answers does to the ADD: "fail" (the default) or "open".
	CaptureFailure string `json:"capture_failure,omitempty"`
	// LogFile receives the plugin's logs (stderr when empty).
	LogFile string `json:"log_file,omitempty"`
	// LogLevel is debug, info, warn or error.
	LogLevel string `json:"log_level,omitempty"`

	// RuntimeConfig carries the capabilities the runtime filled in.
	RuntimeConfig struct {
		PodAnnotations map[string]string `json:"io.kubernetes.cri.pod-annotations,omitempty"`
	} `json:"runtimeConfig,omitempty"`
}

// Config is a validated netconf with every default applied.
type Config struct {
	// Raw is the parsed netconf.
	Raw *NetConf
	// AgentSocket is the agent's socket.
	AgentSocket string
	// AgentTimeout bounds one agent RPC attempt.
	AgentTimeout time.Duration
	// AddAttempts is how often AddPod and RemovePod are tried.
	AddAttempts int
	// CRISocket is "" when the CRI lookup is off.
	CRISocket string
	// CRITimeout bounds the CRI lookup.
	CRITimeout time.Duration
	// PinDir is "" when pinning is off.
	PinDir string
	// UnpinDelay is how long a pin outlives DEL (0 = unpin at DEL).
	UnpinDelay time.Duration
	// ProbeURL is the readiness endpoint.
	ProbeURL string
	// ProbeBudget bounds the probe; 0 = probe disabled.
	ProbeBudget time.Duration
	// Capture is the node-level divert (before per-pod annotations).
	Capture capture.Config
	// FailOpen is capture_failure "open": the pod starts uncaptured when
	// the divert or the readiness probe fails. false ("fail") fails the ADD.
	FailOpen bool
	// LogFile and LogLevel: see NetConf.
	LogFile, LogLevel string
}

func intOr(p *int, def int) int {
	if p == nil {
		return def
	}
	return *p
}

func port(field string, v int) (uint16, error) {
	if v < 1 || v > 65535 {
		return 0, cniutil.InvalidConfigf("invalid %s %d: must be a port number 1-65535", field, v)
	}
	return uint16(v), nil
}

// ParseConfig parses and validates stdin data. requirePrev makes a missing
// prevResult an error (ADD and CHECK: aether-cni is a chained plugin).
// Each group of fields is one step, in the order the netconf is checked.
func ParseConfig(data []byte, requirePrev bool) (*Config, error) {
	n, err := decodeNetConf(data, requirePrev)
	if err != nil {
		return nil, err
	}
	c := &Config{Raw: n, LogFile: n.LogFile, LogLevel: n.LogLevel}
	if err := c.parseAgent(n); err != nil {
		return nil, err
	}
	if err := c.parsePin(n); err != nil {
		return nil, err
	}
	if err := c.parseProbeAndCapture(n); err != nil {
		return nil, err
	}
	if err := c.parseModes(n); err != nil {
		return nil, err
	}
	return c, nil
}

// decodeNetConf decodes the netconf and its prevResult, required when
// requirePrev is set (code 7).
func decodeNetConf(data []byte, requirePrev bool) (*NetConf, error) {
	n := &NetConf{}
	if err := json.Unmarshal(data, n); err != nil {
		return nil, cniutil.InvalidConfigf("failed to parse aether-cni network configuration: %w", err)
	}
	if n.RawPrevResult != nil {
		if err := version.ParsePrevResult(&n.PluginConf); err != nil {
			return nil, cniutil.InvalidConfigf("failed to parse prevResult: %w", err)
		}
	}
	if requirePrev && n.PrevResult == nil {
		return nil, cniutil.InvalidConfigf("aether-cni must be chained after a primary plugin (for example bridge or eni-vlan) in a conflist: prevResult is missing")
	}
	return n, nil
}

// msField is the duration of the netconf field (milliseconds; def when
// absent), which must be at most max, and positive unless allowZero.
func msField(field string, p *int, def, max time.Duration, allowZero bool) (time.Duration, error) {
	v := intOr(p, int(def/time.Millisecond))
	if v < 0 || (!allowZero && v == 0) || time.Duration(v)*time.Millisecond > max {
		lo := 1
		if allowZero {
			lo = 0
		}
		return 0, cniutil.InvalidConfigf("invalid %s %d: must be %d-%d milliseconds", field, v, lo, max/time.Millisecond)
	}
	return time.Duration(v) * time.Millisecond, nil
}

// parseAgent sets how the agent and the runtime are reached: agent_socket,
// agent_timeout_ms, cri_timeout_ms, add_attempts and cri_socket.
func (c *Config) parseAgent(n *NetConf) error {
	c.AgentSocket = n.AgentSocket
	if c.AgentSocket == "" {
		c.AgentSocket = DefaultAgentSocket
	}
	if !filepath.IsAbs(c.AgentSocket) {
		return cniutil.InvalidConfigf("invalid agent_socket %q: must be an absolute path to aether-agent's unix socket", c.AgentSocket)
	}
	var err error
	if c.AgentTimeout, err = msField("agent_timeout_ms", n.AgentTimeoutMs, DefaultAgentTimeout, maxAgentTimeout, false); err != nil {
		return err
	}
	if c.CRITimeout, err = msField("cri_timeout_ms", n.CRITimeoutMs, DefaultCRITimeout, 5*time.Second, false); err != nil {
		return err
	}
	c.AddAttempts = intOr(n.AddAttempts, DefaultAddAttempts)
	if c.AddAttempts < 1 || c.AddAttempts > maxAddAttempts {
		return cniutil.InvalidConfigf("invalid add_attempts %d: must be 1-%d", c.AddAttempts, maxAddAttempts)
	}
	c.CRISocket = DefaultCRISocket
	if n.CRISocket != nil {
		c.CRISocket = *n.CRISocket
	}
	if c.CRISocket != "" && !strings.HasPrefix(c.CRISocket, "unix:///") {
		return cniutil.InvalidConfigf("invalid cri_socket %q: must be unix:///<absolute path>, or \"\" to disable the CRI PID lookup", c.CRISocket)
	}
	return nil
}

// parsePin sets the netns pins: netns_pin_dir (unless pinning is off) and
// netns_unpin_delay_seconds.
func (c *Config) parsePin(n *NetConf) error {
	if !n.NetnsPinDisabled {
		c.PinDir = n.NetnsPinDir
		if c.PinDir == "" {
			c.PinDir = DefaultPinDir
		}
		if !filepath.IsAbs(c.PinDir) {
			return cniutil.InvalidConfigf("invalid netns_pin_dir %q: must be an absolute directory path", c.PinDir)
		}
	}
	delay := intOr(n.NetnsUnpinDelaySeconds, int(DefaultUnpinDelay/time.Second))
	if delay < 0 || time.Duration(delay)*time.Second > maxUnpinDelay {
		return cniutil.InvalidConfigf("invalid netns_unpin_delay_seconds %d: must be 0-%d (0 unpins at DEL)", delay, int(maxUnpinDelay/time.Second))
	}
	c.UnpinDelay = time.Duration(delay) * time.Second
	return nil
}

// parseProbeAndCapture sets the readiness probe (its budget and URL, on
// the capture section's outbound port) and the node-level divert.
func (c *Config) parseProbeAndCapture(n *NetConf) error {
	var err error
	if !n.ReadinessProbeDisabled {
		if c.ProbeBudget, err = msField("readiness_probe_budget_ms", n.ReadinessProbeBudgetMs, DefaultProbeBudget, maxProbeBudget, false); err != nil {
			return err
		}
	}
	if c.Capture, err = parseCapture(n.Capture); err != nil {
		return err
	}
	out, err := port("capture.outbound_port", intOr(n.Capture.OutboundPort, capture.DefaultOutboundPort))
	if err != nil {
		return err
	}
	path := n.Capture.ReadinessPath
	if path == "" {
		path = DefaultReadinessPath
	}
	if !strings.HasPrefix(path, "/") {
		return cniutil.InvalidConfigf("invalid capture.readiness_path %q: must start with /", path)
	}
	c.ProbeURL = fmt.Sprintf("http://127.0.0.1:%d%s", out, path)
	if len(n.Capture.Ports) == 0 {
		// Also under redirect_all, so a pod annotated redirect-all=false
		// falls back to the outbound port.
		c.Capture.Ports = []uint16{out}
	}
	c.Capture.OutboundPort = out
	if err := c.Capture.Normalize().Validate(); err != nil {
		return cniutil.InvalidConfigf("invalid capture section: %w", err)
	}
	return nil
}

// parseModes checks capture_failure (setting FailOpen) and log_level.
func (c *Config) parseModes(n *NetConf) error {
	switch n.CaptureFailure {
	case "", CaptureFailureFail:
	case CaptureFailureOpen:
		c.FailOpen = true
	default:
		return cniutil.InvalidConfigf("invalid capture_failure %q: must be %q (the default: the ADD fails when the divert cannot be installed or the proxy never answers the readiness probe) or %q (the pod starts uncaptured and the agent serves it UNHEALTHY)", n.CaptureFailure, CaptureFailureFail, CaptureFailureOpen)
	}
	switch c.LogLevel {
	case "", "debug", "info", "warn", "error":
	default:
		return cniutil.InvalidConfigf("invalid log_level %q: must be debug, info, warn or error", c.LogLevel)
	}
	return nil
}

func parseCapture(cc CaptureConf) (capture.Config, error) {
	var c capture.Config
	var err error
	if c.CapturePort, err = port("capture.capture_port", intOr(cc.CapturePort, capture.DefaultCapturePort)); err != nil {
		return c, err
	}
	if c.Ports, err = ports("capture.ports", cc.Ports); err != nil {
		return c, err
	}
	if c.ExcludePorts, err = ports("capture.exclude_ports", cc.ExcludePorts); err != nil {
		return c, err
	}
	if c.ExcludeCIDRs, err = cidrs("capture.exclude_cidrs", cc.ExcludeCIDRs, "an IPv4 or IPv6 CIDR such as 10.96.0.0/12 or fd00::/8"); err != nil {
		return c, err
	}
	c.InboundCapture = cc.InboundCapture
	if c.InboundPort, err = port("capture.inbound_port", intOr(cc.InboundPort, capture.DefaultInboundPort)); err != nil {
		return c, err
	}
	if c.HBONEPort, err = port("capture.hbone_port", intOr(cc.HBONEPort, capture.DefaultHBONEPort)); err != nil {
		return c, err
	}
	if c.ExcludeInboundPorts, err = ports("capture.exclude_inbound_ports", cc.ExcludeInboundPorts); err != nil {
		return c, err
	}
	if c.InboundAllowCIDRs, err = cidrs("capture.inbound_plaintext_allow_cidrs", cc.InboundPlaintextAllowCIDRs,
		"an IPv4 or IPv6 CIDR or address, such as the node's 192.0.2.10"); err != nil {
		return c, err
	}
	c.RedirectAll = cc.RedirectAll
	if cc.BypassMark != nil {
		c.BypassMark = *cc.BypassMark
	}
	if cc.DivertMark != nil {
		c.DivertMark = *cc.DivertMark
	}
	if cc.DeliverMark != nil {
		c.DeliverMark = *cc.DeliverMark
	}
	c.RouteTable = intOr(cc.RouteTable, 0)
	c.RulePriority = intOr(cc.RulePriority, 0)
	if c.RouteTable < 0 || c.RouteTable == 253 || c.RouteTable == 254 || c.RouteTable == 255 {
		return c, cniutil.InvalidConfigf("invalid capture.route_table %d: must be a free table id (1-252 or 256-4294967295; not default/main/local)", c.RouteTable)
	}
	if c.RulePriority < 0 || c.RulePriority >= 32766 {
		return c, cniutil.InvalidConfigf("invalid capture.rule_priority %d: must be 1-32765 (before the main table's rule)", c.RulePriority)
	}
	if cc.BypassMark != nil && *cc.BypassMark == 0 || cc.DivertMark != nil && *cc.DivertMark == 0 || cc.DeliverMark != nil && *cc.DeliverMark == 0 {
		return c, cniutil.InvalidConfigf("invalid capture.bypass_mark/divert_mark/deliver_mark 0: marks must be non-zero")
	}
	return c, nil
}

// ports validates the entries of the netconf list field.
func ports(field string, in []int) ([]uint16, error) {
	var out []uint16
	for _, p := range in {
		v, err := port(field+" entry", p)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// cidrs parses the entries of the netconf list field; want says what an
// entry must be.
func cidrs(field string, in []string, want string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range in {
		p, err := parseCIDR(s)
		if err != nil {
			return nil, cniutil.InvalidConfigf("invalid %s entry %q: must be %s", field, s, want)
		}
		out = append(out, p)
	}
	return out, nil
}

func parseCIDR(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		return netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return p.Masked(), nil
}

// PodCapture returns the divert for one pod: the node configuration adjusted
// by the pod's annotations. Malformed annotation entries are skipped and
// returned as warnings (a typo must not leave the pod uncaptured).
func (c *Config) PodCapture(annotations map[string]string) (capture.Config, []string) {
	pc := c.Capture
	pc.Ports = append([]uint16(nil), c.Capture.Ports...)
	pc.ExcludePorts = append([]uint16(nil), c.Capture.ExcludePorts...)
	pc.ExcludeCIDRs = append([]netip.Prefix(nil), c.Capture.ExcludeCIDRs...)
	pc.ExcludeInboundPorts = append([]uint16(nil), c.Capture.ExcludeInboundPorts...)
	var warn []string
	// Strict (or an invalid value, served strict) needs the redirect; the
	// agent's default policy is not known here (see README).
	if p, _ := meshcontract.InboundPolicyOf(annotations, meshcontract.InboundPolicyPermissive); p == meshcontract.InboundPolicyStrict {
		pc.InboundCapture = true
	}
	switch v := annotations[AnnotationRedirectAll]; v {
	case "true":
		pc.RedirectAll = true
	case "false":
		pc.RedirectAll = false
	case "":
	default:
		warn = append(warn, fmt.Sprintf("annotation %s=%q ignored: want true or false", AnnotationRedirectAll, v))
	}
	pc.ExcludePorts = annotationPorts(pc.ExcludePorts, annotations, AnnotationExcludePorts, &warn)
	pc.ExcludeInboundPorts = annotationPorts(pc.ExcludeInboundPorts, annotations, AnnotationExcludeInboundPorts, &warn)
	for _, f := range splitList(annotations[AnnotationExcludeCIDRs]) {
		p, err := parseCIDR(f)
		if err != nil {
			warn = append(warn, fmt.Sprintf("annotation %s entry %q ignored: want an IPv4 or IPv6 CIDR", AnnotationExcludeCIDRs, f))
			continue
		}
		pc.ExcludeCIDRs = append(pc.ExcludeCIDRs, p)
	}
	return pc.Normalize(), warn
}

// annotationPorts appends to ports the ports listed in annotation key; a
// malformed entry is skipped with a warning.
func annotationPorts(ports []uint16, annotations map[string]string, key string, warn *[]string) []uint16 {
	for _, f := range splitList(annotations[key]) {
		v, err := strconv.Atoi(f)
		if err != nil || v < 1 || v > 65535 {
			*warn = append(*warn, fmt.Sprintf("annotation %s entry %q ignored: want a port 1-65535", key, f))
			continue
		}
		ports = append(ports, uint16(v))
	}
	return ports
}

func splitList(s string) []string {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
