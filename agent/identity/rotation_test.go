package identity

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"testing"
	"time"
)

func certOf(t testing.TB, certPEM []byte) *x509.Certificate {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestParseTrustAnchors(t *testing.T) {
	a, _, _ := genCA(t, goodSpec())
	b, _, _ := genCA(t, goodSpec())
	leafSpec := goodSpec()
	leafSpec.IsCA = false
	leaf, _, _ := genCA(t, leafSpec)
	expSpec := goodSpec()
	expSpec.NotAfter = t0.Add(-time.Minute)
	expired, _, _ := genCA(t, expSpec)
	otherSpec := goodSpec()
	otherSpec.URI = "spiffe://other.example"
	other, _, _ := genCA(t, otherSpec)
	_, key, _ := genCA(t, goodSpec())
	tests := []struct {
		name    string
		in      []byte
		want    int
		wantErr string
	}{
		{name: "empty", in: nil, want: 0},
		{name: "one", in: a, want: 1},
		{name: "two", in: append(append([]byte{}, a...), b...), want: 2},
		{name: "trailing newline", in: append(append([]byte{}, a...), '\n'), want: 1},
		{name: "not a CA", in: leaf, wantErr: "anchor 1 \"CN=test ca\": not a CA certificate"},
		{name: "expired", in: append(append([]byte{}, a...), expired...), wantErr: "anchor 2 \"CN=test ca\": expired at"},
		{name: "other trust domain", in: other, wantErr: `trust domain "other.example", want "cluster.local"`},
		{name: "a key", in: key, wantErr: `PEM block "PRIVATE KEY", want CERTIFICATE`},
		{name: "junk after", in: append(append([]byte{}, a...), []byte("junk")...), wantErr: "data after the last PEM block"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseTrustAnchors(tt.in, td, t0)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || len(got) != tt.want {
				t.Fatalf("got %d anchors, %v; want %d", len(got), err, tt.want)
			}
		})
	}
}

// TestSetCARotation walks a CA rotation: the bundle grows to both CAs and
// is signalled at once, every SVID of the old CA is due and re-minted by the
// new one, and dropping the old anchor shrinks the bundle without a re-mint.
func TestSetCARotation(t *testing.T) {
	c1, k1, _ := genCA(t, goodSpec())
	c2, k2, _ := genCA(t, goodSpec())
	ca1, err := ParseCA(c1, k1, td, t0)
	if err != nil {
		t.Fatal(err)
	}
	ca2, err := ParseCA(c2, k2, td, t0)
	if err != nil {
		t.Fatal(err)
	}
	now := t0
	st := NewStore(ca1, 4*time.Hour, func() time.Time { return now })
	accts := []Account{AccountOf("a", "x"), AccountOf("b", "")}
	if _, err := st.SyncReport(accts); err != nil {
		t.Fatal(err)
	}
	if st.SetCA(ca1, nil) {
		t.Fatal("SetCA with the CA in use and no anchors reported a change")
	}
	old, changed := st.Snapshot()

	// Step 2 of a rotation: sign with ca2, keep trusting ca1.
	if !st.SetCA(ca2, []*x509.Certificate{certOf(t, c1)}) {
		t.Fatal("SetCA with a new CA reported no change")
	}
	select {
	case <-changed:
	default:
		t.Fatal("a new bundle was not signalled")
	}
	auth := st.Bundle().X509Authorities()
	if len(auth) != 2 || !st.Bundle().HasX509Authority(certOf(t, c1)) || !st.Bundle().HasX509Authority(certOf(t, c2)) {
		t.Fatalf("bundle holds %d authorities, want both CAs", len(auth))
	}
	if next := st.NextRotation(); !next.Equal(now) {
		t.Fatalf("NextRotation = %s, want now (SVIDs of the old CA are due)", next)
	}
	rep, err := st.SyncReport(accts)
	if err != nil || rep.Rotated != 2 || rep.Minted != 0 {
		t.Fatalf("sync after the new CA = %+v, %v; want 2 rotated", rep, err)
	}
	cur, _ := st.Snapshot()
	for i, sv := range cur {
		if err := sv.Certificates[0].CheckSignatureFrom(certOf(t, c2)); err != nil {
			t.Fatalf("SVID %s not signed by the new CA: %v", sv.ID, err)
		}
		if bytes.Equal(sv.Certificates[0].Raw, old[i].Certificates[0].Raw) {
			t.Fatalf("SVID %s not re-minted", sv.ID)
		}
	}
	if rep, _ := st.SyncReport(accts); rep.Rotated+rep.Minted != 0 {
		t.Fatalf("second sync re-minted again: %+v", rep)
	}

	// Step 3: the old CA leaves the bundle; nothing is re-minted.
	if !st.SetCA(ca2, nil) {
		t.Fatal("dropping an anchor reported no change")
	}
	if n := len(st.Bundle().X509Authorities()); n != 1 {
		t.Fatalf("bundle holds %d authorities, want 1", n)
	}
	if rep, _ := st.SyncReport(accts); rep.Rotated+rep.Minted != 0 {
		t.Fatalf("a bundle-only change re-minted: %+v", rep)
	}
	// An anchor equal to the signing CA is held once.
	if st.SetCA(ca2, []*x509.Certificate{certOf(t, c2)}) {
		t.Fatal("an anchor equal to the CA changed the bundle")
	}
}
