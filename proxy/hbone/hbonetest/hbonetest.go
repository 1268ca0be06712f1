// Package hbonetest gives hbone tests and benchmarks a tiny SPIFFE CA that
// mints X.509-SVIDs with crypto/x509, and a mutable hbone.Certs.
package hbonetest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net/url"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// CA is a self-signed SPIFFE CA of one trust domain.
type CA struct {
	TD   spiffeid.TrustDomain
	Cert *x509.Certificate
	key  crypto.Signer
}

// NewCA returns a CA for td valid from an hour ago for a day.
func NewCA(td spiffeid.TrustDomain) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("failed to generate ca key %q: %w", td, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{Organization: []string{"hbonetest"}, CommonName: td.String()},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		URIs:                  []*url.URL{td.ID().URL()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("failed to create ca certificate %q: %w", td, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("failed to parse ca certificate %q: %w", td, err)
	}
	return &CA{TD: td, Cert: cert, key: key}, nil
}

// Bundle returns a trust bundle holding only this CA.
func (ca *CA) Bundle() *x509bundle.Bundle {
	return x509bundle.FromX509Authorities(ca.TD, []*x509.Certificate{ca.Cert})
}

// SVID mints an X.509-SVID for id valid in [notBefore, notAfter).
func (ca *CA) SVID(id spiffeid.ID, notBefore, notAfter time.Time) (*x509svid.SVID, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("failed to generate svid key %q: %w", id, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, fmt.Errorf("failed to generate serial %q: %w", id, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{id.URL()},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.key)
	if err != nil {
		return nil, fmt.Errorf("failed to create svid %q: %w", id, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("failed to parse svid %q: %w", id, err)
	}
	return &x509svid.SVID{ID: id, Certificates: []*x509.Certificate{cert}, PrivateKey: key}, nil
}

// ValidSVID mints an SVID for id valid from an hour ago for an hour.
func (ca *CA) ValidSVID(id spiffeid.ID) (*x509svid.SVID, error) {
	now := time.Now()
	return ca.SVID(id, now.Add(-time.Hour), now.Add(time.Hour))
}

// Certs is an hbone.Certs whose SVIDs and bundle tests change at will.
type Certs struct {
	mu     sync.Mutex
	svids  map[spiffeid.ID]*x509svid.SVID
	bundle *x509bundle.Bundle
}

// NewCerts returns Certs serving bundle and no SVID.
func NewCerts(bundle *x509bundle.Bundle) *Certs {
	return &Certs{svids: map[spiffeid.ID]*x509svid.SVID{}, bundle: bundle}
}

// SetSVID makes svid the current SVID of its ID.
func (c *Certs) SetSVID(svid *x509svid.SVID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.svids[svid.ID] = svid
}

// SetBundle rotates the trust bundle.
func (c *Certs) SetBundle(b *x509bundle.Bundle) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.bundle = b
}

// SVID implements hbone.Certs.
func (c *Certs) SVID(id spiffeid.ID) (*x509svid.SVID, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.svids[id]
	return s, ok
}

// Bundle implements hbone.Certs.
func (c *Certs) Bundle() *x509bundle.Bundle {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.bundle
}
