package dataplane

import (
	"net/http"
	"net/netip"
	"sync"
	"time"

	"aether.io/node/pkg/authz"
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/telemetry"
)

// Authorizer decides whether a connection reaches its destination
// workload (authz.Table).
type Authorizer interface {
	Decide(c *authz.Conn, dst authz.Target) authz.Decision
}

// reasonPolicyDenied is aether_tcp_connections_failed_total{reason} of a
// connection authorization policy refused (also counted by
// aether_policy_denials_total{policy,reason}).
const reasonPolicyDenied = "policy_denied"

// authorize applies authorization policy to an inbound connection from
// src (identity: its verified SPIFFE ID, "" for plaintext) to the pod's
// dst, before a byte reaches the app, and records the decision in info.
// It returns false when the connection must be refused (counted in the
// policy series, in Istio's with response_flags DENY and in the access
// log, and logged); a dry-run policy that would have refused it is counted
// and logged, never enforced.
func (p *pod) authorize(src netip.AddrPort, identity string, dst netip.AddrPort, info *telemetry.ConnInfo) bool {
	az := p.m.cfg.Authorizer
	if az == nil {
		return true
	}
	peer := p.lookup(dst.Addr().Unmap())
	ns := peer.Namespace
	if ns == "" {
		ns = p.namespace
	}
	d := az.Decide(&authz.Conn{Source: src.Addr().Unmap(), Identity: identity, Dest: dst}, authz.Target{Namespace: ns, Policies: peer.Policies})
	info.Policy, info.PolicyReason, info.PolicyDryRun = d.Policy, d.Reason, d.DryRun
	switch {
	case !d.Allow:
		info.PolicyDecision = telemetry.PolicyDeny
	case d.Reason == authz.ReasonAllowed:
		info.PolicyDecision = telemetry.PolicyAllow
	}
	if d.DryRun != "" {
		p.m.metrics.PolicyDryRun(d.DryRun)
		p.log.Info("dry-run authorization policy would refuse the connection", "policy", d.DryRun,
			"src", src.String(), "source_principal", identity, "dst", dst.String())
	}
	if d.Allow {
		return true
	}
	p.m.metrics.PolicyDenied(d.Policy, d.Reason)
	p.m.metrics.Failed(reasonPolicyDenied)
	p.m.metrics.Refused(*info, telemetry.ReasonDenied, errPolicyDenied{dst: dst})
	if ok, suppressed := p.policyLog.allow(time.Now()); ok {
		p.log.Info("connection refused by authorization policy", "policy", d.Policy, "reason", d.Reason,
			"src", src.String(), "source_principal", identity, "dst", dst.String(), "suppressed", suppressed)
	}
	return false
}

// denier is an established connection Reauthorize can report refused
// (its telemetry: reason denied, the policy that refused it).
type denier interface{ denied(policy, reason string) }

// policyRefusal is the answer to an HBONE stream authorization policy
// refused: 401 (as ztunnel answers), the source proxy resets its client.
func policyRefusal(dst netip.AddrPort) error {
	return &hbone.StatusError{Code: http.StatusUnauthorized, Err: errPolicyDenied{dst: dst}}
}

type errPolicyDenied struct{ dst netip.AddrPort }

func (e errPolicyDenied) Error() string {
	return "failed to deliver to " + e.dst.String() + ": refused by authorization policy"
}

// rateLog lets one line a second through (a peer can cause refusals at
// will), counting those held back.
type rateLog struct {
	mu         sync.Mutex
	next       time.Time
	suppressed uint64
}

func (r *rateLog) allow(now time.Time) (bool, uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if now.Before(r.next) {
		r.suppressed++
		return false, 0
	}
	r.next = now.Add(time.Second)
	n := r.suppressed
	r.suppressed = 0
	return true, n
}

// reasonPolicyClosed is aether_tcp_connections_failed_total{reason} of an
// established connection a policy change refused (closed, both ends reset).
const reasonPolicyClosed = "policy_closed_established"

// authorizedConn is an inbound connection that was authorized: what it
// was decided on, so a policy change can decide it again.
type authorizedConn interface {
	closer
	authorized() (authz.Conn, bool)
}

// Reauthorize decides every established inbound connection of every pod
// again with the current policies (call it after a policy or binding
// change) and closes, resetting both ends, those now refused; each is
// counted (aether_policy_denials_total and
// aether_tcp_connections_failed_total{reason="policy_closed_established"})
// and logged (rate-limited). It returns how many it closed.
func (m *Manager) Reauthorize() int {
	if m.cfg.Authorizer == nil {
		return 0
	}
	m.mu.Lock()
	pods := make([]*pod, 0, len(m.pods)+len(m.draining))
	for _, p := range m.pods {
		pods = append(pods, p)
	}
	for p := range m.draining {
		pods = append(pods, p)
	}
	m.mu.Unlock()
	closed := 0
	for _, p := range pods {
		p.mu.Lock()
		conns := make([]authorizedConn, 0, len(p.conns))
		for c := range p.conns {
			if ac, ok := c.(authorizedConn); ok {
				conns = append(conns, ac)
			}
		}
		p.mu.Unlock()
		for _, c := range conns {
			ac, ok := c.authorized()
			if !ok {
				continue
			}
			peer := p.lookup(ac.Dest.Addr().Unmap())
			ns := peer.Namespace
			if ns == "" {
				ns = p.namespace
			}
			d := m.cfg.Authorizer.Decide(&ac, authz.Target{Namespace: ns, Policies: peer.Policies})
			if d.Allow {
				continue
			}
			if dn, ok := c.(denier); ok {
				dn.denied(d.Policy, d.Reason)
			}
			// Reset in the background: the stream's reset waits for its
			// connection's writer, which a policy push must not.
			go c.abort()
			closed++
			m.metrics.PolicyDenied(d.Policy, d.Reason)
			m.metrics.Failed(reasonPolicyClosed)
			if ok, suppressed := p.policyLog.allow(time.Now()); ok {
				p.log.Info("established connection closed: authorization policy now refuses it", "policy", d.Policy, "reason", d.Reason,
					"src", ac.Source.String(), "source_principal", ac.Identity, "dst", ac.Dest.String(), "suppressed", suppressed)
			}
		}
	}
	return closed
}
