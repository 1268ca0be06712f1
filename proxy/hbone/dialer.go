package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// DefaultPort is the HBONE port of every mesh pod.
const DefaultPort = 15008

// DialerConfig configures a Dialer. Certs is required; a zero limit takes
// its Default.
type DialerConfig struct {
	// Certs gives the source SVIDs and the trust bundle, per handshake.
	Certs Certs
	// DialContext opens the TCP connection to a destination's :15008 (the
	// data plane dials from the right netns with the bypass mark); nil uses
	// a net.Dialer.
	DialContext func(ctx context.Context, network, address string) (net.Conn, error)
	// Logger receives connection events; nil discards them.
	Logger *slog.Logger

	// HandshakeTimeout bounds TCP connect + mTLS on a new pooled connection.
	HandshakeTimeout time.Duration
	// StreamWindow and ConnWindow are the receive flow-control windows.
	StreamWindow, ConnWindow int
	// MaxFrameSize is SETTINGS_MAX_FRAME_SIZE: the largest DATA frame the
	// server may send (DefaultDialerMaxFrameSize). Frames the dialer sends
	// are bounded by the server's setting instead.
	MaxFrameSize int
	// PingInterval and PingTimeout detect dead peers; a connection whose
	// ping is not answered is closed and evicted.
	PingInterval, PingTimeout time.Duration
}

// Request names one HBONE stream.
type Request struct {
	// Source is the SPIFFE ID of the connecting workload; its SVID is presented.
	Source spiffeid.ID
	// Proxy is the destination's HBONE address (the pod's IP, port 15008).
	Proxy netip.AddrPort
	// Target is the address sent as the CONNECT authority (the pod's IP and
	// the application port).
	Target netip.AddrPort
	// Expected, when set (from WDS), is the exact SPIFFE ID the server must
	// present; when zero any SVID of Source's trust domain is accepted.
	Expected spiffeid.ID
	// Origin, when set, keeps streams of different origins (the data
	// plane: the source pod, whose netns DialContext dials from) on
	// different pooled connections even when they share a Source identity.
	// DialContext reads it from its ctx with OriginFrom.
	Origin string
}

// poolKey is what a pooled connection is shared by: one source identity to
// one destination proxy address (and the identity it must present).
type poolKey struct {
	source, expected spiffeid.ID
	proxy            netip.AddrPort
	origin           string
}

type poolEntry struct {
	conns   []*http.ClientConn
	dialing chan struct{} // non-nil while a connection is being opened
}

// Dialer opens HBONE streams over pooled HTTP/2 connections.
type Dialer struct {
	cfg  DialerConfig
	log  *slog.Logger
	tr   *http.Transport
	stat dialerCounters

	mu     sync.Mutex
	closed bool
	pool   map[poolKey]*poolEntry
}

type keyCtx struct{}

// NewDialer returns a Dialer for cfg; it does no I/O.
func NewDialer(cfg DialerConfig) (*Dialer, error) {
	if cfg.Certs == nil {
		return nil, errors.New("failed to create hbone dialer: Certs is required")
	}
	orDefault(&cfg.HandshakeTimeout, DefaultHandshakeTimeout)
	orDefault(&cfg.PingInterval, DefaultPingInterval)
	orDefault(&cfg.PingTimeout, DefaultPingTimeout)
	orDefault(&cfg.StreamWindow, DefaultStreamWindow)
	orDefault(&cfg.ConnWindow, DefaultConnWindow)
	orDefault(&cfg.MaxFrameSize, DefaultDialerMaxFrameSize)
	if cfg.DialContext == nil {
		cfg.DialContext = (&net.Dialer{}).DialContext
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Dialer{cfg: cfg, log: log, pool: map[poolKey]*poolEntry{}}
	// HTTP/2 "without TLS" over the mTLS connection dialTLS returns (see
	// hboneConn): the wire is HTTP/2 over TLS with ALPN h2.
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	d.tr = &http.Transport{
		Protocols:   &protos,
		DialContext: d.dialTLS,
		HTTP2:       h2Config(0, cfg.MaxFrameSize, cfg.ConnWindow, cfg.StreamWindow, cfg.PingInterval, cfg.PingTimeout),
	}
	return d, nil
}

// Stats returns a snapshot of the counters.
func (d *Dialer) Stats() DialerStats { return d.stat.snapshot() }

// dialTLS opens the TCP connection and runs the mTLS handshake for the pool
// key carried by ctx.
func (d *Dialer) dialTLS(ctx context.Context, network, address string) (net.Conn, error) {
	key, ok := ctx.Value(keyCtx{}).(poolKey)
	if !ok {
		return nil, errors.New("failed to dial hbone: no pool key")
	}
	c, err := d.cfg.DialContext(ctx, network, address)
	if err != nil {
		return nil, fmt.Errorf("failed to dial hbone proxy %q: %w", address, err)
	}
	raw := &recordBatcher{Conn: c}
	hc, err := handshake(ctx, raw, tls.Client(raw, clientTLSConfig(d.cfg.Certs, key.source, key.expected)))
	if err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("failed to handshake with hbone proxy %q: %w", address, err)
	}
	if p := hc.ConnectionState().NegotiatedProtocol; p != ALPN {
		_ = hc.Close()
		return nil, fmt.Errorf("failed to negotiate alpn %q with hbone proxy %q: got %q", ALPN, address, p)
	}
	return hc, nil
}

// OriginFrom returns the Request.Origin of the connection DialContext is
// called for ("" when none was set).
func OriginFrom(ctx context.Context) string {
	key, _ := ctx.Value(keyCtx{}).(poolKey)
	return key.origin
}

// CloseOrigin closes the pooled connections of origin (its pod is gone);
// their open streams fail.
func (d *Dialer) CloseOrigin(origin string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, e := range d.pool {
		if k.origin != origin {
			continue
		}
		for _, cc := range e.conns {
			_ = cc.Close()
			d.stat.connsPooled.Add(-1)
		}
		e.conns = nil
		if e.dialing == nil {
			delete(d.pool, k)
		}
	}
}

// Dial opens a CONNECT stream for req on a pooled connection, opening one
// when none of the key has a free stream slot. ctx bounds the connection
// setup and the wait for the response headers, not the stream's lifetime.
func (d *Dialer) Dial(ctx context.Context, req Request) (*Stream, error) {
	key := poolKey{source: req.Source, expected: req.Expected, proxy: req.Proxy, origin: req.Origin}
	for attempt := 0; ; attempt++ {
		cc, fresh, err := d.reserve(ctx, key)
		if err != nil {
			d.stat.streamsFailed.Add(1)
			return nil, err
		}
		st, err := d.connect(ctx, cc, req)
		if err == nil {
			d.stat.streamsOpened.Add(1)
			return st, nil
		}
		// A reused connection that failed the request without an answer
		// (it broke or got GOAWAY since the pool check) is evicted and the
		// stream retried once on a new one.
		var se *StatusError
		if !fresh && attempt == 0 && !errors.As(err, &se) {
			d.evict(key, cc)
			continue
		}
		d.stat.streamsFailed.Add(1)
		return nil, err
	}
}

// reserve returns a pooled connection of key with a stream slot reserved,
// opening a connection when none has a free slot. fresh reports a new one.
func (d *Dialer) reserve(ctx context.Context, key poolKey) (*http.ClientConn, bool, error) {
	for {
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			return nil, false, errors.New("failed to dial hbone: dialer closed")
		}
		e := d.pool[key]
		if e == nil {
			e = &poolEntry{}
			d.pool[key] = e
		}
		live := e.conns[:0]
		var found *http.ClientConn
		for _, cc := range e.conns {
			if cc.Err() != nil {
				d.stat.connsEvicted.Add(1)
				d.stat.connsPooled.Add(-1)
				_ = cc.Close()
				continue
			}
			live = append(live, cc)
			if found == nil && cc.Reserve() == nil {
				found = cc
			}
		}
		clear(e.conns[len(live):])
		e.conns = live
		if found != nil {
			d.mu.Unlock()
			return found, false, nil
		}
		if wait := e.dialing; wait != nil {
			d.mu.Unlock()
			select {
			case <-wait:
				continue
			case <-ctx.Done():
				return nil, false, fmt.Errorf("failed to wait for hbone connection to %q: %w", key.proxy, ctx.Err())
			}
		}
		e.dialing = make(chan struct{})
		d.mu.Unlock()

		cc, err := d.open(ctx, key)

		d.mu.Lock()
		close(e.dialing)
		e.dialing = nil
		if err == nil {
			if d.closed {
				err = errors.New("failed to dial hbone: dialer closed")
				_ = cc.Close()
			} else if err = cc.Reserve(); err == nil {
				e.conns = append(e.conns, cc)
				d.stat.connsPooled.Add(1)
			} else {
				_ = cc.Close()
			}
		}
		d.mu.Unlock()
		if err != nil {
			return nil, false, err
		}
		return cc, true, nil
	}
}

func (d *Dialer) open(ctx context.Context, key poolKey) (*http.ClientConn, error) {
	hctx, cancel := context.WithTimeout(context.WithValue(ctx, keyCtx{}, key), d.cfg.HandshakeTimeout)
	defer cancel()
	cc, err := d.tr.NewClientConn(hctx, "http", key.proxy.String())
	if err != nil {
		d.stat.connsFailed.Add(1)
		return nil, fmt.Errorf("failed to open hbone connection %q from %q: %w", key.proxy, key.source, err)
	}
	d.stat.connsOpened.Add(1)
	d.log.Debug("hbone connection opened", "source_id", key.source.String(), "proxy", key.proxy.String())
	return cc, nil
}

func (d *Dialer) evict(key poolKey, cc *http.ClientConn) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.pool[key]
	if e == nil {
		return
	}
	for i, c := range e.conns {
		if c == cc {
			e.conns = append(e.conns[:i], e.conns[i+1:]...)
			d.stat.connsEvicted.Add(1)
			d.stat.connsPooled.Add(-1)
			if cc.Err() != nil {
				_ = cc.Close()
			}
			// Otherwise it is closing (GOAWAY): its streams finish and it
			// closes itself.
			return
		}
	}
}

// connect sends CONNECT on cc (a slot is reserved) and waits for the answer.
func (d *Dialer) connect(ctx context.Context, cc *http.ClientConn, req Request) (*Stream, error) {
	pr, pw := io.Pipe()
	// The stream outlives ctx: ctx only bounds the wait for the headers.
	sctx, cancel := context.WithCancel(context.Background())
	stop := context.AfterFunc(ctx, cancel)
	hreq := (&http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Scheme: "http", Host: req.Proxy.String()},
		Host:   req.Target.String(),
		Header: http.Header{},
		Body:   pr,
	}).WithContext(sctx)
	resp, err := cc.RoundTrip(hreq)
	stopped := stop()
	if err == nil && !stopped {
		// ctx ended while the headers arrived: the stream is canceled.
		_ = resp.Body.Close()
		err = ctx.Err()
	}
	if err != nil {
		cancel()
		_ = pw.CloseWithError(err)
		return nil, fmt.Errorf("failed to connect %q via hbone proxy %q: %w", req.Target, req.Proxy, err)
	}
	if resp.StatusCode != http.StatusOK {
		cancel()
		_ = resp.Body.Close()
		_ = pw.Close()
		return nil, fmt.Errorf("failed to connect %q via hbone proxy %q: %w", req.Target, req.Proxy,
			&StatusError{Code: resp.StatusCode, Err: errors.New(resp.Status)})
	}
	var peer spiffeid.ID
	if resp.TLS != nil {
		peer, _ = peerID(resp.TLS.PeerCertificates)
	}
	return &Stream{body: resp.Body, pw: pw, cancel: cancel, target: req.Target, peer: peer}, nil
}

// Close closes every pooled connection; streams on them fail.
func (d *Dialer) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	for k, e := range d.pool {
		for _, cc := range e.conns {
			_ = cc.Close()
			d.stat.connsPooled.Add(-1)
		}
		delete(d.pool, k)
	}
	return nil
}

// Stream is one HBONE CONNECT stream; it implements net.Conn without
// deadlines (they return ErrDeadlineUnsupported) and CloseWrite, which sends
// END_STREAM.
type Stream struct {
	body   io.ReadCloser
	pw     *io.PipeWriter
	cancel context.CancelFunc
	target netip.AddrPort
	peer   spiffeid.ID
	once   sync.Once
}

// ErrDeadlineUnsupported is returned by a Stream's deadline setters.
var ErrDeadlineUnsupported = errors.New("hbone stream deadlines are not supported")

var _ net.Conn = (*Stream)(nil)

// Peer returns the verified SPIFFE ID of the destination proxy.
func (s *Stream) Peer() spiffeid.ID { return s.peer }

// Read reads what the target sent; io.EOF after the server ends the stream.
func (s *Stream) Read(p []byte) (int, error) { return s.body.Read(p) }

// Write sends p to the target.
func (s *Stream) Write(p []byte) (int, error) { return s.pw.Write(p) }

// CloseWrite half-closes the stream (END_STREAM); Read keeps working.
func (s *Stream) CloseWrite() error { return s.pw.Close() }

// Close resets the stream in both directions.
func (s *Stream) Close() error {
	s.once.Do(func() {
		_ = s.pw.CloseWithError(net.ErrClosed)
		_ = s.body.Close()
		s.cancel()
	})
	return nil
}

// LocalAddr returns a placeholder: a stream has no local socket address.
func (s *Stream) LocalAddr() net.Addr { return hboneAddr{} }

// RemoteAddr returns the CONNECT target.
func (s *Stream) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(s.target) }

// SetDeadline is not supported.
func (s *Stream) SetDeadline(time.Time) error { return ErrDeadlineUnsupported }

// SetReadDeadline is not supported.
func (s *Stream) SetReadDeadline(time.Time) error { return ErrDeadlineUnsupported }

// SetWriteDeadline is not supported.
func (s *Stream) SetWriteDeadline(time.Time) error { return ErrDeadlineUnsupported }
