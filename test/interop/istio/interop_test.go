package istio

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"testing"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	istiohbone "istio.io/istio/pkg/hbone"
	istiolog "istio.io/istio/pkg/log"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

var (
	td       = spiffeid.RequireTrustDomainFromString("cluster.local")
	serverID = spiffeid.RequireFromPath(td, "/ns/dst/sa/server")
	clientID = spiffeid.RequireFromPath(td, "/ns/src/sa/client")
)

// pki is one CA and the SVIDs of both sides.
type pki struct {
	ca     *hbonetest.CA
	certs  *hbonetest.Certs
	bundle *x509bundle.Bundle
}

func newPKI(t testing.TB) *pki {
	t.Helper()
	ca, err := hbonetest.NewCA(td)
	if err != nil {
		t.Fatal(err)
	}
	p := &pki{ca: ca, bundle: ca.Bundle(), certs: hbonetest.NewCerts(ca.Bundle())}
	for _, id := range []spiffeid.ID{serverID, clientID} {
		svid, err := ca.ValidSVID(id)
		if err != nil {
			t.Fatal(err)
		}
		p.certs.SetSVID(svid)
	}
	return p
}

func (p *pki) svid(t testing.TB, id spiffeid.ID) *x509svid.SVID {
	t.Helper()
	s, ok := p.certs.SVID(id)
	if !ok {
		t.Fatalf("no svid %s", id)
	}
	return s
}

// istioClientTLS is the TLS config handed to Istio's dialer: our client
// SVID, the server verified as serverID (Istio's transport adds ALPN h2).
func (p *pki) istioClientTLS(t testing.TB) *tls.Config {
	c := tlsconfig.MTLSClientConfig(p.svid(t, clientID), p.bundle, tlsconfig.AuthorizeID(serverID))
	c.MinVersion = tls.VersionTLS13
	return c
}

// istioServer serves Istio's hbone.NewServer over mTLS (server SVID, client
// verified against the bundle) on loopback, as ztunnel's peer would.
func (p *pki) istioServer(t testing.TB) netip.AddrPort {
	t.Helper()
	hs := istiohbone.NewServer()
	// NewServer speaks h2c (its own tests run without TLS); wrap it in
	// mTLS and allow HTTP/2 over TLS, as ztunnel's 15008 is.
	hs.Protocols.SetHTTP2(true)
	hs.TLSConfig = tlsconfig.MTLSServerConfig(p.svid(t, serverID), p.bundle, tlsconfig.AuthorizeMemberOf(td))
	hs.TLSConfig.MinVersion = tls.VersionTLS13
	hs.TLSConfig.NextProtos = []string{"h2"}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- hs.ServeTLS(l, "", "") }()
	t.Cleanup(func() {
		_ = hs.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("istio server: %v", err)
		}
	})
	return l.Addr().(*net.TCPAddr).AddrPort()
}

// ourServer serves proxy/hbone on loopback, delivering over TCP and
// recording the verified source of each stream.
func (p *pki) ourServer(t testing.TB, sources chan<- spiffeid.ID) netip.AddrPort {
	t.Helper()
	_, addr := hbonetest.RunServer(t, hbone.ServerConfig{
		Identity: serverID,
		Certs:    p.certs,
		Deliver: func(ctx context.Context, src spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
			if sources != nil {
				sources <- src
			}
			var d net.Dialer
			return d.DialContext(ctx, "tcp", target.String())
		},
	})
	return addr
}

func (p *pki) ourDialer(t testing.TB) *hbone.Dialer {
	t.Helper()
	return hbonetest.NewDialer(t, p.certs)
}

// app is the application behind the destination proxy: it answers each
// connection's first line with "hello <line>" and closes.
func app(t testing.TB) netip.AddrPort {
	t.Helper()
	return hbonetest.Serve(t, func(c net.Conn) {
		buf := make([]byte, 64)
		n, _ := c.Read(buf)
		_, _ = c.Write(append([]byte("hello "), buf[:n]...))
	})
}

func expectHello(t *testing.T, c net.Conn) {
	t.Helper()
	if _, err := c.Write([]byte("mesh")); err != nil {
		t.Fatalf("write: %v", err)
	}
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	if string(got) != "hello mesh" {
		t.Fatalf("got %q, want %q", got, "hello mesh")
	}
}

// TestIstioDialerToOurServer: Istio's hbone.NewDialer (mTLS) → our :15008.
func TestIstioDialerToOurServer(t *testing.T) {
	p := newPKI(t)
	sources := make(chan spiffeid.ID, 1)
	proxy := p.ourServer(t, sources)
	target := app(t)
	d := istiohbone.NewDialer(istiohbone.Config{ProxyAddress: proxy.String(), TLS: p.istioClientTLS(t)})
	c, err := d.DialContext(context.Background(), "tcp", target.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	expectHello(t, c)
	if src := <-sources; src != clientID {
		t.Errorf("our server saw source %s, want %s", src, clientID)
	}
}

// TestOurDialerToIstioServer: our Dialer → Istio's hbone.NewServer (mTLS).
func TestOurDialerToIstioServer(t *testing.T) {
	p := newPKI(t)
	proxy := p.istioServer(t)
	target := app(t)
	d := p.ourDialer(t)
	s, err := d.Dial(context.Background(), hbone.Request{Source: clientID, Proxy: proxy, Target: target, Expected: serverID})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Peer() != serverID {
		t.Errorf("peer = %s, want %s", s.Peer(), serverID)
	}
	expectHello(t, s)
	// A second stream reuses the pooled connection.
	s2, err := d.Dial(context.Background(), hbone.Request{Source: clientID, Proxy: proxy, Target: target, Expected: serverID})
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	expectHello(t, s2)
	if got := d.Stats().ConnsOpened; got != 1 {
		t.Errorf("connections = %d, want 1", got)
	}
}

// TestIstioDialerRefusedByOurServer: an Istio client without a trusted SVID
// is refused by our server.
func TestIstioDialerRefusedByOurServer(t *testing.T) {
	p := newPKI(t)
	proxy := p.ourServer(t, nil)
	target := app(t)
	rogue := newPKI(t) // another CA of the same trust domain
	cfg := tlsconfig.MTLSClientConfig(rogue.svid(t, clientID), p.bundle, tlsconfig.AuthorizeID(serverID))
	d := istiohbone.NewDialer(istiohbone.Config{ProxyAddress: proxy.String(), TLS: cfg})
	c, err := d.DialContext(context.Background(), "tcp", target.String())
	if err == nil {
		got, _ := io.ReadAll(c)
		_ = c.Close()
		if bytes.Contains(got, []byte("hello")) {
			t.Fatal("untrusted istio client reached the app")
		}
	}
}

// TestMain silences Istio's hbone scope (it logs every CONNECT at info on
// stdout, which would interleave with benchmark lines).
func TestMain(m *testing.M) {
	for _, s := range istiolog.Scopes() {
		s.SetOutputLevel(istiolog.NoneLevel)
	}
	os.Exit(m.Run())
}

// TestOurDialerBulkToIstioServer: 8 MiB each way through our Dialer and
// Istio's server to an echo app: far beyond the initial flow-control
// windows of both sides, with Istio's frame size and window updates
// honoured by our client engine and ours by its server.
func TestOurDialerBulkToIstioServer(t *testing.T) {
	p := newPKI(t)
	proxy := p.istioServer(t)
	target := hbonetest.Echo(t)
	d := p.ourDialer(t)
	s, err := d.Dial(context.Background(), hbone.Request{Source: clientID, Proxy: proxy, Target: target, Expected: serverID})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	msg := make([]byte, 8<<20)
	for i := range msg {
		msg[i] = byte(i * 31)
	}
	wrote := make(chan error, 1)
	go func() {
		_, err := s.Write(msg)
		wrote <- err
	}()
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(s, got); err != nil {
		t.Fatalf("read the echo: %v", err)
	}
	if err := <-wrote; err != nil {
		t.Fatalf("write: %v", err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatal("the echo differs from what was sent")
	}
}
