// Package identitytest makes signing CAs for the tests of the embedded
// SPIFFE provider (agent/identity) and of its clients. Tests only.
package identitytest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Spec describes a CA certificate to generate.
type Spec struct {
	// IsCA sets the basic constraint CA:TRUE.
	IsCA bool
	// NotBefore and NotAfter bound the certificate's validity.
	NotBefore, NotAfter time.Time
	// URI, when set, is the certificate's one URI SAN (spiffe://<td>).
	URI string
}

// Valid is a CA for trust domain td valid from an hour ago for a year.
func Valid(td string) Spec {
	now := time.Now()
	return Spec{IsCA: true, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(365 * 24 * time.Hour), URI: "spiffe://" + td}
}

// CA generates an ECDSA P-256 certificate and PKCS#8 key following s and
// returns them PEM encoded, with the key.
func CA(t testing.TB, s Spec) (certPEM, keyPEM []byte, key crypto.Signer) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test ca"},
		NotBefore: s.NotBefore, NotAfter: s.NotAfter,
		IsCA: s.IsCA, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	if s.URI != "" {
		u, err := url.Parse(s.URI)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = []*url.URL{u}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, k.Public(), k)
	if err != nil {
		t.Fatal(err)
	}
	kd, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kd}), k
}

// Files writes a CA following s to dir as ca.crt and ca.key (0600) and
// returns their paths.
func Files(t testing.TB, dir string, s Spec) (certFile, keyFile string) {
	t.Helper()
	c, k, _ := CA(t, s)
	certFile, keyFile = filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	if err := os.WriteFile(certFile, c, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, k, 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}
