package meshcni

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/cniutil"
)

// Agent is aether-agent's CNIService as the plugin uses it
// (agentclient.Client; a fake in unit tests).
type Agent interface {
	AddPod(ctx context.Context, req *agentclient.AddPodRequest) (agentclient.AddResult, error)
	RemovePod(ctx context.Context, req *agentclient.RemovePodRequest) (agentclient.RemoveResult, error)
	ReportAddResult(ctx context.Context, req *agentclient.ReportRequest) error
	GetPod(ctx context.Context, containerID string) (*agentclient.Record, error)
	Ready(ctx context.Context) error
	// Connect starts connecting in the background, so that the connection
	// is set up while the plugin does its work before the first call.
	Connect()
	Close() error
}

// Capturer installs and verifies the divert in a netns (capture.Installer).
type Capturer interface {
	Install(nsPath string, r capture.Ruleset) error
	Verify(nsPath string, r capture.Ruleset) error
	Present(nsPath string) (bool, error)
	Remove(nsPath string, c capture.Config) error
}

// waitCloser waits for the socket closer a divert commit started, if any:
// the netfilter socket handed to it waits in its pair until the closer's
// fork, and this process's exit before that would release it here, the
// grace period on the runtime's wait again. The closer starts while the
// rest of ADD runs, so this rarely waits. A closer that could not start
// is logged at DEBUG: the socket is then released in this process's exit,
// as without a closer.
func (p *Plugin) waitCloser(log *slog.Logger) {
	in, ok := p.Capture.(capture.Installer)
	if !ok || in.Closer == nil {
		return
	}
	if err := in.Closer.Wait(); err != nil {
		log.Debug("socket closer did not start; the netfilter socket is released at exit", "error", err.Error())
	}
}

// capturer is p.Capture logging to log where it logs (capture.Installer:
// the DEBUG line of a netfilter socket its closer could not take).
func (p *Plugin) capturer(log *slog.Logger) Capturer {
	if in, ok := p.Capture.(capture.Installer); ok {
		in.Log = log
		return in
	}
	return p.Capture
}

// Pinner pins netns paths (package pin).
type Pinner interface {
	Pin(dir, containerID, nsPath string) (string, error)
	Path(dir, containerID string) string
	Unpin(path string) error
	UnpinLater(path string, delay time.Duration) error
	List(dir string) ([]string, error)
	Name(containerID string) string
}

// ReadinessProber probes the proxy's readiness endpoint inside a netns
// (readiness.Prober).
type ReadinessProber interface {
	Probe(ctx context.Context, nsPath, url string, budget time.Duration) error
}

// PIDLookup asks the container runtime for a sandbox's PID (podpid.CRI).
type PIDLookup interface {
	Lookup(ctx context.Context, endpoint, sandboxID string) (uint32, error)
}

// Plugin is aether-cni with its dependencies; cmd/aether-cni builds it
// with the real ones, unit tests with fakes. Constructing it does no I/O.
type Plugin struct {
	// Started is when the process entered main (PluginTimings.started).
	Started time.Time
	// Now is the clock.
	Now func() time.Time
	// DialAgent returns a client of the agent of cfg.
	DialAgent func(cfg *Config) (Agent, error)
	// Capture, Pins, Readiness and PIDs are the data-plane dependencies.
	Capture   Capturer
	Pins      Pinner
	Readiness ReadinessProber
	PIDs      PIDLookup
	// Stdout receives results; Stderr logs unless the netconf names a file.
	Stdout, Stderr io.Writer
}

// About is aether-cni's VERSION "about" text.
const About = "aether-cni: chained mesh CNI plugin (aether-agent registration, readiness probe, transparent-capture divert)"

// SupportedVersions are the CNI spec versions aether-cni speaks.
var SupportedVersions = version.PluginSupports("0.4.0", "1.0.0", "1.1.0")

// Verbs returns p's CNI verbs for cniutil.PluginMain.
func (p *Plugin) Verbs() cniutil.Verbs {
	return cniutil.Verbs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status, GC: p.GC}
}

func (p *Plugin) logger(cfg *Config) (*slog.Logger, func()) {
	w := p.Stderr
	closer := func() {}
	if cfg.LogFile != "" {
		if f, err := os.OpenFile(cfg.LogFile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600); err == nil {
			w, closer = f, func() { f.Close() }
		}
	}
	lvl := slog.LevelInfo
	_ = lvl.UnmarshalText([]byte(cfg.LogLevel))
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: lvl})).With("plugin", "aether-cni"), closer
}

type podIdentity struct {
	name, namespace, uid string
	sandboxID            string
}

func identity(args *skel.CmdArgs) (podIdentity, error) {
	k, err := cniutil.ParseK8sArgs(args.Args)
	if err != nil {
		return podIdentity{}, cniutil.InvalidConfigf("failed to parse CNI_ARGS: %w", err)
	}
	return podIdentity{name: k.PodName, namespace: k.PodNamespace, uid: k.PodUID, sandboxID: k.ContainerID(args.ContainerID)}, nil
}

func (id podIdentity) require() error {
	if id.name == "" || id.namespace == "" {
		return cniutil.InvalidConfigf("K8S_POD_NAME and K8S_POD_NAMESPACE missing from CNI_ARGS: aether-cni serves Kubernetes pods only (the runtime must pass them)")
	}
	return nil
}

// verb says what a CNI verb needs from its invocation.
type verb struct {
	// name is the verb in messages ("ADD").
	name string
	// chained makes a missing prevResult an error.
	chained bool
	// pod requires the Kubernetes identity in CNI_ARGS and CNI_NETNS.
	pod bool
}

var (
	verbAdd   = verb{name: "ADD", chained: true, pod: true}
	verbDel   = verb{name: "DEL"}
	verbCheck = verb{name: "CHECK", chained: true, pod: true}
)

// call is what every verb starts from: the netconf, the pod's identity
// and a logger carrying it.
type call struct {
	cfg *Config
	id  podIdentity
	log *slog.Logger
	// closeLog closes the netconf's log file (deferred by the verb).
	closeLog func()
}

// begin is the preamble of ADD, DEL and CHECK: parse the netconf (code 7),
// CNI_ARGS (code 7), check what v needs, then open the logger (so a
// rejected call opens no log file).
func (p *Plugin) begin(args *skel.CmdArgs, v verb) (*call, error) {
	cfg, err := ParseConfig(args.StdinData, v.chained)
	if err != nil {
		return nil, err
	}
	id, err := identity(args)
	if err != nil {
		return nil, err
	}
	if v.pod {
		if err := id.require(); err != nil {
			return nil, err
		}
		if args.Netns == "" {
			return nil, cniutil.InvalidConfigf("CNI_NETNS is empty: %s needs the pod's network namespace path", v.name)
		}
	}
	log, closeLog := p.logger(cfg)
	log = log.With("pod", id.namespace+"/"+id.name, "container_id", id.sandboxID)
	return &call{cfg: cfg, id: id, log: log, closeLog: closeLog}, nil
}

func podIPs(prev types.Result) ([]string, error) {
	if prev == nil {
		return nil, nil
	}
	r, err := current.NewResultFromResult(prev)
	if err != nil {
		return nil, fmt.Errorf("failed to convert prevResult: %w", err)
	}
	var ips []string
	for _, ip := range r.IPs {
		ips = append(ips, ip.Address.IP.String())
	}
	return ips, nil
}

func agentErr(err error, what string) error {
	if errors.Is(err, agentclient.ErrUnavailable) {
		return cniutil.TryAgainf("%s: %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// callTimings are the PluginTimings every agent RPC of an invocation
// carries: started, and pre_call = started -> now (the RPC is sent next).
func (p *Plugin) callTimings() *agentclient.Timings {
	return &agentclient.Timings{Started: agentclient.NewTimestamp(p.Started), PreCall: agentclient.NewDuration(p.Now().Sub(p.Started))}
}

// printPrev writes prevResult, unchanged, in the netconf's version.
func (p *Plugin) printPrev(cfg *Config) error {
	r, err := cfg.Raw.PrevResult.GetAsVersion(cfg.Raw.CNIVersion)
	if err != nil {
		return fmt.Errorf("failed to convert prevResult to version %q: %w", cfg.Raw.CNIVersion, err)
	}
	return r.PrintTo(p.Stdout)
}

func truncate(s string) string {
	if len(s) > 4000 {
		return s[:4000]
	}
	return s
}

// Del is CNI DEL: RemovePod (IGNORED is success), then the pin is released
// (after the configured delay). It needs no netns and no earlier ADD.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	c, err := p.begin(args, verbDel)
	if err != nil {
		return err
	}
	defer c.closeLog()
	cfg, id, log := c.cfg, c.id, c.log
	if id.require() == nil {
		agent, err := p.DialAgent(cfg)
		if err != nil {
			return err
		}
		defer func() { _ = agent.Close() }()
		res, err := agent.RemovePod(context.Background(), &agentclient.RemovePodRequest{
			Name: id.name, Namespace: id.namespace, ContainerID: id.sandboxID, PluginTimings: p.callTimings(),
		})
		if err != nil {
			return agentErr(err, fmt.Sprintf("failed to withdraw pod %s/%s from aether-agent (the runtime retries DEL)", id.namespace, id.name))
		}
		switch res {
		case agentclient.RemoveSuccess, agentclient.RemoveIgnored:
		default:
			return fmt.Errorf("aether-agent could not remove pod %s/%s: RemovePod answered %s", id.namespace, id.name, res)
		}
	} else {
		log.Info("no Kubernetes pod identity in CNI_ARGS; nothing to withdraw from the agent")
	}
	if cfg.PinDir != "" {
		path := p.Pins.Path(cfg.PinDir, args.ContainerID)
		if _, err := os.Lstat(path); err == nil {
			if err := p.Pins.UnpinLater(path, cfg.UnpinDelay); err != nil {
				// GC removes it later; DEL must not fail on it.
				log.Warn("failed to release netns pin", "error", err)
			}
		}
	}
	log.Info("pod deleted")
	return nil
}

// Check is CNI CHECK: the agent's record (read-only GetPod) must match the
// pod, and the netns must hold exactly the divert ADD installs (or none for
// a pod the agent does not manage).
func (p *Plugin) Check(args *skel.CmdArgs) error {
	c, err := p.begin(args, verbCheck)
	if err != nil {
		return err
	}
	defer c.closeLog()
	cfg, id := c.cfg, c.id
	agent, err := p.DialAgent(cfg)
	if err != nil {
		return err
	}
	defer func() { _ = agent.Close() }()
	rec, err := agent.GetPod(context.Background(), id.sandboxID)
	managed := err == nil && rec.Managed
	if err != nil && !errors.Is(err, agentclient.ErrNotFound) {
		return agentErr(err, fmt.Sprintf("failed to read aether-agent's record of pod %s/%s", id.namespace, id.name))
	}
	if !managed {
		present, err := p.Capture.Present(args.Netns)
		if err != nil {
			return err
		}
		if present {
			return fmt.Errorf("pod %s/%s is not mesh-managed but its netns %q holds table inet %s", id.namespace, id.name, args.Netns, capture.TableName)
		}
		return nil
	}
	pod := rec.Pod
	if pod == nil {
		pod = &agentclient.Pod{}
	}
	if pod.Name != id.name || pod.Namespace != id.namespace {
		return fmt.Errorf("aether-agent's record of container %q is pod %s/%s, want %s/%s", id.sandboxID, pod.Namespace, pod.Name, id.namespace, id.name)
	}
	wantNS := []string{args.Netns}
	if cfg.PinDir != "" {
		wantNS = append(wantNS, p.Pins.Path(cfg.PinDir, args.ContainerID))
	}
	if !slices.Contains(wantNS, pod.NetworkNamespace) {
		return fmt.Errorf("aether-agent's record of pod %s/%s names netns %q, want one of %v", id.namespace, id.name, pod.NetworkNamespace, wantNS)
	}
	ips, err := podIPs(cfg.Raw.PrevResult)
	if err != nil {
		return err
	}
	if !sameIPs(ips, pod.IPs) {
		return fmt.Errorf("aether-agent's record of pod %s/%s has IPs %v, prevResult has %v", id.namespace, id.name, pod.IPs, ips)
	}
	pc, _ := cfg.PodCapture(cfg.Raw.RuntimeConfig.PodAnnotations)
	if err := p.Capture.Verify(args.Netns, capture.Build(pc)); err != nil {
		return fmt.Errorf("capture divert of pod %s/%s differs from what ADD installs (re-run ADD): %w", id.namespace, id.name, err)
	}
	return nil
}

func sameIPs(a, b []string) bool {
	norm := func(in []string) []string {
		out := make([]string, 0, len(in))
		for _, s := range in {
			if ip, err := netip.ParseAddr(s); err == nil {
				s = ip.Unmap().String()
			}
			out = append(out, s)
		}
		slices.Sort(out)
		return out
	}
	return slices.Equal(norm(a), norm(b))
}

// Status is CNI STATUS: the agent must answer CNIService within its
// timeout. Failure is code 50 (plugin not available), as the spec asks.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	cfg, err := ParseConfig(args.StdinData, false)
	if err != nil {
		return err
	}
	agent, err := p.DialAgent(cfg)
	if err != nil {
		return &types.Error{Code: types.ErrPluginNotAvailable, Msg: err.Error()}
	}
	defer func() { _ = agent.Close() }()
	if err := agent.Ready(context.Background()); err != nil {
		return &types.Error{Code: types.ErrPluginNotAvailable, Msg: "aether-agent not ready", Details: err.Error()}
	}
	return nil
}

// GC is CNI GC: every pin whose container is not in
// cni.dev/valid-attachments is released at once.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	cfg, err := ParseConfig(args.StdinData, false)
	if err != nil {
		return err
	}
	if cfg.PinDir == "" {
		return nil
	}
	log, closeLog := p.logger(cfg)
	defer closeLog()
	valid := map[string]bool{}
	for _, a := range cfg.Raw.ValidAttachments {
		valid[p.Pins.Name(a.ContainerID)] = true
	}
	names, err := p.Pins.List(cfg.PinDir)
	if err != nil {
		return err
	}
	var errs []error
	var removed []string
	for _, n := range names {
		if valid[n] || strings.HasPrefix(n, ".") {
			continue
		}
		if err := p.Pins.Unpin(p.Pins.Path(cfg.PinDir, n)); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, n)
	}
	log.Info("gc done", "unpinned", len(removed))
	return errors.Join(errs...)
}
