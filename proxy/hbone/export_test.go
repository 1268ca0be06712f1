package hbone

import (
	"crypto/tls"
	"crypto/x509"
)

// AcceptClientsWithoutCert lets s complete TLS handshakes with clients that
// present no certificate (tls.RequestClientCert instead of
// RequireAnyClientCert); a certificate that is presented is still verified
// against the bundle as before. Test only: the conformance lane's h2spec
// cannot present a client certificate. Such a connection has no verified
// peer, so its CONNECT streams are answered 403 (h2conn.go).
func AcceptClientsWithoutCert(s *Server) {
	verify := s.tls.VerifyPeerCertificate
	s.tls.ClientAuth = tls.RequestClientCert
	s.tls.VerifyPeerCertificate = func(raw [][]byte, chains [][]*x509.Certificate) error {
		if len(raw) == 0 {
			return nil
		}
		return verify(raw, chains)
	}
}
