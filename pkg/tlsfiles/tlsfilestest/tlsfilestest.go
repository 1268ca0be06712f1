// Package tlsfilestest writes throwaway CAs and certificates as PEM files,
// for tests of mutual TLS.
package tlsfilestest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a throwaway certificate authority.
type CA struct {
	// Cert is the CA certificate; Path its PEM file.
	Cert *x509.Certificate
	Path string
	key  *ecdsa.PrivateKey
}

// NewCA creates a CA valid for an hour and writes its certificate to
// dir/<name>.pem.
func NewCA(tb testing.TB, dir, name string) *CA {
	tb.Helper()
	key := newKey(tb)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		tb.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(dir, name+".pem")
	Write(tb, path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	return &CA{Cert: cert, Path: path, key: key}
}

// Leaf issues a server and client certificate for name (an IP SAN when
// name is an IP, else a DNS SAN; a SPIFFE URI SAN when name starts with
// spiffe://) with the given serial, and writes dir/<file>.crt and
// dir/<file>.key; it returns the two paths.
func (ca *CA) Leaf(tb testing.TB, dir, file, name string, serial int64) (certPath, keyPath string) {
	tb.Helper()
	key := newKey(tb)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: file},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	if ip := net.ParseIP(name); ip != nil {
		tmpl.IPAddresses = []net.IP{ip}
	} else if u, err := url.Parse(name); err == nil && u.Scheme == "spiffe" {
		tmpl.URIs = []*url.URL{u}
	} else {
		tmpl.DNSNames = []string{name}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		tb.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		tb.Fatal(err)
	}
	certPath, keyPath = filepath.Join(dir, file+".crt"), filepath.Join(dir, file+".key")
	Write(tb, certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	Write(tb, keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}))
	return certPath, keyPath
}

func newKey(tb testing.TB) *ecdsa.PrivateKey {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	return key
}

// Write writes b to path (mode 0600).
func Write(tb testing.TB, path string, b []byte) {
	tb.Helper()
	if err := os.WriteFile(path, b, 0o600); err != nil {
		tb.Fatal(err)
	}
}
