package hbone_test

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/hbone/hbonetest"
)

// countingConn counts the write(2) calls made on a TCP connection.
type countingConn struct {
	net.Conn
	mu     sync.Mutex
	writes int
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.writes++
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *countingConn) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writes
}

// TestOneWritePerDataFrame: a bulk upload costs the client one write(2) per
// 16 KiB DATA frame, not one per TLS record (each frame plus its 9-byte
// header is two records: crypto/tls alone writes them with two syscalls).
func TestOneWritePerDataFrame(t *testing.T) {
	e := newEnv(t, nil)
	conns := make(chan *countingConn, 1)
	d, err := hbone.NewDialer(hbone.DialerConfig{
		Certs: e.certs,
		DialContext: func(ctx context.Context, network, address string) (net.Conn, error) {
			var nd net.Dialer
			c, err := nd.DialContext(ctx, network, address)
			if err != nil {
				return nil, err
			}
			cc := &countingConn{Conn: c}
			conns <- cc
			return cc, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	req := e.request()
	req.Target = hbonetest.Sink(t)
	s, err := d.Dial(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	wire := <-conns
	before := wire.count()
	const frames = 64
	chunk := make([]byte, hbone.DefaultMaxFrameSize)
	if err := hbonetest.SendCounted(s, chunk, frames); err != nil {
		t.Fatal(err)
	}
	// frames DATA frames, the 8-byte length prefix, and a few control
	// frames (SETTINGS ack, WINDOW_UPDATE for the sink's answer).
	if got := wire.count() - before; got > frames+8 {
		t.Errorf("client write(2) calls for %d DATA frames = %d, want at most %d", frames, got, frames+8)
	}
}

// TestServerSpeaksOnlyHTTP2: after the mTLS handshake (ALPN h2) the server
// serves HTTP/2 only (it runs net/http's HTTP/2 in prior-knowledge mode over
// its own TLS connection): an HTTP/1.1 request gets no answer, the
// connection is closed.
func TestServerSpeaksOnlyHTTP2(t *testing.T) {
	e := newEnv(t, nil)
	c := dialRawTLS(t, e)
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: "+e.target.String()+"\r\nConnection: close\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if len(got) != 0 {
		t.Errorf("server answered HTTP/1.1 with %q (read error %v), want the connection closed", got, err)
	}
}

// TestPrefaceTimeout: a peer that completes the mTLS handshake but never
// sends the HTTP/2 client preface is closed after HandshakeTimeout.
func TestPrefaceTimeout(t *testing.T) {
	e := newEnv(t, func(c *hbone.ServerConfig) { c.HandshakeTimeout = 50 * time.Millisecond })
	c := dialRawTLS(t, e)
	// The server's SETTINGS come only after the preface; the read ends when
	// the server closes the connection (the deadline only keeps a server
	// that never does from hanging the test).
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	var ne net.Error
	if len(got) != 0 || errors.As(err, &ne) && ne.Timeout() {
		t.Errorf("server sent %d bytes (read error %v) to a client without preface, want the connection closed", len(got), err)
	}
}

// dialRawTLS completes the client's mTLS handshake (ALPN h2) with e's server
// and returns the connection without speaking HTTP/2 on it.
func dialRawTLS(t *testing.T, e *env) *tls.Conn {
	t.Helper()
	svid, _ := e.certs.SVID(clientID)
	c, err := tls.Dial("tcp", e.proxy.String(), &tls.Config{
		InsecureSkipVerify: true, //nolint:gosec // only the server's protocol handling is tested
		Certificates:       []tls.Certificate{tlsCert(svid.Certificates, svid.PrivateKey)},
		MinVersion:         tls.VersionTLS13,
		NextProtos:         []string{hbone.ALPN},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// rawH2 completes the mTLS handshake with e's server, sends the HTTP/2
// client preface and an empty SETTINGS, and returns a framer on the
// connection.
func rawH2(t *testing.T, e *env) *http2.Framer {
	t.Helper()
	c := dialRawTLS(t, e)
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return fr
}

// readUntilClosed reads frames until the server closes the connection and
// returns their types.
func readUntilClosed(fr *http2.Framer) []http2.FrameType {
	var got []http2.FrameType
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return got
		}
		got = append(got, f.Header().Type)
	}
}

// TestIdleTimeoutGoAway: a connection without streams for IdleTimeout gets
// GOAWAY and is closed.
func TestIdleTimeoutGoAway(t *testing.T) {
	e := newEnv(t, func(c *hbone.ServerConfig) { c.IdleTimeout = 20 * time.Millisecond })
	got := readUntilClosed(rawH2(t, e))
	if len(got) == 0 || got[len(got)-1] != http2.FrameGoAway {
		t.Errorf("frames before the close = %v, want GOAWAY last", got)
	}
}

// TestPingTimeout: a client that goes silent gets a PING, and the
// connection is closed when the ack does not come within PingTimeout.
func TestPingTimeout(t *testing.T) {
	e := newEnv(t, func(c *hbone.ServerConfig) {
		c.PingInterval, c.PingTimeout = 10*time.Millisecond, 10*time.Millisecond
	})
	got := readUntilClosed(rawH2(t, e))
	if !slices.Contains(got, http2.FramePing) {
		t.Errorf("frames before the close = %v, want a PING", got)
	}
	if slices.Contains(got, http2.FrameGoAway) {
		t.Errorf("frames before the close = %v: an idle GOAWAY, not the ping timeout", got)
	}
	if st := e.srv.Stats(); st.PingTimeouts != 1 || st.ProtocolErrors != 0 {
		t.Errorf("ping timeouts / protocol errors counted = %d / %d, want 1 / 0", st.PingTimeouts, st.ProtocolErrors)
	}
}
