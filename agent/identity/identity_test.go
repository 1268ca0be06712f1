package identity

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"aether.io/node/agent/identity/identitytest"
)

var (
	td = spiffeid.RequireTrustDomainFromString("cluster.local")
	t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
)

type caSpec = identitytest.Spec

func genCA(t testing.TB, s caSpec) (certPEM, keyPEM []byte, key crypto.Signer) {
	t.Helper()
	return identitytest.CA(t, s)
}

func goodSpec() caSpec {
	return caSpec{IsCA: true, NotBefore: t0.Add(-time.Hour), NotAfter: t0.Add(365 * 24 * time.Hour), URI: "spiffe://cluster.local"}
}

func testCA(t testing.TB) *CA {
	t.Helper()
	c, k, _ := genCA(t, goodSpec())
	ca, err := ParseCA(c, k, td, t0)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func TestParseCA(t *testing.T) {
	good := goodSpec()
	notCA := good
	notCA.IsCA = false
	expired := good
	expired.NotAfter = t0.Add(-time.Minute)
	future := good
	future.NotBefore = t0.Add(time.Hour)
	otherTD := good
	otherTD.URI = "spiffe://other.example"
	noURI := good
	noURI.URI = ""
	_, otherKey, _ := genCA(t, good)
	tests := []struct {
		name    string
		spec    caSpec
		key     []byte
		wantErr string
	}{
		{name: "valid", spec: good},
		{name: "valid without SPIFFE URI", spec: noURI},
		{name: "not a CA", spec: notCA, wantErr: "not a CA certificate"},
		{name: "expired", spec: expired, wantErr: "expired at"},
		{name: "not yet valid", spec: future, wantErr: "not valid before"},
		{name: "trust domain mismatch", spec: otherTD, wantErr: `trust domain "other.example", want "cluster.local"`},
		{name: "key does not match", spec: good, key: otherKey, wantErr: "key does not match"},
		{name: "key not PEM", spec: good, key: []byte("junk"), wantErr: "no PEM block"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, k, _ := genCA(t, tt.spec)
			if tt.key != nil {
				k = tt.key
			}
			_, err := ParseCA(c, k, td, t0)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ParseCA: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ParseCA error = %v, want containing %q", err, tt.wantErr)
			}
		})
	}
	if _, err := ParseCA([]byte("junk"), nil, td, t0); err == nil {
		t.Fatal("ParseCA accepted a non-PEM certificate")
	}
}

func TestMint(t *testing.T) {
	ca := testCA(t)
	id, err := WorkloadID(td, "default", "web")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := id.String(), "spiffe://cluster.local/ns/default/sa/web"; got != want {
		t.Fatalf("id = %q, want %q", got, want)
	}
	sv, err := ca.Mint(id, t0, 4*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	c := sv.Certificates[0]
	if len(c.URIs) != 1 || c.URIs[0].String() != id.String() || len(c.DNSNames) != 0 || len(c.IPAddresses) != 0 || len(c.EmailAddresses) != 0 {
		t.Errorf("SANs = %v %v %v %v, want only URI %s", c.URIs, c.DNSNames, c.IPAddresses, c.EmailAddresses, id)
	}
	if !c.NotBefore.Equal(t0.Add(-backdate)) || !c.NotAfter.Equal(t0.Add(4*time.Hour)) {
		t.Errorf("validity = %s..%s, want %s..%s", c.NotBefore, c.NotAfter, t0.Add(-backdate), t0.Add(4*time.Hour))
	}
	if c.KeyUsage != x509.KeyUsageDigitalSignature {
		t.Errorf("key usage = %v, want digitalSignature only", c.KeyUsage)
	}
	if len(c.ExtKeyUsage) != 2 || c.ExtKeyUsage[0] != x509.ExtKeyUsageServerAuth || c.ExtKeyUsage[1] != x509.ExtKeyUsageClientAuth {
		t.Errorf("ext key usage = %v, want serverAuth, clientAuth", c.ExtKeyUsage)
	}
	if c.IsCA {
		t.Error("SVID is a CA")
	}
	if pk, ok := c.PublicKey.(*ecdsa.PublicKey); !ok || pk.Curve != elliptic.P256() {
		t.Errorf("public key = %T, want ECDSA P-256", c.PublicKey)
	}
	gotID, _, err := x509svid.Verify(sv.Certificates, ca.Bundle(), x509svid.WithTime(t0))
	if err != nil {
		t.Fatalf("x509svid.Verify: %v", err)
	}
	if gotID != id {
		t.Errorf("verified id = %s, want %s", gotID, id)
	}
	// The SVID round-trips through go-spiffe's own parser (which enforces the SVID profile).
	certPEM, keyPEM, err := sv.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x509svid.Parse(certPEM, keyPEM); err != nil {
		t.Fatalf("x509svid.Parse: %v", err)
	}
}

func TestMintClampsToCAExpiry(t *testing.T) {
	s := goodSpec()
	s.NotAfter = t0.Add(time.Hour)
	c, k, _ := genCA(t, s)
	ca, err := ParseCA(c, k, td, t0)
	if err != nil {
		t.Fatal(err)
	}
	sv, err := ca.Mint(spiffeid.RequireFromString("spiffe://cluster.local/ns/a/sa/b"), t0, 4*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if got := sv.Certificates[0].NotAfter; !got.Equal(ca.NotAfter()) {
		t.Fatalf("NotAfter = %s, want CA expiry %s", got, ca.NotAfter())
	}
	if _, err := ca.Mint(spiffeid.RequireFromString("spiffe://other.example/x"), t0, time.Hour); err == nil {
		t.Fatal("Mint accepted an ID of another trust domain")
	}
}

func TestStoreRotateAndDrop(t *testing.T) {
	now := t0
	st := NewStore(testCA(t), 4*time.Hour, func() time.Time { return now })
	web := Account{Namespace: "default", ServiceAccount: "web"}
	db := Account{Namespace: "data", ServiceAccount: "db"}

	if err := st.Sync([]Account{web, web, db}); err != nil {
		t.Fatal(err)
	}
	svids, changed := st.Snapshot()
	if len(svids) != 2 || svids[0].ID.String() != "spiffe://cluster.local/ns/data/sa/db" || svids[1].ID.String() != "spiffe://cluster.local/ns/default/sa/web" {
		t.Fatalf("snapshot = %v, want db and web", ids(svids))
	}
	first := svids[1].Certificates[0].SerialNumber

	// Before half of the lifetime nothing changes.
	now = t0.Add(time.Hour)
	if err := st.Sync([]Account{web, db}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
		t.Fatal("change signalled without rotation")
	default:
	}
	// NotBefore is backdated, so half-life is at t0 - backdate + (4h+backdate)/2.
	wantNext := t0.Add(-backdate).Add((4*time.Hour + backdate) / 2)
	if got := st.NextRotation(); !got.Equal(wantNext) {
		t.Fatalf("NextRotation = %s, want %s", got, wantNext)
	}
	now = wantNext
	if err := st.Sync([]Account{web, db}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	default:
		t.Fatal("rotation not signalled")
	}
	svids, changed = st.Snapshot()
	if svids[1].Certificates[0].SerialNumber.Cmp(first) == 0 {
		t.Fatal("web SVID not rotated at half-life")
	}
	if !svids[1].Certificates[0].NotBefore.Equal(now.Add(-backdate)) {
		t.Fatalf("rotated NotBefore = %s, want %s", svids[1].Certificates[0].NotBefore, now.Add(-backdate))
	}

	// The record of db goes: its SVID is dropped.
	if err := st.Sync([]Account{web}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	default:
		t.Fatal("drop not signalled")
	}
	svids, _ = st.Snapshot()
	if len(svids) != 1 || svids[0].ID.String() != "spiffe://cluster.local/ns/default/sa/web" {
		t.Fatalf("snapshot after drop = %v, want web only", ids(svids))
	}
	if err := st.Sync(nil); err != nil {
		t.Fatal(err)
	}
	if svids, _ = st.Snapshot(); len(svids) != 0 || !st.NextRotation().IsZero() {
		t.Fatalf("snapshot after all records gone = %v", ids(svids))
	}
}

func TestStoreInvalidAccount(t *testing.T) {
	st := NewStore(testCA(t), time.Hour, func() time.Time { return t0 })
	err := st.Sync([]Account{{Namespace: "ok", ServiceAccount: "ok"}, {Namespace: "bad/ns", ServiceAccount: "x"}})
	if err == nil {
		t.Fatal("Sync accepted an invalid namespace")
	}
	if svids, _ := st.Snapshot(); len(svids) != 1 {
		t.Fatalf("valid account not minted alongside the invalid one: %v", ids(svids))
	}
}

func ids(svids []*x509svid.SVID) []string {
	out := make([]string, len(svids))
	for i, sv := range svids {
		out[i] = sv.ID.String()
	}
	return out
}

func BenchmarkMint(b *testing.B) {
	ca := testCA(b)
	id := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/web")
	for b.Loop() {
		if _, err := ca.Mint(id, t0, 4*time.Hour); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkStoreSync100 is one full re-mint of 100 accounts (the cost of a
// rotation wave at 100 pods with distinct service accounts) plus the snapshot.
func BenchmarkStoreSync100(b *testing.B) {
	ca := testCA(b)
	accts := make([]Account, 100)
	for i := range accts {
		accts[i] = Account{Namespace: "ns", ServiceAccount: "sa-" + big.NewInt(int64(i)).String()}
	}
	for b.Loop() {
		st := NewStore(ca, 4*time.Hour, func() time.Time { return t0 })
		if err := st.Sync(accts); err != nil {
			b.Fatal(err)
		}
		if svids, _ := st.Snapshot(); len(svids) != 100 {
			b.Fatalf("got %d SVIDs", len(svids))
		}
	}
}

// TestShortTTLRotatesAfterMint: a TTL shorter than 4×backdate is backdated
// by a quarter of itself, so its rotation point is after the mint time and
// a Sync right after the mint changes nothing.
func TestShortTTLRotatesAfterMint(t *testing.T) {
	for _, ttl := range []time.Duration{2 * time.Second, time.Minute, 20 * time.Minute, 4 * time.Hour} {
		t.Run(ttl.String(), func(t *testing.T) {
			now := t0
			st := NewStore(testCA(t), ttl, func() time.Time { return now })
			a := []Account{{Namespace: "default", ServiceAccount: "web"}}
			if err := st.Sync(a); err != nil {
				t.Fatal(err)
			}
			svids, changed := st.Snapshot()
			// X.509 times have a precision of one second.
			bd := min(backdate, ttl/4)
			if got, want := svids[0].Certificates[0].NotBefore, t0.Add(-bd).Truncate(time.Second); !got.Equal(want) {
				t.Fatalf("NotBefore = %s, want %s", got, want)
			}
			next := st.NextRotation()
			if !next.After(t0) {
				t.Fatalf("NextRotation = %s, not after the mint time %s", next, t0)
			}
			if r, err := st.SyncReport(a); err != nil || r != (SyncReport{Held: 1}) {
				t.Fatalf("SyncReport right after the mint = %+v, %v; want nothing done", r, err)
			}
			select {
			case <-changed:
				t.Fatal("change signalled before the rotation point")
			default:
			}
			now = next
			if r, err := st.SyncReport(a); err != nil || r != (SyncReport{Rotated: 1, Held: 1}) {
				t.Fatalf("SyncReport at the rotation point = %+v, %v; want one rotation", r, err)
			}
		})
	}
}

func TestSyncReportCounts(t *testing.T) {
	now := t0
	st := NewStore(testCA(t), time.Hour, func() time.Time { return now })
	web, db := Account{Namespace: "a", ServiceAccount: "web"}, Account{Namespace: "a", ServiceAccount: "db"}
	bad := Account{Namespace: "bad/ns", ServiceAccount: "x"}
	tests := []struct {
		name string
		at   time.Duration
		want []Account
		rep  SyncReport
		err  bool
	}{
		{"mint two, one duplicate", 0, []Account{web, db, web}, SyncReport{Minted: 2, Held: 2}, false},
		{"drop one", time.Minute, []Account{web}, SyncReport{Dropped: 1, Held: 1}, false},
		{"invalid account fails", 2 * time.Minute, []Account{web, bad}, SyncReport{Failed: 1, Held: 1}, true},
		{"rotate at half-life", time.Hour / 2, []Account{web}, SyncReport{Rotated: 1, Held: 1}, false},
	}
	for _, tc := range tests {
		now = t0.Add(tc.at)
		r, err := st.SyncReport(tc.want)
		if (err != nil) != tc.err || r != tc.rep {
			t.Fatalf("%s: SyncReport = %+v, %v; want %+v (error %v)", tc.name, r, err, tc.rep, tc.err)
		}
	}
}

func TestMintRefusedAfterCAExpiry(t *testing.T) {
	ca := testCA(t)
	id := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/web")
	_, err := ca.Mint(id, ca.NotAfter(), time.Hour)
	if err == nil || !strings.Contains(err.Error(), "the CA expired") {
		t.Fatalf("Mint at the CA's expiry = %v; want the CA expired", err)
	}
	st := NewStore(ca, time.Hour, func() time.Time { return ca.NotAfter().Add(time.Second) })
	if r, err := st.SyncReport([]Account{{Namespace: "default", ServiceAccount: "web"}}); err == nil || r.Failed != 1 {
		t.Fatalf("SyncReport with an expired CA = %+v, %v; want one failure", r, err)
	}
}
