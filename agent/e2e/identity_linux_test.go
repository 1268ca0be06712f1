package e2e

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"aether.io/node/agent/identity/identitytest"
	cniv1 "aether.io/node/api/aether/cni/v1"
	"aether.io/node/proxy"
	"aether.io/node/test/harness"
)

// waitSVID waits on the proxy's identity watcher (no polling) until the
// SVID of id satisfies cond.
func waitSVID(t *testing.T, p *proxy.Proxy, id spiffeid.ID, what string, cond func(*x509svid.SVID, bool) bool) *x509svid.SVID {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		ch := p.Identity.Changed()
		sv, ok := p.Identity.SVID(id)
		if cond(sv, ok) {
			return sv
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestProxyIdentityFromAgent runs aether-proxy's wiring in this process
// before the aether-agent binary exists, then starts the agent with a CA:
// the proxy's identity watch picks up the SVID of a managed pod added
// through the CNI socket (it verifies against the bundle it got), gets
// the rotation pushed, gets SVIDs again from a restarted agent (which
// wrote a new Workload API token), and drops the SVID at RemovePod.
func TestProxyIdentityFromAgent(t *testing.T) {
	harness.RequireRoot(t)
	dir := newAgentDirs(t)
	mdir := filepath.Join(dir, "manifests")
	if err := os.Mkdir(mdir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeManifest(t, mdir, "web.yaml", podYAML("shop", "web-1", "uid-web-1", true, "", ""))
	cert, key := identitytest.Files(t, dir, identitytest.Valid("cluster.local"))
	// The Workload API in a directory of its own, as the proxy mounts it.
	wsock := filepath.Join(dir, "proxy", "workload.sock")
	tokenFile := filepath.Join(dir, "proxy", "workload-api.token")

	// The proxy first: its identity watch must not block its start.
	p, err := proxy.New(proxy.Config{
		XDSTarget: "unix://" + filepath.Join(dir, "run", "xds.sock"), NodeID: "node-a", WorkloadAPISocket: wsock,
	}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("proxy Run = %v", err)
		}
	})

	args := []string{
		"--pod-manifests", mdir, "--pod-manifests-interval", "50ms",
		"--ca-cert", cert, "--ca-key", key, "--svid-ttl", "6s", "--workload-api-socket", wsock,
	}
	a := startAgent(t, dir, args...)
	a.waitReady(t)
	c := a.client(t)
	resp, err := c.AddPod(ctxT(t, 10*time.Second), &cniv1.AddPodRequest{Pod: cniPod("shop", "web-1", "cid-web-1", "10.1.0.5")})
	if err != nil || resp.GetResult() != cniv1.AddPodResponse_RESULT_SUCCESS {
		t.Fatalf("AddPod = %v, %v", resp, err)
	}
	id := spiffeid.RequireFromString("spiffe://cluster.local/ns/shop/sa/sa-web-1")
	first := waitSVID(t, p, id, "the SVID of the added pod", func(_ *x509svid.SVID, ok bool) bool { return ok })
	if _, _, err := x509svid.Verify(first.Certificates, p.Identity); err != nil {
		t.Fatalf("the SVID does not verify against the watched bundle: %v", err)
	}
	if b := p.Identity.Bundle(); b == nil || b.TrustDomain() != id.TrustDomain() {
		t.Fatalf("bundle = %v; want the bundle of %s", b, id.TrustDomain())
	}

	// 6s TTL: rotated 2.25s after the mint (half of the lifetime including
	// the 1.5s backdate), pushed to the proxy.
	serial := first.Certificates[0].SerialNumber
	waitSVID(t, p, id, "the rotated SVID", func(sv *x509svid.SVID, ok bool) bool {
		return ok && sv.Certificates[0].SerialNumber.Cmp(serial) != 0
	})
	if v := a.metric(t, "aether_agent_identity_svids"); v != 1 {
		t.Errorf("aether_agent_identity_svids = %v, want 1", v)
	}
	if v := a.metric(t, "aether_agent_identity_svid_rotations_total"); v < 1 {
		t.Errorf("aether_agent_identity_svid_rotations_total = %v, want >= 1", v)
	}
	if v := a.metric(t, "aether_agent_identity_svid_mint_failures_total"); v != 0 {
		t.Errorf("aether_agent_identity_svid_mint_failures_total = %v, want 0", v)
	}

	// The agent restarts: it writes a new token, and the proxy's watch,
	// which reads the token file again when it reconnects, gets the SVIDs
	// the new agent mints (a serial the old agent never served).
	oldToken, err := os.ReadFile(tokenFile)
	if err != nil {
		t.Fatal(err)
	}
	a.terminate(t)
	held, _ := p.Identity.SVID(id)
	a = startAgent(t, dir, args...)
	a.waitReady(t)
	if newToken, err := os.ReadFile(tokenFile); err != nil || string(newToken) == string(oldToken) {
		t.Fatalf("token after the restart: %q, %v; want a new one (was %q)", newToken, err, oldToken)
	}
	waitSVID(t, p, id, "an SVID of the restarted agent", func(sv *x509svid.SVID, ok bool) bool {
		return ok && held != nil && sv.Certificates[0].SerialNumber.Cmp(held.Certificates[0].SerialNumber) != 0
	})
	if v := a.metric(t, `aether_agent_workload_api_token_rejected_total{reason="missing"}`) + a.metric(t, `aether_agent_workload_api_token_rejected_total{reason="invalid"}`); v != 0 {
		t.Errorf("token rejections after the restart = %v, want 0 (the proxy sent the new token)", v)
	}
	c = a.client(t)

	if _, err := c.RemovePod(ctxT(t, 10*time.Second), &cniv1.RemovePodRequest{ContainerId: "cid-web-1", Name: "web-1", Namespace: "shop"}); err != nil {
		t.Fatal(err)
	}
	waitSVID(t, p, id, "the SVID dropped after RemovePod", func(_ *x509svid.SVID, ok bool) bool { return !ok })
	if p.Identity.Bundle() == nil {
		t.Fatal("bundle dropped with the last SVID")
	}
}

// TestBadCARefusedAtStart: a CA the agent cannot use is a configuration
// error: exit code 2 and ParseCA's reason, before anything is served.
func TestBadCARefusedAtStart(t *testing.T) {
	harness.RequireRoot(t)
	bin := filepath.Join(harness.BuildOwn(t, "aether-agent"), "aether-agent")
	dir := newAgentDirs(t)
	expired := identitytest.Valid("cluster.local")
	expired.NotBefore, expired.NotAfter = time.Now().Add(-48*time.Hour), time.Now().Add(-time.Hour)
	cert, key := identitytest.Files(t, dir, expired)
	sock := filepath.Join(dir, "run", "cni.sock")
	out, err := exec.Command(bin, "--cni-socket", sock, "--state-dir", filepath.Join(dir, "state"), "--node-name", "node-a",
		"--ca-cert", cert, "--ca-key", key).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 {
		t.Fatalf("aether-agent with an expired CA: %v; want exit code 2\n%s", err, out)
	}
	if !strings.Contains(string(out), "invalid --ca-cert") || !strings.Contains(string(out), "expired at") {
		t.Fatalf("output does not name the flag and the reason:\n%s", out)
	}
	if dialable(sock) {
		t.Fatal("the CNI socket serves although the agent refused to start")
	}
}
