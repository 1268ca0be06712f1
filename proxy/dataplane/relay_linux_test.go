package dataplane_test

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"golang.org/x/sys/unix"

	"aether.io/node/proxy/dataplane"
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/proxytest"
)

// The bare mTLS relay: the least any TLS tunnel between two pods pays, as
// a floor for HBONE. The source relay listens in the client pod, accepts
// the app's TCP, dials the destination relay in the server pod over TLS 1.3
// (the pods' SVIDs, the same TLS settings as HBONE) and copies both ways;
// the destination relay terminates TLS and copies to the app. No HTTP/2,
// no framing: io.CopyBuffer with 256 KiB buffers each way. crypto/tls
// writes each record (16 KiB) with its own write(2); the batched variant
// sends the records of one copied chunk with one write(2), as HBONE's
// record batcher does per HTTP/2 flush.
const (
	relayPort = 15010 // source relay (client pod), destination relay (server pod); +1 batched
	relayBuf  = 256 << 10
)

// relay is a running pair of relays; Suite is the cipher suite the last
// relayed connection negotiated.
type relay struct {
	// Addr is where the app connects (in the client pod, with the bypass
	// mark, so that the capture divert leaves it alone).
	Addr  netip.AddrPort
	suite chan uint16
}

// markedDial connects from inside p to dst with the bypass mark, as the
// proxy's own upstream sockets are.
func markedDial(ctx context.Context, p *proxytest.Pod, dst netip.AddrPort) (*net.TCPConn, error) {
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, dataplane.DefaultBypassMark)
		}); err != nil {
			return err
		}
		return serr
	}}
	var c net.Conn
	if err := p.NS.Do(func() error {
		var err error
		c, err = d.DialContext(ctx, "tcp", dst.String())
		return err
	}); err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// relayTLS is HBONE's TLS: TLS 1.3 only, ALPN h2, SPIFFE mTLS.
func relayTLS(c *tls.Config) *tls.Config {
	c.MinVersion = tls.VersionTLS13
	c.NextProtos = []string{hbone.ALPN}
	return c
}

// startRelay runs the two relays of e: from the client pod to the app at
// app (in the server pod); batched sends the TLS records of each copied
// chunk with one write(2).
func startRelay(tb testing.TB, e *hboneEnv, app netip.AddrPort, batched bool) *relay {
	tb.Helper()
	clientSVID, _ := e.certs.SVID(podID(e.client))
	serverSVID, _ := e.certs.SVID(podID(e.server))
	bundle := e.ca.Bundle()
	serverCfg := relayTLS(tlsconfig.MTLSServerConfig(serverSVID, bundle, tlsconfig.AuthorizeID(podID(e.client))))
	clientCfg := relayTLS(tlsconfig.MTLSClientConfig(clientSVID, bundle, tlsconfig.AuthorizeID(podID(e.server))))
	port := uint16(relayPort)
	if batched {
		port++
	}
	r := &relay{Addr: netip.AddrPortFrom(e.client.IP4, port), suite: make(chan uint16, 16)}
	dstAddr := netip.AddrPortFrom(e.server.IP4, port)
	// wrap returns the TLS side's writer: the records of each Write in
	// one write(2) when batched.
	wrap := func(raw net.Conn, tlsConn func(net.Conn) *tls.Conn) (*tls.Conn, io.Writer) {
		if !batched {
			tc := tlsConn(raw)
			return tc, onlyWriter{tc}
		}
		bc := &batchConn{Conn: raw}
		tc := tlsConn(bc)
		return tc, batchWriter{tc, bc}
	}

	e.server.Handle(tb, port, func(c net.Conn) {
		tc, tw := wrap(c, func(c net.Conn) *tls.Conn { return tls.Server(c, serverCfg) })
		if err := tc.HandshakeContext(context.Background()); err != nil {
			return
		}
		up, err := markedDial(context.Background(), e.server, app)
		if err != nil {
			return
		}
		pipeBoth(tc, up, tw, onlyWriter{up})
	})
	e.client.Handle(tb, port, func(c net.Conn) {
		raw, err := markedDial(context.Background(), e.client, dstAddr)
		if err != nil {
			return
		}
		tc, tw := wrap(raw, func(c net.Conn) *tls.Conn { return tls.Client(c, clientCfg) })
		if err := tc.HandshakeContext(context.Background()); err != nil {
			_ = raw.Close()
			return
		}
		select {
		case r.suite <- tc.ConnectionState().CipherSuite:
		default:
		}
		pipeBoth(c, tc, onlyWriter{c}, tw)
	})
	return r
}

// batchConn is the TCP connection under a batched relay's tls.Conn: while
// a batch is open (one Write of the tls.Conn by batchWriter) it collects
// the records; otherwise (handshake, alerts) writes pass through.
type batchConn struct {
	net.Conn
	mu  sync.Mutex
	on  bool
	buf []byte
}

func (c *batchConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.on {
		return c.Conn.Write(p)
	}
	c.buf = append(c.buf, p...)
	return len(p), nil
}

// batchWriter writes to a tls.Conn over a batchConn: one write(2) per Write.
type batchWriter struct {
	tc *tls.Conn
	bc *batchConn
}

func (w batchWriter) Write(p []byte) (int, error) {
	w.bc.mu.Lock()
	w.bc.on = true
	w.bc.mu.Unlock()
	n, err := w.tc.Write(p)
	w.bc.mu.Lock()
	defer w.bc.mu.Unlock()
	w.bc.on = false
	if len(w.bc.buf) > 0 {
		if _, werr := w.bc.Conn.Write(w.bc.buf); err == nil {
			err = werr
		}
		w.bc.buf = w.bc.buf[:0]
	}
	return n, err
}

// onlyReader and onlyWriter hide ReaderFrom / WriterTo, so that
// io.CopyBuffer uses its buffer (the large reads and writes of a relay).
type (
	onlyReader struct{ io.Reader }
	onlyWriter struct{ io.Writer }
)

// pipeBoth copies a → b (written through wb) and b → a (through wa) with
// 256 KiB buffers, passing each EOF on as a half-close, and closes both
// when both directions are done.
func pipeBoth(a, b net.Conn, wa, wb io.Writer) {
	done := make(chan struct{})
	one := func(dst net.Conn, w io.Writer, src net.Conn) {
		_, err := io.CopyBuffer(w, onlyReader{src}, make([]byte, relayBuf))
		if err == nil {
			if cw, ok := dst.(interface{ CloseWrite() error }); ok {
				_ = cw.CloseWrite()
			}
		} else {
			_ = a.Close()
			_ = b.Close()
		}
		done <- struct{}{}
	}
	go one(b, wb, a)
	go one(a, wa, b)
	<-done
	<-done
	_ = a.Close()
	_ = b.Close()
}

// hboneSuite returns the cipher suite the server pod's HBONE listener
// (:15008) negotiates with the client pod's SVID, as the proxy's dialer
// presents it: the suite the relay must match.
func hboneSuite(tb testing.TB, e *hboneEnv) uint16 {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw, err := markedDial(ctx, e.client, netip.AddrPortFrom(e.server.IP4, 15008))
	if err != nil {
		tb.Fatal(err)
	}
	defer func() { _ = raw.Close() }()
	clientSVID, _ := e.certs.SVID(podID(e.client))
	tc := tls.Client(raw, relayTLS(tlsconfig.MTLSClientConfig(clientSVID, e.ca.Bundle(), tlsconfig.AuthorizeID(podID(e.server)))))
	if err := tc.HandshakeContext(ctx); err != nil {
		tb.Fatal(err)
	}
	st := tc.ConnectionState()
	if st.NegotiatedProtocol != hbone.ALPN {
		tb.Fatalf("ALPN %q, want %q", st.NegotiatedProtocol, hbone.ALPN)
	}
	return st.CipherSuite
}

// TestRelay: the bare mTLS relay of the HBONE benchmarks carries bytes
// both ways with half-closes, under mutual TLS with the cipher suite the
// HBONE listener negotiates.
func TestRelay(t *testing.T) {
	e := setupHBONE(t)
	srv := e.server.Serve(t, 9000)
	want := hboneSuite(t, e)
	t.Logf("cipher suite %s", tls.CipherSuiteName(want))
	for _, batched := range []bool{false, true} {
		t.Run(map[bool]string{false: "bare", true: "batched"}[batched], func(t *testing.T) {
			testRelay(t, e, srv, startRelay(t, e, netip.AddrPortFrom(e.server.IP4, 9000), batched), want)
		})
	}
}

func testRelay(t *testing.T, e *hboneEnv, srv *proxytest.Server, r *relay, want uint16) {
	ctx := ctx10(t)
	c, err := markedDial(ctx, e.client, r.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	payload := make([]byte, 3<<20)
	if _, err := c.Write(payload); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	reply, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	// The app sees the destination relay (the server pod's own address).
	if w := "got 3145728 from " + e.server.IP4.String(); string(reply) != w {
		t.Fatalf("reply %q, want %q", reply, w)
	}
	<-srv.Got
	if got := <-r.suite; got != want {
		t.Fatalf("relay negotiated %s, HBONE %s", tls.CipherSuiteName(got), tls.CipherSuiteName(want))
	}
}
