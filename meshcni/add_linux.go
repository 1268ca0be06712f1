package meshcni

import (
	"context"
	"fmt"

	"github.com/containernetworking/cni/pkg/skel"

	"aether.io/node/meshcni/agentclient"
	"aether.io/node/meshcni/podpid"
	"aether.io/node/pkg/capture"
	"aether.io/node/pkg/cniutil"
	"aether.io/node/pkg/undo"
)

// Add is CNI ADD: identity and PID, pin, AddPod, then (managed pods only)
// the readiness probe, the capture divert and ReportAddResult; it prints
// prevResult unchanged. Its steps are the methods of addCall:
//
//	begin → dial → pid → pin → register → probe → ruleset → divert → report
//
// A step that creates something pushes its undo (pin: unpin; register:
// RemovePod; ruleset: remove the divert). A failed or refused AddPod, and
// under capture_failure "fail" a failed probe or divert, unwind the stack
// once, newest first, so the failed ADD leaves nothing: the divert (also a
// half-installed one), the agent's record and registration, and the netns
// pin. Each undo logs its own failure and the next one is still tried; the
// runtime's DEL finds nothing left.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	c, err := p.begin(args, verbAdd)
	if err != nil {
		return err
	}
	defer c.closeLog()
	defer p.waitCloser(c.log)
	a, err := p.dial(c, args)
	if err != nil {
		return err
	}
	defer func() { _ = a.agent.Close() }()
	a.lookupPID()
	a.pin()
	switch managed, err := a.register(); {
	case err != nil:
		return a.undo.Unwind(err, a.log)
	case !managed:
		// Not mesh-managed: nothing installed, nothing pinned.
		_ = a.undo.Unwind(nil, a.log) // its undos log their own failures
		a.log.Info("pod not mesh-managed; nothing installed")
		return p.printPrev(a.cfg)
	}
	// failure is why the ADD fails under capture_failure "fail"; under
	// "open" the same errors are warnings and the pod starts uncaptured.
	failure := a.probe()
	a.ruleset()
	if failure == nil {
		failure = a.divert()
	}
	a.report()
	if failure != nil {
		return a.undo.Unwind(failure, a.log)
	}
	a.log.Info("pod added", "pre_call", a.sent.PreCall.AsDuration(), "total", a.t.Total.AsDuration())
	return p.printPrev(a.cfg)
}

// addCall is one ADD in progress: the verb's preamble, the agent it talks
// to, what its steps found and made, and the one undo stack.
type addCall struct {
	*call
	p     *Plugin
	args  *skel.CmdArgs
	ctx   context.Context
	agent Agent
	ips   []string
	// pid is the sandbox's PID, nil when neither the netns path nor the
	// runtime gave it.
	pid *uint32
	// registered is the netns path the agent records: the pin, else the
	// runtime's path.
	registered string
	// sent are the PluginTimings AddPod carried; t is what ReportAddResult
	// carries.
	sent, t *agentclient.Timings
	rs      capture.Ruleset
	undo    undo.Stack
}

// dial is the step after the preamble: prevResult's IPs, then the agent's
// client, whose connection is set up (Connect) while the PID and the pin
// are worked out. It creates nothing to undo; the caller closes the client.
func (p *Plugin) dial(c *call, args *skel.CmdArgs) (*addCall, error) {
	ips, err := podIPs(c.cfg.Raw.PrevResult)
	if err != nil {
		return nil, err
	}
	agent, err := p.DialAgent(c.cfg)
	if err != nil {
		return nil, err
	}
	agent.Connect()
	return &addCall{call: c, p: p, args: args, ctx: context.Background(), agent: agent, ips: ips, registered: args.Netns}, nil
}

// lookupPID finds the sandbox's PID: from the path when it names one; else
// a short, bounded CRI call, whose failure is normal (the PID stays
// unset). It creates nothing to undo.
func (a *addCall) lookupPID() {
	step := a.p.Now()
	if v, ok := podpid.FromNetnsPath(a.args.Netns); ok {
		a.pid = &v
	} else if a.cfg.CRISocket != "" && a.p.PIDs != nil {
		cctx, cancel := context.WithTimeout(a.ctx, a.cfg.CRITimeout)
		v, err := a.p.PIDs.Lookup(cctx, a.cfg.CRISocket, a.id.sandboxID)
		cancel()
		if err == nil {
			a.pid = &v
		} else {
			a.log.Debug("no sandbox pid from CRI (normal during ADD under containerd)", "error", err)
		}
	}
	a.log.Debug("step done", "step", "pid", "duration", a.p.Now().Sub(step))
}

// pin pins the pod's netns (when pinning is on), so the agent records the
// pin; a pin that fails is a warning and the runtime's path is recorded.
// Its undo unpins.
func (a *addCall) pin() {
	step := a.p.Now()
	if a.cfg.PinDir != "" {
		if pp, err := a.p.Pins.Pin(a.cfg.PinDir, a.args.ContainerID, a.args.Netns); err != nil {
			a.log.Warn("netns pin failed; registering the runtime's netns path", "error", err)
		} else {
			a.registered = pp
			a.undo.Push(undo.Entry{Fn: func() error {
				if err := a.p.Pins.Unpin(pp); err != nil {
					a.log.Warn("failed to unpin", "error", err)
				}
				return nil
			}})
		}
	}
	a.log.Debug("step done", "step", "pin", "duration", a.p.Now().Sub(step))
}

// register is AddPod; managed is false for a pod the agent ignores (not
// mesh-managed), and an error (code 11 while the agent is unavailable)
// for one it refuses. Its undo, pushed for a managed pod, withdraws the
// pod from the agent (RemovePod: its record and registration).
func (a *addCall) register() (managed bool, err error) {
	a.sent = a.p.callTimings()
	step := a.p.Now()
	id := a.id
	res, err := a.agent.AddPod(a.ctx, &agentclient.AddPodRequest{Pod: &agentclient.Pod{
		Name: id.name, Namespace: id.namespace, UID: id.uid, NetworkNamespace: a.registered,
		ContainerID: id.sandboxID, IPs: a.ips, PID: a.pid,
	}, PluginTimings: a.sent})
	a.log.Debug("step done", "step", "add_pod", "duration", a.p.Now().Sub(step))
	if err != nil {
		return false, agentErr(err, fmt.Sprintf("failed to register pod %s/%s with aether-agent", id.namespace, id.name))
	}
	switch res {
	case agentclient.AddSuccess:
	case agentclient.AddIgnored:
		return false, nil
	default:
		return false, fmt.Errorf("aether-agent refused pod %s/%s: AddPod answered %s", id.namespace, id.name, res)
	}
	a.undo.Push(undo.Entry{Fn: func() error {
		res, err := a.agent.RemovePod(a.ctx, &agentclient.RemovePodRequest{
			Name: id.name, Namespace: id.namespace, ContainerID: id.sandboxID, PluginTimings: a.p.callTimings(),
		})
		if err != nil {
			a.log.Warn("failed to withdraw the pod from aether-agent after a failed ADD (the runtime's DEL retries)", "error", err)
		} else {
			a.log.Info("failed ADD rolled back", "remove_pod", res.String())
		}
		return nil
	}})
	a.t = &agentclient.Timings{Started: a.sent.Started, PreCall: a.sent.PreCall}
	return true, nil
}

// probe is the readiness probe of the proxy in the pod (unless disabled),
// timed into the report. A probe that fails is the ADD's failure under
// capture_failure "fail" (code 11) and a warning under "open". It creates
// nothing to undo.
func (a *addCall) probe() (failure error) {
	cfg, id := a.cfg, a.id
	if cfg.ProbeBudget <= 0 {
		return nil
	}
	step := a.p.Now()
	if err := a.p.Readiness.Probe(a.ctx, a.args.Netns, cfg.ProbeURL, cfg.ProbeBudget); err != nil {
		a.t.ReadinessProbeError = truncate(err.Error())
		if cfg.FailOpen {
			a.log.Warn("data plane not confirmed serving", "error", err)
		} else {
			failure = cniutil.TryAgainf("aether-proxy did not answer the readiness probe %s in pod %s/%s within %s (capture_failure is %q; %q starts pods uncaptured): %w",
				cfg.ProbeURL, id.namespace, id.name, cfg.ProbeBudget, CaptureFailureFail, CaptureFailureOpen, err)
		}
	}
	a.t.ReadinessProbe = agentclient.NewDuration(a.p.Now().Sub(step))
	return failure
}

// ruleset builds the pod's divert from the netconf and its annotations
// (an annotation it cannot use is a warning). Its undo removes the divert
// from the netns, also a half-installed one or one never installed (rules
// and routes go even when the table cannot).
func (a *addCall) ruleset() {
	pc, warns := a.cfg.PodCapture(a.cfg.Raw.RuntimeConfig.PodAnnotations)
	for _, w := range warns {
		a.log.Warn("pod annotation ignored", "reason", w)
	}
	a.rs = capture.Build(pc)
	a.undo.Push(undo.Entry{Fn: func() error {
		if err := a.p.capturer(a.log).Remove(a.args.Netns, a.rs.Config); err != nil {
			a.log.Warn("failed to remove the capture divert after a failed ADD", "error", err)
		}
		return nil
	}})
}

// divert installs the ruleset in the pod's netns, timed into the report. An
// install that fails is the ADD's failure under capture_failure "fail"
// (code 999) and a warning under "open" (the pod runs uncaptured). The
// ruleset step's undo removes what it installed.
func (a *addCall) divert() (failure error) {
	step := a.p.Now()
	if err := a.p.capturer(a.log).Install(a.args.Netns, a.rs); err != nil {
		a.t.CaptureDivertError = truncate(err.Error())
		if a.cfg.FailOpen {
			a.log.Warn("capture divert failed; the pod runs UNCAPTURED", "error", err)
		} else {
			failure = fmt.Errorf("failed to install the capture divert in pod %s/%s (capture_failure is %q; %q starts pods uncaptured): %w",
				a.id.namespace, a.id.name, CaptureFailureFail, CaptureFailureOpen, err)
		}
	}
	a.t.CaptureDivert = agentclient.NewDuration(a.p.Now().Sub(step))
	return failure
}

// report sends the ADD's timings and errors to the agent
// (ReportAddResult), also for an ADD about to fail; a report that fails is
// a warning. It creates nothing to undo.
func (a *addCall) report() {
	a.t.Total = agentclient.NewDuration(a.p.Now().Sub(a.p.Started))
	if err := a.agent.ReportAddResult(a.ctx, &agentclient.ReportRequest{
		ContainerID: a.id.sandboxID, Name: a.id.name, Namespace: a.id.namespace, Timings: a.t,
	}); err != nil {
		a.log.Warn("add result not reported", "error", err)
	}
}
