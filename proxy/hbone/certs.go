package hbone

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Certs gives HBONE the SVID of each local workload identity and the trust bundle.
type Certs interface {
	// SVID returns the current X.509-SVID of id, or false when the node holds none.
	SVID(id spiffeid.ID) (*x509svid.SVID, bool)
	// Bundle returns the current trust bundle; it may rotate and is read per handshake.
	Bundle() *x509bundle.Bundle
}

// ALPN is the only application protocol HBONE negotiates.
const ALPN = "h2"

// svidSource adapts one identity of a Certs to go-spiffe's x509svid.Source.
// The SVID is looked up per handshake, so a rotated SVID is used by the next
// connection while established ones keep theirs.
type svidSource struct {
	certs Certs
	id    spiffeid.ID
}

func (s svidSource) GetX509SVID() (*x509svid.SVID, error) {
	svid, ok := s.certs.SVID(s.id)
	if !ok || svid == nil {
		return nil, fmt.Errorf("failed to find svid %q: %w", s.id, errNoSVID)
	}
	return svid, nil
}

// bundleSource adapts Certs to go-spiffe's x509bundle.Source, reading the
// bundle per handshake so a rotated bundle applies to the next handshake.
type bundleSource struct{ certs Certs }

func (b bundleSource) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	bundle := b.certs.Bundle()
	if bundle == nil {
		return nil, fmt.Errorf("failed to find trust bundle %q: %w", td, errNoBundle)
	}
	return bundle.GetX509BundleForTrustDomain(td)
}

var (
	errNoSVID   = errors.New("no svid for this identity")
	errNoBundle = errors.New("no trust bundle")
)

// hboneTLS sets what every HBONE TLS config shares: TLS 1.3 only, ALPN h2.
func hboneTLS(c *tls.Config) *tls.Config {
	c.MinVersion = tls.VersionTLS13
	c.NextProtos = []string{ALPN}
	return c
}

// serverTLSConfig presents the SVID of id and requires a client SVID that
// chains to the current bundle of id's trust domain.
func serverTLSConfig(certs Certs, id spiffeid.ID) *tls.Config {
	return hboneTLS(tlsconfig.MTLSServerConfig(svidSource{certs, id}, bundleSource{certs},
		tlsconfig.AuthorizeMemberOf(id.TrustDomain())))
}

// clientTLSConfig presents the SVID of src and requires a server SVID that
// chains to the current bundle and is expected (any member of src's trust
// domain when expected is zero).
func clientTLSConfig(certs Certs, src, expected spiffeid.ID) *tls.Config {
	authorize := tlsconfig.AuthorizeMemberOf(src.TrustDomain())
	if !expected.IsZero() {
		authorize = tlsconfig.AuthorizeID(expected)
	}
	return hboneTLS(tlsconfig.MTLSClientConfig(svidSource{certs, src}, bundleSource{certs}, authorize))
}

// peerID returns the SPIFFE ID of a verified peer certificate chain.
func peerID(chain []*x509.Certificate) (spiffeid.ID, error) {
	if len(chain) == 0 {
		return spiffeid.ID{}, errors.New("failed to read peer svid: no certificate")
	}
	return x509svid.IDFromCert(chain[0])
}
