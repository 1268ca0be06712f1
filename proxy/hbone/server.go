package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Defaults of ServerConfig and DialerConfig (see README.md "Limits").
const (
	DefaultHandshakeTimeout     = 10 * time.Second
	DefaultIdleTimeout          = time.Hour
	DefaultMaxConcurrentStreams = 100
	DefaultStreamWindow         = 4 << 20
	DefaultConnWindow           = 16 << 20
	DefaultMaxFrameSize         = 16 << 10
	DefaultDialerMaxFrameSize   = 256 << 10
	DefaultPingInterval         = time.Minute
	DefaultPingTimeout          = 15 * time.Second
)

// DeliverFunc connects a verified CONNECT stream to its target: the data plane
// dials the app over TCP or its unix socket. src is the peer's verified SPIFFE
// ID. The returned conn is closed by the Server; a *net.TCPConn or
// *net.UnixConn gets CloseWrite when the client half-closes.
type DeliverFunc func(ctx context.Context, src spiffeid.ID, target netip.AddrPort) (net.Conn, error)

// StatusError makes a DeliverFunc's failure answer a given HTTP status
// instead of 503.
type StatusError struct {
	Code int
	Err  error
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("hbone status %d: %v", e.Code, e.Err)
}

func (e *StatusError) Unwrap() error { return e.Err }

// ServerConfig configures a Server. Identity, Certs and Deliver are required;
// a zero limit takes its Default.
type ServerConfig struct {
	// Identity is the SPIFFE ID whose SVID the server presents (the pod's).
	Identity spiffeid.ID
	// Certs gives the SVID of Identity and the trust bundle, per handshake.
	Certs Certs
	// Deliver connects each accepted stream to its target.
	Deliver DeliverFunc
	// Logger receives errors; nil discards them.
	Logger *slog.Logger

	// HandshakeTimeout bounds the TCP accept → mTLS done time.
	HandshakeTimeout time.Duration
	// IdleTimeout closes a connection without streams for this long.
	IdleTimeout time.Duration
	// MaxConcurrentStreams is SETTINGS_MAX_CONCURRENT_STREAMS per connection.
	MaxConcurrentStreams int
	// StreamWindow and ConnWindow are the receive flow-control windows.
	StreamWindow, ConnWindow int
	// MaxFrameSize is SETTINGS_MAX_FRAME_SIZE: the largest DATA frame a
	// client may send. net/http's client holds a buffer of this size (at
	// most 512 KiB) per open stream, idle or not (README.md).
	MaxFrameSize int
	// PingInterval and PingTimeout detect dead peers on idle connections.
	PingInterval, PingTimeout time.Duration
}

// orDefault sets a zero or negative limit to its default.
func orDefault[T int | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// Server serves HBONE for one identity on listeners it is given.
type Server struct {
	cfg  ServerConfig
	log  *slog.Logger
	tls  *tls.Config
	hs   *http.Server
	conn *connListener
	stat serverCounters

	mu        sync.Mutex
	closed    bool
	listeners map[net.Listener]struct{}
	pending   map[net.Conn]struct{} // accepted, handshake in progress
	wg        sync.WaitGroup        // accept loops, handshakes, handlers
	serving   bool                  // hs.Serve runs (on the first Serve)
	served    chan error            // hs.Serve's result
	handlers  int                   // stream handlers running
	drained   chan struct{}         // closed when handlers drops to 0 (during shutdown)

	shutdownOnce sync.Once
	shutdownErr  error
}

// NewServer returns a Server for cfg; it does no I/O.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Identity.IsZero() || cfg.Certs == nil || cfg.Deliver == nil {
		return nil, errors.New("failed to create hbone server: Identity, Certs and Deliver are required")
	}
	orDefault(&cfg.HandshakeTimeout, DefaultHandshakeTimeout)
	orDefault(&cfg.IdleTimeout, DefaultIdleTimeout)
	orDefault(&cfg.PingInterval, DefaultPingInterval)
	orDefault(&cfg.PingTimeout, DefaultPingTimeout)
	orDefault(&cfg.MaxConcurrentStreams, DefaultMaxConcurrentStreams)
	orDefault(&cfg.StreamWindow, DefaultStreamWindow)
	orDefault(&cfg.ConnWindow, DefaultConnWindow)
	orDefault(&cfg.MaxFrameSize, DefaultMaxFrameSize)
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		cfg:       cfg,
		log:       log,
		tls:       serverTLSConfig(cfg.Certs, cfg.Identity),
		conn:      newConnListener(),
		listeners: map[net.Listener]struct{}{},
		pending:   map[net.Conn]struct{}{},
		served:    make(chan error, 1),
	}
	// HTTP/2 "without TLS" over the mTLS connections handshake hands over
	// (see hboneConn): the wire is HTTP/2 over TLS with ALPN h2.
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	s.hs = &http.Server{
		Handler:     http.HandlerFunc(s.serveHTTP),
		Protocols:   &protos,
		IdleTimeout: cfg.IdleTimeout,
		// Bounds the wait for the HTTP/2 client preface after the
		// handshake (net/http's HTTP/2 server does not use it otherwise).
		ReadHeaderTimeout: cfg.HandshakeTimeout,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			if sc, ok := c.(serverConn); ok {
				ctx = context.WithValue(ctx, connCtx{}, sc.hc)
			}
			return ctx
		},
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		HTTP2: h2Config(cfg.MaxConcurrentStreams, cfg.MaxFrameSize, cfg.ConnWindow, cfg.StreamWindow,
			cfg.PingInterval, cfg.PingTimeout),
	}
	return s, nil
}

// h2Config is the HTTP/2 configuration both sides share (maxStreams is the
// server's SETTINGS_MAX_CONCURRENT_STREAMS; zero on the client).
func h2Config(maxStreams, frame, connWindow, streamWindow int, ping, pingTimeout time.Duration) *http.HTTP2Config {
	return &http.HTTP2Config{
		MaxConcurrentStreams:          maxStreams,
		MaxReadFrameSize:              frame,
		MaxReceiveBufferPerConnection: connWindow,
		MaxReceiveBufferPerStream:     streamWindow,
		SendPingTimeout:               ping,
		PingTimeout:                   pingTimeout,
	}
}

// Stats returns a snapshot of the counters.
func (s *Server) Stats() ServerStats { return s.stat.snapshot() }

// Serve accepts HBONE connections on l until l fails or Shutdown is called;
// it may be called for several listeners. It returns nil after Shutdown.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = l.Close()
		return nil
	}
	s.listeners[l] = struct{}{}
	s.wg.Add(1)
	if !s.serving {
		s.serving = true
		go func() { s.served <- s.hs.Serve(s.conn) }()
	}
	s.mu.Unlock()
	defer s.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			delete(s.listeners, l)
			s.mu.Unlock()
			if closed {
				return nil
			}
			return fmt.Errorf("failed to accept hbone connection on %q: %w", l.Addr(), err)
		}
		s.stat.accepted.Add(1)
		if !s.track(c) {
			_ = c.Close()
			continue
		}
		go s.handshake(c)
	}
}

func (s *Server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.pending[c] = struct{}{}
	s.wg.Add(1)
	return true
}

// handshake runs the mTLS handshake under HandshakeTimeout and hands the
// connection to the HTTP/2 server.
func (s *Server) handshake(c net.Conn) {
	defer s.wg.Done()
	// The connection leaves pending before it is handed to the HTTP/2
	// server: from then on Shutdown drains it instead of closing it.
	untrack := func() {
		s.mu.Lock()
		delete(s.pending, c)
		s.mu.Unlock()
	}
	_ = c.SetDeadline(time.Now().Add(s.cfg.HandshakeTimeout))
	raw := &recordBatcher{Conn: c}
	hc, err := handshake(context.Background(), raw, tls.Server(raw, s.tls))
	if err == nil && hc.ConnectionState().NegotiatedProtocol != ALPN {
		err = fmt.Errorf("failed to negotiate alpn %q: got %q", ALPN, hc.ConnectionState().NegotiatedProtocol)
	}
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			s.stat.handshakeTimeouts.Add(1)
		} else {
			s.stat.handshakeFailures.Add(1)
		}
		s.log.Debug("hbone handshake failed", "remote", c.RemoteAddr().String(), "error", err)
		untrack()
		_ = c.Close()
		return
	}
	_ = c.SetDeadline(time.Time{})
	s.stat.handshakes.Add(1)
	untrack()
	if !s.conn.push(serverConn{hc, hc}) {
		_ = hc.Close()
	}
}

// serveHTTP serves one HTTP/2 stream: CONNECT <ip>:<port> from a verified peer.
func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	s.wg.Add(1)
	defer s.wg.Done()
	s.mu.Lock()
	s.handlers++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.handlers--
		if s.handlers == 0 && s.drained != nil {
			close(s.drained)
			s.drained = nil
		}
		s.mu.Unlock()
	}()
	if r.Method != http.MethodConnect {
		s.stat.streamsBadRequest.Add(1)
		w.WriteHeader(http.StatusMethodNotAllowed)
		return
	}
	target, err := netip.ParseAddrPort(r.Host)
	if err != nil {
		s.stat.streamsBadRequest.Add(1)
		http.Error(w, "authority must be ip:port", http.StatusBadRequest)
		return
	}
	// The peer's SPIFFE ID was verified and read once, at the handshake.
	hc, ok := r.Context().Value(connCtx{}).(*hboneConn)
	if !ok || hc.peer.IsZero() {
		s.stat.streamsBadRequest.Add(1)
		w.WriteHeader(http.StatusForbidden)
		return
	}
	ctx := r.Context()
	if ap, err := netip.ParseAddrPort(r.RemoteAddr); err == nil {
		ctx = context.WithValue(ctx, peerAddrCtx{}, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
	}
	up, err := s.cfg.Deliver(ctx, hc.peer, target)
	if err != nil {
		s.stat.streamsDeliverFailed.Add(1)
		code := http.StatusServiceUnavailable
		var se *StatusError
		if errors.As(err, &se) {
			code = se.Code
		}
		s.log.Error("failed to deliver hbone stream", "source_id", hc.peer.String(), "target", target.String(), "error", err)
		w.WriteHeader(code)
		return
	}
	defer func() { _ = up.Close() }()
	s.stat.streamsOpened.Add(1)
	s.stat.streamsActive.Add(1)
	defer s.stat.streamsActive.Add(-1)
	// A reset stream or a closed connection cancels r's context: unblock
	// both copies by closing the upstream.
	stop := context.AfterFunc(r.Context(), func() { _ = up.Close() })
	defer stop()

	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	if err := rc.Flush(); err != nil {
		return
	}
	inDone := make(chan struct{})
	go func() {
		defer close(inDone)
		if err := copyAdaptive(up, r.Body, nil); err != nil {
			_ = up.Close()
			return
		}
		closeWrite(up)
	}()
	// Upstream → client. When the upstream ends, the response ends too
	// (END_STREAM): Go's HTTP/2 server cannot half-close the response
	// while the request body is still open (see README.md).
	err = copyAdaptive(w, up, rc.Flush)
	_ = r.Body.Close()
	<-inDone
	if err != nil {
		// The upstream failed (reset by the app, or closed under the copy:
		// the data plane's idle timeout, the pod closing) or the client
		// went away: reset the stream (RST_STREAM) as a TCP proxy resets
		// its client, never a clean END_STREAM that hides the failure.
		panic(http.ErrAbortHandler)
	}
}

type peerAddrCtx struct{}

// connCtx carries a stream's *hboneConn in its request context.
type connCtx struct{}

// PeerAddr returns, inside a DeliverFunc, the TCP address the stream's
// HBONE connection came from (the source pod's address when the source
// proxy dials from the pod's netns).
func PeerAddr(ctx context.Context) (netip.AddrPort, bool) {
	a, ok := ctx.Value(peerAddrCtx{}).(netip.AddrPort)
	return a, ok
}

type closeWriter interface{ CloseWrite() error }

func closeWrite(c net.Conn) {
	if cw, ok := c.(closeWriter); ok {
		_ = cw.CloseWrite()
	}
}

// Shutdown stops accepting, sends GOAWAY on every connection and lets open
// streams finish until ctx is done; then it closes what is left. It returns
// when every goroutine of the Server has returned, with ctx's error if the
// deadline cut streams. Later calls wait for the first and return its result.
func (s *Server) Shutdown(ctx context.Context) error {
	s.shutdownOnce.Do(func() { s.shutdownErr = s.shutdown(ctx) })
	return s.shutdownErr
}

func (s *Server) shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.closed = true
	for l := range s.listeners {
		_ = l.Close()
	}
	for c := range s.pending {
		_ = c.Close()
	}
	serving := s.serving
	s.mu.Unlock()
	var err error
	if serving {
		// Shutdown closes s.conn, sends GOAWAY and waits for the
		// connections to go idle; at the deadline Close cuts them.
		err = s.hs.Shutdown(ctx)
		if err == nil {
			// hs.Shutdown returns once the connections are done; their
			// stream handlers may still be finishing: wait for them too.
			err = s.awaitHandlers(ctx)
		}
		if err != nil {
			_ = s.hs.Close()
		}
		if serr := <-s.served; !errors.Is(serr, http.ErrServerClosed) {
			s.log.Error("hbone http/2 server stopped", "error", serr)
		}
	}
	_ = s.conn.Close()
	s.wg.Wait()
	return err
}

// awaitHandlers waits until no stream handler runs, or ctx is done.
func (s *Server) awaitHandlers(ctx context.Context) error {
	s.mu.Lock()
	if s.handlers == 0 {
		s.mu.Unlock()
		return nil
	}
	drained := make(chan struct{})
	s.drained = drained
	s.mu.Unlock()
	select {
	case <-drained:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// connListener is the net.Listener the HTTP/2 server serves: it yields
// connections whose mTLS handshake is already done.
type connListener struct {
	ch     chan net.Conn
	done   chan struct{}
	closed sync.Once
}

func newConnListener() *connListener {
	return &connListener{ch: make(chan net.Conn), done: make(chan struct{})}
}

func (l *connListener) push(c net.Conn) bool {
	select {
	case l.ch <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *connListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *connListener) Close() error {
	l.closed.Do(func() { close(l.done) })
	return nil
}

func (l *connListener) Addr() net.Addr { return hboneAddr{} }

type hboneAddr struct{}

func (hboneAddr) Network() string { return "hbone" }
func (hboneAddr) String() string  { return "hbone" }
