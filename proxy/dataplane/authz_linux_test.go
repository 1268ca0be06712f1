package dataplane_test

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/emptypb"

	"aether.io/node/api/istio/security"
	"aether.io/node/pkg/authz"
	"aether.io/node/pkg/capture"
	"aether.io/node/proxy/dataplane"
)

// TestAuthorizationEnforced: the destination proxy decides every inbound
// connection before a byte reaches the app: over HBONE with the verified
// client principal (an ALLOW naming another principal refuses it, one
// naming the client's lets it through), in plaintext without identity (a
// principal rule never matches it); refusals are counted by policy and
// reason; a dry-run DENY is counted, never enforced.
func TestAuthorizationEnforced(t *testing.T) {
	tb := authz.NewTable()
	m, log := accessMetrics(t)
	e := setupHBONEMetrics(t, dataplane.Config{ConnectTimeout: 3e9, Authorizer: tb}, m)
	// Inbound capture on the server, so plaintext reaches its proxy too
	// (cni.inboundCapture; without it plaintext bypasses the proxy and
	// policy, see docs/policy.md).
	if err := (capture.Installer{}).Install(e.server.NS.Path(), capture.Build(capture.Config{RedirectAll: true, InboundCapture: true})); err != nil {
		t.Fatal(err)
	}
	e.server.Serve(t, 8080)
	dst := netip.AddrPortFrom(e.server.IP4, 8080)
	allowOnly := func(principal string) *security.Authorization {
		return &security.Authorization{
			Name: "allow", Namespace: "default", Scope: security.Scope_NAMESPACE, Action: security.Action_ALLOW,
			Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
				Principals: []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: principal}}},
			}}}}}},
		}
	}
	clientPrincipal := podID(e.client).TrustDomain().Name() + podID(e.client).Path()

	if _, err := roundTrip(ctx10(t), e.client, dst, "no policy"); err != nil {
		t.Fatalf("without a policy: %v", err)
	}
	if err := tb.Upsert(allowOnly("cluster.local/ns/other/sa/nobody")); err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(ctx10(t), e.client, dst, "refused"); err == nil && got != "" {
		t.Fatalf("an ALLOW naming another principal let the client through: %q", got)
	}
	if v := sum(e.metrics, "aether_policy_denials_total", map[string]string{"policy": "", "reason": authz.ReasonNoAllowMatch}); v != 1 {
		t.Errorf("denials{reason=no_allow_match} = %v, want 1", v)
	}
	// In Istio's series and the access log: the destination side refused
	// it, no ALLOW matched.
	log.await(t, map[string]any{
		"reporter": "destination", "dst_addr": dst, "reason": "denied", "policy_decision": "deny",
		"policy": "", "policy_reason": authz.ReasonNoAllowMatch, "response_flags": "DENY", "security": "mutual_tls",
		"src_principal": podID(e.client).String(),
	})
	if v := sum(e.metrics, "istio_tcp_connections_closed_total", map[string]string{"reporter": "destination", "response_flags": "DENY"}); v != 1 {
		t.Errorf("istio closed{reporter=destination,response_flags=DENY} = %v, want 1", v)
	}
	if err := tb.Upsert(allowOnly(clientPrincipal)); err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(ctx10(t), e.client, dst, "allowed"); err != nil || got == "" {
		t.Fatalf("an ALLOW naming the client's principal (%s): %q, %v", clientPrincipal, got, err)
	}
	log.await(t, map[string]any{
		"reporter": "destination", "dst_addr": dst, "reason": "client_closed", "policy_decision": "allow",
		"policy": authz.Key("default", "allow"), "policy_reason": authz.ReasonAllowed, "bytes_to_dst": len("allowed"),
	})
	// An established connection the next policy refuses is closed (an
	// app that echoes until EOF keeps it open).
	e.server.Handle(t, 8082, func(c net.Conn) { _, _ = io.Copy(c, c) })
	c, err := e.client.Dial(ctx10(t), netip.AddrPortFrom(e.server.IP4, 8082))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		t.Fatalf("the long-lived connection does not echo: %v", err)
	}
	if n := e.mgr.Reauthorize(); n != 0 {
		t.Fatalf("Reauthorize closed %d connections the policies still allow", n)
	}
	if err := tb.Upsert(&security.Authorization{Name: "deny-now", Namespace: "default", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY, Groups: []*security.Group{{}}}); err != nil {
		t.Fatal(err)
	}
	closed := e.mgr.Reauthorize()
	if closed != 1 {
		t.Fatalf("Reauthorize closed %d connections, want the one a DENY now refuses", closed)
	}
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	_ = c.CloseWrite()
	start := time.Now()
	if b, err := io.ReadAll(c); err == nil && len(b) > 0 {
		t.Fatalf("the refused connection still answered: %q", b)
	}
	t.Logf("the client saw the close %v after Reauthorize", time.Since(start))
	if v := sum(e.metrics, "aether_tcp_connections_failed_total", map[string]string{"reason": "policy_closed_established"}); v != 1 {
		t.Errorf("failed{reason=policy_closed_established} = %v, want 1", v)
	}
	// The access log names the policy that closed it.
	log.await(t, map[string]any{
		"reporter": "destination", "dst_addr": netip.AddrPortFrom(e.server.IP4, 8082), "reason": "denied",
		"policy_decision": "deny", "policy": authz.Key("default", "deny-now"), "policy_reason": authz.ReasonDenied,
		"response_flags": "DENY", "bytes_to_dst": 4,
	})
	tb.Remove(authz.Key("default", "deny-now"))

	// Plaintext (the unmanaged pod): no identity, the principal rule
	// cannot match it.
	if got, err := roundTrip(ctx10(t), e.plain, dst, "plaintext"); err == nil && got != "" {
		t.Fatalf("a plaintext connection passed a principal rule: %q", got)
	}
	if v := sum(e.metrics, "aether_policy_denials_total", map[string]string{"policy": "", "reason": authz.ReasonNoAllowMatch}); v != 2 {
		t.Errorf("denials{reason=no_allow_match} after the plaintext one = %v, want 2", v)
	}
	// A dry-run DENY of everything: counted, not enforced.
	if err := tb.Upsert(&security.Authorization{
		Name: "audit", Namespace: "default", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY, DryRun: true,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{NotPrincipals: []*security.StringMatch{{MatchType: &security.StringMatch_Presence{Presence: &emptypb.Empty{}}}}}}}}}},
	}); err != nil {
		t.Fatal(err)
	}
	if err := tb.Upsert(&security.Authorization{Name: "audit-all", Namespace: "default", Scope: security.Scope_NAMESPACE, Action: security.Action_DENY, DryRun: true, Groups: []*security.Group{{}}}); err != nil {
		t.Fatal(err)
	}
	if got, err := roundTrip(ctx10(t), e.client, dst, "audited"); err != nil || got == "" {
		t.Fatalf("a dry-run DENY blocked: %q, %v", got, err)
	}
	key := authz.Key("default", "audit-all")
	if v := sum(e.metrics, "aether_policy_dry_run_total", map[string]string{"policy": key}); v < 1 {
		t.Errorf("dry_run{policy=%s} = %v, want >= 1", key, v)
	}
	log.await(t, map[string]any{
		"reporter": "destination", "dst_addr": dst, "policy_decision": "allow", "policy_dry_run": key,
		"bytes_to_dst": len("audited"),
	})
}

// BenchmarkHBONEConnectPolicy: connect plus a one-byte round trip from the
// client pod to the server pod over HBONE, with no policy (peer) and with
// an ALLOW policy naming the client's principal that every connection is
// decided by (ours), alternated in one run; p50/p99. What the policy adds
// is the difference of the two.
func BenchmarkHBONEConnectPolicy(b *testing.B) {
	tb := authz.NewTable()
	e := setupHBONEConfig(b, dataplane.Config{ConnectTimeout: 3e9, Authorizer: tb})
	e.server.Echo(b, 9001)
	dst := netip.AddrPortFrom(e.server.IP4, 9001)
	allow := &security.Authorization{
		Name: "allow-client", Namespace: "default", Scope: security.Scope_NAMESPACE, Action: security.Action_ALLOW,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{
			Principals: []*security.StringMatch{{MatchType: &security.StringMatch_Exact{Exact: podID(e.client).TrustDomain().Name() + podID(e.client).Path()}}},
		}}}}}},
	}
	for _, mode := range []string{"peer", "ours", "peer-again", "ours-again"} {
		b.Run(mode, func(b *testing.B) {
			tb.Remove(authz.Key("default", "allow-client"))
			if mode == "ours" || mode == "ours-again" {
				if err := tb.Upsert(allow); err != nil {
					b.Fatal(err)
				}
			}
			connectLatency(b, func() *net.TCPConn { return podDial(b, e.client, dst) })
		})
	}
}
