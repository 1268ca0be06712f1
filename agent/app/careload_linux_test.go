package app

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"aether.io/node/agent/identity"
	"aether.io/node/agent/identity/identitytest"
	"aether.io/node/agent/services"
	"aether.io/node/agent/telemetry"
	cniv1 "aether.io/node/api/aether/cni/v1"
)

// TestCAReload follows a CA rotation through the files: the next CA added to
// --ca-trust-bundle, then swapped in as --ca-cert/--ca-key (the old one in
// the bundle); a broken file in between keeps the CA in use.
func TestCAReload(t *testing.T) {
	dir := t.TempDir()
	const td = "cluster.local"
	c := &Config{TrustDomain: td, SVIDTTL: time.Hour, WorkloadAPISocket: filepath.Join(dir, "w.sock"), CAReloadInterval: time.Second}
	c.CACertFile, c.CAKeyFile = identitytest.Files(t, dir, identitytest.Valid(td))
	c.CATrustBundleFile = filepath.Join(dir, "bundle.pem")
	write := func(path string, b []byte) {
		t.Helper()
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(c.CATrustBundleFile, nil)
	if err := c.loadCA(time.Now()); err != nil {
		t.Fatal(err)
	}
	st := identity.NewStore(c.CA, c.SVIDTTL, time.Now)
	st.SetCA(c.CA, c.CAAnchors)
	m := telemetry.NewMetrics()
	kicks := 0
	r := &caReloader{c: c, st: st, kick: func() { kicks++ }, m: m, log: slog.New(slog.DiscardHandler)}
	r.last, _ = r.read()
	oldCert, _ := os.ReadFile(c.CACertFile)
	nextCert, nextKey, _ := identitytest.CA(t, identitytest.Valid(td))

	steps := []struct {
		name              string
		change            func()
		authorities       int
		reloads, failures float64
	}{
		{"nothing changed", func() {}, 1, 0, 0},
		{"next CA trusted", func() { write(c.CATrustBundleFile, nextCert) }, 2, 1, 0},
		{"half-written key", func() { write(c.CAKeyFile, []byte("-----BEGIN")) }, 2, 1, 1},
		{"same broken files again", func() {}, 2, 1, 1},
		{"next CA signs, old one trusted", func() {
			write(c.CACertFile, nextCert)
			write(c.CAKeyFile, nextKey)
			write(c.CATrustBundleFile, oldCert)
		}, 2, 2, 1},
		{"old CA leaves the bundle", func() { write(c.CATrustBundleFile, nil) }, 1, 3, 1},
	}
	for _, s := range steps {
		s.change()
		r.reload(time.Now())
		if n := len(st.Bundle().X509Authorities()); n != s.authorities {
			t.Fatalf("%s: bundle holds %d authorities, want %d", s.name, n, s.authorities)
		}
		if got := count(t, m.CAReloads); got != s.reloads {
			t.Fatalf("%s: reloads = %v, want %v", s.name, got, s.reloads)
		}
		if got := count(t, m.CAReloadFailures); got != s.failures {
			t.Fatalf("%s: reload failures = %v, want %v", s.name, got, s.failures)
		}
	}
	if kicks != 3 {
		t.Fatalf("identity loop kicked %d times, want 3 (one per applied change)", kicks)
	}
	// The new CA signs.
	if err := st.Sync([]identity.Account{identity.AccountOf("ns", "sa")}); err != nil {
		t.Fatal(err)
	}
	svids, _ := st.Snapshot()
	if err := svids[0].Certificates[0].CheckSignatureFrom(st.Bundle().X509Authorities()[0]); err != nil {
		t.Fatalf("SVID not signed by the new CA: %v", err)
	}
}

func count(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.GetCounter().GetValue()
}

func TestTrustBundleNeedsCA(t *testing.T) {
	c := &Config{TrustDomain: "cluster.local", CATrustBundleFile: "/x.pem"}
	if err := c.loadCA(time.Now()); err == nil {
		t.Fatal("--ca-trust-bundle without --ca-cert accepted")
	}
}

// TestExternalIdentities: with identities from another provider (SPIRE)
// the listeners carry each pod's SPIFFE ID and WDS marks workloads HBONE,
// without the embedded CA's SVID minting; with neither, no HBONE.
func TestExternalIdentities(t *testing.T) {
	for _, tc := range []struct {
		name     string
		external bool
		hbone    bool
	}{{"external", true, true}, {"none", false, false}} {
		t.Run(tc.name, func(t *testing.T) {
			c := &Config{TrustDomain: "cluster.local", XDSSocket: "/x.sock", ExternalIdentities: tc.external}
			n := newNodeXDS(c, slog.New(slog.DiscardHandler), services.Metrics{})
			if n.accounts != nil {
				t.Error("SVIDs would be minted without the embedded CA")
			}
			if got := n.workloads.cfg.HBONE; got != tc.hbone {
				t.Errorf("WDS HBONE = %v, want %v", got, tc.hbone)
			}
			want := ""
			if tc.hbone {
				want = "spiffe://cluster.local/ns/shop/sa/web"
			}
			if got := n.listeners.spiffeID(&cniv1.CNIPod{Namespace: "shop", ServiceAccount: "web"}); got != want {
				t.Errorf("listener SPIFFE ID = %q, want %q", got, want)
			}
		})
	}
	dir := t.TempDir()
	c := &Config{TrustDomain: "cluster.local", SVIDTTL: time.Hour, WorkloadAPISocket: filepath.Join(dir, "w.sock"), ExternalIdentities: true}
	c.CACertFile, c.CAKeyFile = identitytest.Files(t, dir, identitytest.Valid("cluster.local"))
	if err := c.loadCA(time.Now()); err == nil || !strings.Contains(err.Error(), "--external-identities with --ca-cert") {
		t.Fatalf("--external-identities with --ca-cert: %v, want refused", err)
	}
}
