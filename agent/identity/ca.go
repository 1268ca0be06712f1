// Package identity mints SPIFFE X.509-SVIDs for the managed pods of this node
// from a CA the agent is given (the embedded provider of issue 13).
package identity

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// backdate is how far NotBefore is set before the mint time to tolerate
// clock skew; a TTL shorter than 4×backdate is backdated by a quarter of
// itself instead, so its half-life (the rotation point) stays after the
// mint time.
const backdate = 5 * time.Minute

// backdateFor is the NotBefore backdate of an SVID with lifetime ttl.
func backdateFor(ttl time.Duration) time.Duration {
	return min(backdate, ttl/4)
}

// CA is a validated signing CA for one trust domain.
type CA struct {
	cert *x509.Certificate
	key  crypto.Signer
	td   spiffeid.TrustDomain
}

// ParseCA parses a PEM certificate and PEM private key and validates them
// for trust domain td at time now.
func ParseCA(certPEM, keyPEM []byte, td spiffeid.TrustDomain, now time.Time) (*CA, error) {
	block, _ := pem.Decode(certPEM)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, errors.New("failed to parse CA certificate: no PEM CERTIFICATE block")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("failed to parse CA certificate: %w", err)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, errors.New("failed to parse CA key: no PEM block")
	}
	key, err := parseKey(kb.Bytes)
	if err != nil {
		return nil, err
	}
	ca := &CA{cert: cert, key: key, td: td}
	if err := ca.validate(now); err != nil {
		return nil, err
	}
	return ca, nil
}

func parseKey(der []byte) (crypto.Signer, error) {
	if k, err := x509.ParsePKCS8PrivateKey(der); err == nil {
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, errors.New("failed to parse CA key: not a signing key")
		}
		return s, nil
	}
	if k, err := x509.ParseECPrivateKey(der); err == nil {
		return k, nil
	}
	if k, err := x509.ParsePKCS1PrivateKey(der); err == nil {
		return k, nil
	}
	return nil, errors.New("failed to parse CA key: not PKCS#8, SEC 1 or PKCS#1")
}

func (c *CA) validate(now time.Time) error {
	if !c.cert.IsCA || !c.cert.BasicConstraintsValid {
		return fmt.Errorf("failed to validate CA %q: not a CA certificate", c.cert.Subject)
	}
	if c.cert.KeyUsage != 0 && c.cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return fmt.Errorf("failed to validate CA %q: key usage lacks certSign", c.cert.Subject)
	}
	pub, ok := c.key.Public().(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(c.cert.PublicKey) {
		return fmt.Errorf("failed to validate CA %q: key does not match certificate", c.cert.Subject)
	}
	if now.After(c.cert.NotAfter) {
		return fmt.Errorf("failed to validate CA %q: expired at %s", c.cert.Subject, c.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	if now.Before(c.cert.NotBefore) {
		return fmt.Errorf("failed to validate CA %q: not valid before %s", c.cert.Subject, c.cert.NotBefore.UTC().Format(time.RFC3339))
	}
	if err := checkTrustDomain(c.cert, c.td); err != nil {
		return fmt.Errorf("failed to validate CA: %w", err)
	}
	return nil
}

// ParseTrustAnchors parses the extra CA certificates a trust bundle holds
// besides the signing CA (the previous CA while a rotation completes, or the
// next one before it signs), all PEM CERTIFICATE blocks of pemData. Each must
// be a CA certificate, unexpired at now, and a SPIFFE URI SAN, when present,
// must name td. Empty input is no anchors.
func ParseTrustAnchors(pemData []byte, td spiffeid.TrustDomain, now time.Time) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for n := 1; ; n++ {
		var block *pem.Block
		block, pemData = pem.Decode(pemData)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("failed to parse trust anchor %d: PEM block %q, want CERTIFICATE", n, block.Type)
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("failed to parse trust anchor %d: %w", n, err)
		}
		if !cert.IsCA || !cert.BasicConstraintsValid {
			return nil, fmt.Errorf("failed to validate trust anchor %d %q: not a CA certificate", n, cert.Subject)
		}
		if now.After(cert.NotAfter) {
			return nil, fmt.Errorf("failed to validate trust anchor %d %q: expired at %s", n, cert.Subject, cert.NotAfter.UTC().Format(time.RFC3339))
		}
		if err := checkTrustDomain(cert, td); err != nil {
			return nil, fmt.Errorf("failed to validate trust anchor %d: %w", n, err)
		}
		out = append(out, cert)
	}
	if len(bytes.TrimSpace(pemData)) > 0 {
		return nil, errors.New("failed to parse trust anchors: data after the last PEM block")
	}
	return out, nil
}

// checkTrustDomain refuses a certificate whose SPIFFE URI SAN names another
// trust domain than td.
func checkTrustDomain(cert *x509.Certificate, td spiffeid.TrustDomain) error {
	for _, u := range cert.URIs {
		id, err := spiffeid.FromURI(u)
		if err != nil {
			continue
		}
		if id.TrustDomain() != td {
			return fmt.Errorf("certificate %q: trust domain %q, want %q", cert.Subject, id.TrustDomain(), td)
		}
	}
	return nil
}

// Equal reports whether c and o are the same certificate and key.
func (c *CA) Equal(o *CA) bool {
	if c == nil || o == nil {
		return c == o
	}
	pub, ok := c.key.Public().(interface{ Equal(crypto.PublicKey) bool })
	return c.td == o.td && c.cert.Equal(o.cert) && ok && pub.Equal(o.key.Public())
}

// TrustDomain is the trust domain the CA signs for.
func (c *CA) TrustDomain() spiffeid.TrustDomain { return c.td }

// Subject is the CA certificate's subject, for logs.
func (c *CA) Subject() string { return c.cert.Subject.String() }

// NotAfter is the CA's expiry; SVIDs never outlive it.
func (c *CA) NotAfter() time.Time { return c.cert.NotAfter }

// Bundle is the X.509 bundle of the CA's trust domain.
func (c *CA) Bundle() *x509bundle.Bundle {
	return x509bundle.FromX509Authorities(c.td, []*x509.Certificate{c.cert})
}

// WorkloadID is the SPIFFE ID of a service account in a namespace.
func WorkloadID(td spiffeid.TrustDomain, ns, sa string) (spiffeid.ID, error) {
	id, err := spiffeid.FromSegments(td, "ns", ns, "sa", sa)
	if err != nil {
		return spiffeid.ID{}, fmt.Errorf("failed to build SPIFFE ID for %q/%q: %w", ns, sa, err)
	}
	return id, nil
}

// Mint issues an X.509-SVID for id valid from now-backdate (5m, or ttl/4
// when shorter) until now+ttl, clamped to the CA's expiry, with a fresh
// ECDSA P-256 key. It fails once the CA has expired.
func (c *CA) Mint(id spiffeid.ID, now time.Time, ttl time.Duration) (*x509svid.SVID, error) {
	if !id.MemberOf(c.td) {
		return nil, fmt.Errorf("failed to mint SVID %q: not in trust domain %q", id, c.td)
	}
	if !now.Before(c.cert.NotAfter) {
		return nil, fmt.Errorf("failed to mint SVID %q: the CA expired at %s", id, c.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("failed to generate key for %q: %w", id, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("failed to generate serial for %q: %w", id, err)
	}
	notAfter := now.Add(ttl)
	if notAfter.After(c.cert.NotAfter) {
		notAfter = c.cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{},
		URIs:                  []*url.URL{id.URL()},
		NotBefore:             now.Add(-backdateFor(ttl)),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, key.Public(), c.key)
	if err != nil {
		return nil, fmt.Errorf("failed to sign SVID %q: %w", id, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("failed to parse SVID %q: %w", id, err)
	}
	return &x509svid.SVID{ID: id, Certificates: []*x509.Certificate{cert}, PrivateKey: key}, nil
}
