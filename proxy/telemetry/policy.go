package telemetry

import "github.com/prometheus/client_golang/prometheus"

// policyMetrics count authorization decisions that refused a connection
// or would have (dry-run).
type policyMetrics struct {
	denied *prometheus.CounterVec
	dryRun *prometheus.CounterVec
}

func newPolicyMetrics() policyMetrics {
	return policyMetrics{
		denied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_policy_denials_total",
			Help: "Inbound connections refused by authorization policy, by the policy that decided (<namespace>/<name>, empty when no ALLOW policy matched) and reason (denied_by_policy, no_allow_match).",
		}, []string{"policy", "reason"}),
		dryRun: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aether_policy_dry_run_total",
			Help: "Inbound connections a dry-run (or AUDIT) policy would have refused, by that policy; they were not refused.",
		}, []string{"policy"}),
	}
}

// PolicyDenied counts one connection refused by authorization policy.
func (m *Metrics) PolicyDenied(policy, reason string) {
	m.policy.denied.WithLabelValues(policy, reason).Inc()
}

// PolicyDryRun counts one connection a dry-run policy would have refused.
func (m *Metrics) PolicyDryRun(policy string) { m.policy.dryRun.WithLabelValues(policy).Inc() }
