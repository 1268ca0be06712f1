package hbone_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

var (
	td        = spiffeid.RequireTrustDomainFromString("cluster.local")
	serverID  = spiffeid.RequireFromPath(td, "/ns/dst/sa/server")
	clientID  = spiffeid.RequireFromPath(td, "/ns/src/sa/client")
	otherTD   = spiffeid.RequireTrustDomainFromString("other.example")
	foreignID = spiffeid.RequireFromPath(otherTD, "/ns/src/sa/client")
)

// env is one HBONE server on loopback delivering to an echo server, and the
// Certs of both sides.
type env struct {
	ca     *hbonetest.CA
	certs  *hbonetest.Certs
	srv    *hbone.Server
	proxy  netip.AddrPort
	target netip.AddrPort // the echo server

	mu      sync.Mutex
	sources []spiffeid.ID // verified source of every delivered stream
}

func newEnv(t testing.TB, tune func(*hbone.ServerConfig)) *env {
	t.Helper()
	ca, err := hbonetest.NewCA(td)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{ca: ca, certs: hbonetest.NewCerts(ca.Bundle())}
	for _, id := range []spiffeid.ID{serverID, clientID} {
		svid, err := ca.ValidSVID(id)
		if err != nil {
			t.Fatal(err)
		}
		e.certs.SetSVID(svid)
	}
	e.target = hbonetest.Echo(t)
	cfg := hbone.ServerConfig{
		Identity: serverID,
		Certs:    e.certs,
		Deliver: func(ctx context.Context, src spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
			e.mu.Lock()
			e.sources = append(e.sources, src)
			e.mu.Unlock()
			var d net.Dialer
			return d.DialContext(ctx, "tcp", target.String())
		},
	}
	if tune != nil {
		tune(&cfg)
	}
	e.srv, e.proxy = hbonetest.RunServer(t, cfg)
	return e
}

func (e *env) request() hbone.Request {
	return hbone.Request{Source: clientID, Proxy: e.proxy, Target: e.target}
}

// roundTrip writes msg, half-closes and reads the echo to EOF.
func roundTrip(t testing.TB, s *hbone.Stream, msg []byte) {
	t.Helper()
	if _, err := s.Write(msg); err != nil {
		t.Fatalf("write: %v", err)
	}
	if err := s.CloseWrite(); err != nil {
		t.Fatalf("close write: %v", err)
	}
	got, err := io.ReadAll(s)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo = %d bytes, want %d", len(got), len(msg))
	}
}

func TestEchoAndPrincipal(t *testing.T) {
	e := newEnv(t, nil)
	d := hbonetest.NewDialer(t, e.certs)
	s, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.Peer() != serverID {
		t.Errorf("peer = %q, want %q", s.Peer(), serverID)
	}
	roundTrip(t, s, bytes.Repeat([]byte("hbone"), 100_000))
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.sources) != 1 || e.sources[0] != clientID {
		t.Errorf("server saw sources %v, want [%s]", e.sources, clientID)
	}
}

// TestClientAuth: the server refuses clients it cannot verify.
func TestClientAuth(t *testing.T) {
	e := newEnv(t, nil)
	now := time.Now()
	foreignCA, err := hbonetest.NewCA(otherTD)
	if err != nil {
		t.Fatal(err)
	}
	rogueCA, err := hbonetest.NewCA(td) // same trust domain, not in the bundle
	if err != nil {
		t.Fatal(err)
	}
	expired, err := e.ca.SVID(clientID, now.Add(-2*time.Hour), now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	foreign, err := foreignCA.ValidSVID(foreignID)
	if err != nil {
		t.Fatal(err)
	}
	rogue, err := rogueCA.ValidSVID(clientID)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		cert []tls.Certificate // nil: no client certificate
	}{
		{"no client certificate", nil},
		{"expired", []tls.Certificate{tlsCert(expired.Certificates, expired.PrivateKey)}},
		{"wrong trust domain", []tls.Certificate{tlsCert(foreign.Certificates, foreign.PrivateKey)}},
		{"untrusted ca", []tls.Certificate{tlsCert(rogue.Certificates, rogue.PrivateKey)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := e.srv.Stats().HandshakeFailures
			c, err := tls.Dial("tcp", e.proxy.String(), &tls.Config{
				InsecureSkipVerify: true, //nolint:gosec // the test checks the server's verification, not the client's
				Certificates:       tt.cert,
				NextProtos:         []string{"h2"},
				MinVersion:         tls.VersionTLS13,
			})
			if err == nil {
				// TLS 1.3: the server's verdict arrives with the first read.
				_, err = c.Read(make([]byte, 1))
				_ = c.Close()
			}
			if err == nil {
				t.Fatal("handshake succeeded, want refused")
			}
			waitFor(t, func() bool { return e.srv.Stats().HandshakeFailures == before+1 })
		})
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.sources) != 0 {
		t.Errorf("refused clients were delivered: %v", e.sources)
	}
}

// TestServerAuth: the dialer refuses servers outside the bundle or not the
// expected identity.
func TestServerAuth(t *testing.T) {
	e := newEnv(t, nil)
	rogueCA, err := hbonetest.NewCA(td)
	if err != nil {
		t.Fatal(err)
	}
	rogueCerts := hbonetest.NewCerts(e.ca.Bundle())
	rogue, err := rogueCA.ValidSVID(serverID)
	if err != nil {
		t.Fatal(err)
	}
	rogueCerts.SetSVID(rogue)
	_, rogueProxy := hbonetest.RunServer(t, hbone.ServerConfig{Identity: serverID, Certs: rogueCerts, Deliver: refuse})

	tests := []struct {
		name    string
		proxy   netip.AddrPort
		want    spiffeid.ID
		wantErr bool
	}{
		{"any member", e.proxy, spiffeid.ID{}, false},
		{"expected id", e.proxy, serverID, false},
		{"other id expected", e.proxy, spiffeid.RequireFromPath(td, "/ns/dst/sa/else"), true},
		{"untrusted server", rogueProxy, spiffeid.ID{}, true},
	}
	d := hbonetest.NewDialer(t, e.certs)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := e.request()
			req.Proxy, req.Expected = tt.proxy, tt.want
			s, err := d.Dial(context.Background(), req)
			if (err != nil) != tt.wantErr {
				t.Fatalf("dial error = %v, want error %v", err, tt.wantErr)
			}
			if err == nil {
				roundTrip(t, s, []byte("ping"))
				_ = s.Close()
			}
		})
	}
}

func refuse(context.Context, spiffeid.ID, netip.AddrPort) (net.Conn, error) {
	return nil, errors.New("refused")
}

func TestStatusCodes(t *testing.T) {
	e := newEnv(t, nil)
	_, gone := hbonetest.RunServer(t, hbone.ServerConfig{Identity: serverID, Certs: e.certs, Deliver: refuse})
	_, teapot := hbonetest.RunServer(t, hbone.ServerConfig{
		Identity: serverID, Certs: e.certs,
		Deliver: func(context.Context, spiffeid.ID, netip.AddrPort) (net.Conn, error) {
			return nil, &hbone.StatusError{Code: http.StatusBadGateway, Err: errors.New("no such workload")}
		},
	})
	d := hbonetest.NewDialer(t, e.certs)
	for _, tt := range []struct {
		name  string
		proxy netip.AddrPort
		code  int
	}{
		{"deliver refused", gone, http.StatusServiceUnavailable},
		{"status error", teapot, http.StatusBadGateway},
	} {
		t.Run(tt.name, func(t *testing.T) {
			req := e.request()
			req.Proxy = tt.proxy
			_, err := d.Dial(context.Background(), req)
			var se *hbone.StatusError
			if !errors.As(err, &se) || se.Code != tt.code {
				t.Fatalf("dial error = %v, want status %d", err, tt.code)
			}
		})
	}
	if got := d.Stats().StreamsFailed; got != 2 {
		t.Errorf("dialer StreamsFailed = %d, want 2", got)
	}
}

func TestManyStreamsOnePooledConn(t *testing.T) {
	e := newEnv(t, nil)
	d := hbonetest.NewDialer(t, e.certs)
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := d.Dial(context.Background(), e.request())
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			msg := bytes.Repeat([]byte{byte(i)}, 10_000+i)
			if _, err := s.Write(msg); err != nil {
				errs <- err
				return
			}
			_ = s.CloseWrite()
			got, err := io.ReadAll(s)
			if err != nil || !bytes.Equal(got, msg) {
				errs <- errors.New("bad echo")
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	st := d.Stats()
	if st.ConnsOpened != 1 || st.StreamsOpened != n {
		t.Errorf("dialer stats = %+v, want 1 connection and %d streams", st, n)
	}
	if got := e.srv.Stats().Handshakes; got != 1 {
		t.Errorf("server handshakes = %d, want 1", got)
	}
}

// TestStreamLimit: with MaxConcurrentStreams 2 a third concurrent stream does
// not go on the full connection: the pool opens a second one.
func TestStreamLimit(t *testing.T) {
	e := newEnv(t, func(c *hbone.ServerConfig) { c.MaxConcurrentStreams = 2 })
	d := hbonetest.NewDialer(t, e.certs)
	// The first stream learns the server's SETTINGS.
	first, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	var streams []*hbone.Stream
	for range 2 {
		s, err := d.Dial(context.Background(), e.request())
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	if got := d.Stats().ConnsOpened; got != 2 {
		t.Errorf("connections = %d, want 2 (limit 2 per connection, 3 streams)", got)
	}
	for _, s := range append(streams, first) {
		roundTrip(t, s, []byte("x"))
		_ = s.Close()
	}
}

// TestEvictBrokenConn: a pooled connection whose TCP connection broke is
// evicted and the next stream gets a new one.
func TestEvictBrokenConn(t *testing.T) {
	e := newEnv(t, nil)
	d, conns := recordingDialer(t, hbone.DialerConfig{Certs: e.certs}, nil)
	s, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, s, []byte("one"))
	_ = s.Close()
	_ = conns()[0].Close() // the network breaks under the pooled connection
	s, err = d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, s, []byte("two"))
	_ = s.Close()
	if st := d.Stats(); st.ConnsOpened != 2 || st.ConnsEvicted != 1 || st.ConnsPooled != 1 {
		t.Errorf("dialer stats = %+v, want 2 opened, 1 evicted, 1 pooled", st)
	}
}

// recordingDialer returns a Dialer for cfg whose TCP connections are passed
// through wrap (when set) and recorded, and a function returning them.
func recordingDialer(t *testing.T, cfg hbone.DialerConfig, wrap func(net.Conn) net.Conn) (*hbone.Dialer, func() []net.Conn) {
	t.Helper()
	var mu sync.Mutex
	var conns []net.Conn
	cfg.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var nd net.Dialer
		c, err := nd.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if wrap != nil {
			c = wrap(c)
		}
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
		return c, nil
	}
	d, err := hbone.NewDialer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d, func() []net.Conn {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(conns)
	}
}

// TestRotation: a new bundle and SVIDs apply to new connections; the
// established connection and its stream keep working.
func TestRotation(t *testing.T) {
	e := newEnv(t, nil)
	d := hbonetest.NewDialer(t, e.certs)
	live, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	if _, err := live.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 6)
	if _, err := io.ReadFull(live, buf); err != nil {
		t.Fatal(err)
	}

	ca2, err := hbonetest.NewCA(td)
	if err != nil {
		t.Fatal(err)
	}
	// An old-CA client against the rotated server is refused, a new-CA
	// client accepted; the live stream still echoes.
	oldCerts := hbonetest.NewCerts(e.ca.Bundle())
	oldSVID, _ := e.ca.ValidSVID(clientID)
	oldCerts.SetSVID(oldSVID)
	e.certs.SetBundle(ca2.Bundle())
	for _, id := range []spiffeid.ID{serverID, clientID} {
		svid, err := ca2.ValidSVID(id)
		if err != nil {
			t.Fatal(err)
		}
		e.certs.SetSVID(svid)
	}
	if _, err := hbonetest.NewDialer(t, oldCerts).Dial(context.Background(), e.request()); err == nil {
		t.Error("old-CA client accepted after rotation")
	}
	fresh, err := hbonetest.NewDialer(t, e.certs).Dial(context.Background(), e.request())
	if err != nil {
		t.Fatalf("new-CA client: %v", err)
	}
	roundTrip(t, fresh, []byte("after"))
	_ = fresh.Close()
	roundTrip(t, live, []byte("still alive"))
	if got := d.Stats().ConnsOpened; got != 1 {
		t.Errorf("live dialer connections = %d, want 1 (the established one kept)", got)
	}
}

// TestHandshakeTimeout: a client that never sends a ClientHello is closed
// at the injected deadline.
func TestHandshakeTimeout(t *testing.T) {
	e := newEnv(t, func(c *hbone.ServerConfig) { c.HandshakeTimeout = 20 * time.Millisecond })
	c, err := net.Dial("tcp", e.proxy.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("read %d bytes from a server waiting for ClientHello", n)
	}
	waitFor(t, func() bool { return e.srv.Stats().HandshakeTimeouts == 1 })
}

// TestShutdownDrain: Shutdown refuses new connections, lets an open stream
// finish, and cuts it at the deadline if it does not.
func TestShutdownDrain(t *testing.T) {
	for _, tt := range []struct {
		name   string
		finish bool // the stream ends before the deadline
	}{
		{"stream finishes", true},
		{"deadline cuts", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, nil)
			d := hbonetest.NewDialer(t, e.certs)
			s, err := d.Dial(context.Background(), e.request())
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- e.srv.Shutdown(ctx) }()
			// A new connection is refused once the listener is closed.
			waitFor(t, func() bool {
				c, err := net.Dial("tcp", e.proxy.String())
				if err != nil {
					return true
				}
				_ = c.Close()
				return false
			})
			select {
			case err := <-done:
				t.Fatalf("shutdown returned %v with a stream open", err)
			default:
			}
			if tt.finish {
				roundTrip(t, s, []byte("drained"))
				if err := <-done; err != nil {
					t.Fatalf("shutdown: %v", err)
				}
				return
			}
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("shutdown = %v, want context.Canceled", err)
			}
			if _, err := io.ReadAll(s); err == nil {
				t.Error("stream still open after the shutdown deadline")
			}
		})
	}
}

func TestServerRejectsBadRequests(t *testing.T) {
	e := newEnv(t, nil)
	svid, _ := e.certs.SVID(clientID)
	tr := &http.Transport{
		ForceAttemptHTTP2: true,
		TLSClientConfig: &tls.Config{
			InsecureSkipVerify: true, //nolint:gosec // only the server's request handling is tested
			Certificates:       []tls.Certificate{tlsCert(svid.Certificates, svid.PrivateKey)},
			MinVersion:         tls.VersionTLS13,
		},
	}
	t.Cleanup(tr.CloseIdleConnections)
	for _, tt := range []struct {
		name, method, host string
		code               int
	}{
		{"GET", http.MethodGet, e.target.String(), http.StatusMethodNotAllowed},
		{"host name", http.MethodConnect, "example.com:80", http.StatusBadRequest},
	} {
		t.Run(tt.name, func(t *testing.T) {
			req, _ := http.NewRequest(tt.method, "https://"+e.proxy.String(), http.NoBody)
			req.Host = tt.host
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode != tt.code || resp.ProtoMajor != 2 {
				t.Errorf("status = %d over HTTP/%d, want %d over HTTP/2", resp.StatusCode, resp.ProtoMajor, tt.code)
			}
		})
	}
	if got := e.srv.Stats().StreamsBadRequest; got != 2 {
		t.Errorf("StreamsBadRequest = %d, want 2", got)
	}
}

func tlsCert(chain []*x509.Certificate, key any) tls.Certificate {
	c := tls.Certificate{PrivateKey: key, Leaf: chain[0]}
	for _, x := range chain {
		c.Certificate = append(c.Certificate, x.Raw)
	}
	return c
}

// waitFor polls cond (what the server did asynchronously) until it holds;
// the test's own timeout bounds it.
func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	for !cond() {
		time.Sleep(time.Millisecond)
	}
}

// TestUpstreamEndPropagates: an upstream that ends cleanly (FIN) ends the
// stream cleanly (EOF at the client); an upstream that fails (reset, or
// closed under the copy as the data plane's idle timeout does) resets the
// stream, as a TCP proxy resets its client.
func TestUpstreamEndPropagates(t *testing.T) {
	for _, tt := range []struct {
		name  string
		end   func(*net.TCPConn)
		reset bool
	}{
		{"clean close", func(c *net.TCPConn) { _ = c.Close() }, false},
		{"reset", func(c *net.TCPConn) { _ = c.SetLinger(0); _ = c.Close() }, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ln.Close() })
			apps := make(chan *net.TCPConn, 1)
			go func() {
				if c, err := ln.Accept(); err == nil {
					apps <- c.(*net.TCPConn)
				}
			}()
			e := newEnv(t, nil)
			d := hbonetest.NewDialer(t, e.certs)
			req := e.request()
			req.Target = ln.Addr().(*net.TCPAddr).AddrPort()
			s, err := d.Dial(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Close() })
			app := <-apps
			if _, err := app.Write([]byte("hi")); err != nil {
				t.Fatal(err)
			}
			b := make([]byte, 2)
			if _, err := io.ReadFull(s, b); err != nil {
				t.Fatal(err)
			}
			tt.end(app)
			_, err = s.Read(b)
			if gotReset := err != nil && !errors.Is(err, io.EOF); gotReset != tt.reset || err == nil {
				t.Errorf("stream read after the upstream ended = %v, want reset %v", err, tt.reset)
			}
		})
	}
}

// TestPoolKeyedBySource: a pooled connection is shared only by streams of
// one source identity (and one origin): streams of two SVIDs to the same
// destination proxy never share a connection, and the server verifies each
// stream's own source on it.
func TestPoolKeyedBySource(t *testing.T) {
	otherID := spiffeid.RequireFromPath(td, "/ns/src/sa/other")
	type dial struct {
		source spiffeid.ID
		origin string
	}
	for _, tt := range []struct {
		name  string
		dials []dial
		conns uint64
	}{
		{"one source", []dial{{clientID, ""}, {clientID, ""}, {clientID, ""}}, 1},
		{"two sources", []dial{{clientID, ""}, {otherID, ""}, {clientID, ""}, {otherID, ""}}, 2},
		{"one source, two origins", []dial{{clientID, "pod-a#1"}, {clientID, "pod-b#1"}, {clientID, "pod-a#1"}}, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, nil)
			svid, err := e.ca.ValidSVID(otherID)
			if err != nil {
				t.Fatal(err)
			}
			e.certs.SetSVID(svid)
			d := hbonetest.NewDialer(t, e.certs)
			for i, dl := range tt.dials {
				req := e.request()
				req.Source, req.Origin = dl.source, dl.origin
				s, err := d.Dial(context.Background(), req)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = s.Close() }) // open streams keep their connections busy
				e.mu.Lock()
				got := e.sources[len(e.sources)-1]
				e.mu.Unlock()
				if got != dl.source {
					t.Errorf("stream %d from %s: the server verified %s", i, dl.source, got)
				}
			}
			if st := d.Stats(); st.ConnsOpened != tt.conns || st.StreamsOpened != uint64(len(tt.dials)) {
				t.Errorf("dialer stats = %+v, want %d connections for %d streams", st, tt.conns, len(tt.dials))
			}
			if got := e.srv.Stats().Handshakes; got != tt.conns {
				t.Errorf("server handshakes = %d, want %d", got, tt.conns)
			}
		})
	}
}

// TestSlowStreamDoesNotStallOthers: a stream whose upstream does not read
// holds at most its own receive window; another stream on the same
// connection keeps moving, many times the connection window through it.
func TestSlowStreamDoesNotStallOthers(t *testing.T) {
	const (
		window = 256 << 10
		frame  = 16 << 10
	)
	release := make(chan struct{})
	accepted := make(chan struct{}, 1)
	slow := hbonetest.Serve(t, func(c net.Conn) {
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
		accepted <- struct{}{}
		<-release // never reads
	})
	t.Cleanup(func() { close(release) })
	e := newEnv(t, func(c *hbone.ServerConfig) {
		c.StreamWindow, c.ConnWindow = window, 2*window
		deliver := c.Deliver
		c.Deliver = func(ctx context.Context, src spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
			up, err := deliver(ctx, src, target)
			if err == nil && target == slow {
				// Small kernel buffers: the slow upstream cannot absorb
				// its stream's window, the server has to hold it.
				_ = up.(*net.TCPConn).SetWriteBuffer(4 << 10)
			}
			return up, err
		}
	})
	d := hbonetest.NewDialer(t, e.certs)
	req := e.request()
	req.Target = slow
	stuck, err := d.Dial(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	<-accepted
	var written sync.Mutex
	sent := 0
	writerDone := make(chan error, 1)
	go func() {
		chunk := make([]byte, frame)
		for range 64 * window / frame {
			if _, err := stuck.Write(chunk); err != nil {
				writerDone <- err
				return
			}
			written.Lock()
			sent += len(chunk)
			written.Unlock()
		}
		writerDone <- nil
	}()
	// The slow stream's window is used up at the server.
	waitFor(t, func() bool {
		written.Lock()
		defer written.Unlock()
		return sent >= window
	})

	fast, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	defer fast.Close()
	msg := bytes.Repeat([]byte("moving"), 8*window/6)
	go func() {
		_, _ = fast.Write(msg)
		_ = fast.CloseWrite()
	}()
	got, err := io.ReadAll(fast)
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo on the other stream = %d bytes (error %v), want %d", len(got), err, len(msg))
	}
	select {
	case err := <-writerDone:
		t.Fatalf("the slow stream's writer ended (%v): its upstream was not stalled", err)
	default:
	}
	if st := d.Stats(); st.ConnsOpened != 1 {
		t.Errorf("connections = %d, want both streams on one", st.ConnsOpened)
	}
	_ = stuck.Close()
	<-writerDone
}

// silencingConn is a client connection whose incoming bytes can be cut
// off (the network goes silent): once silenced, reads drop what comes
// and block until Close.
type silencingConn struct {
	net.Conn
	silent, closed chan struct{}
	once           sync.Once
}

func (c *silencingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	select {
	case <-c.silent:
		<-c.closed
		return 0, net.ErrClosed
	default:
		return n, err
	}
}

func (c *silencingConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// TestPingTimeoutEvicts: a pooled connection whose server goes silent gets
// a PING and is closed when the ack does not come within PingTimeout; its
// stream fails with an error (not EOF) and the next Dial evicts it and
// opens a new connection.
func TestPingTimeoutEvicts(t *testing.T) {
	e := newEnv(t, nil)
	d, conns := recordingDialer(t, hbone.DialerConfig{
		Certs:        e.certs,
		PingInterval: 10 * time.Millisecond, PingTimeout: 10 * time.Millisecond,
	}, func(c net.Conn) net.Conn {
		return &silencingConn{Conn: c, silent: make(chan struct{}), closed: make(chan struct{})}
	})
	s, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	close(conns()[0].(*silencingConn).silent)
	if _, err := s.Read(make([]byte, 1)); err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("read on a connection whose pings go unanswered = %v, want an error", err)
	}
	s2, err := d.Dial(context.Background(), e.request())
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, s2, []byte("after"))
	_ = s2.Close()
	if st := d.Stats(); st.ConnsOpened != 2 || st.ConnsEvicted != 1 || st.ConnsPooled != 1 {
		t.Errorf("dialer stats = %+v, want 2 opened, 1 evicted, 1 pooled", st)
	}
}
