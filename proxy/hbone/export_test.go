package hbone

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
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

// ServerTLSConn runs s's mTLS handshake (its TLS config and certificates)
// on c over the record batcher s's own connections use, with its batched
// socket reads on (nothing to write before a read: beforeRead is a no-op),
// and returns the TLS connection, each Write of which is one write(2).
// Benchmark only: BenchmarkHBONEThroughput's xnet-server peer serves
// x/net's HTTP/2 server on it, so that only the HTTP/2 engine differs.
func ServerTLSConn(s *Server, c net.Conn) (net.Conn, error) {
	raw := &recordBatcher{Conn: c, beforeRead: func() {}}
	hc, err := handshake(context.Background(), raw, tls.Server(raw, s.tls))
	if err != nil {
		return nil, err
	}
	return hc, nil
}
