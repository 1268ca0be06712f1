package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

// Defaults of ServerConfig and DialerConfig (see README.md "Limits").
const (
	DefaultHandshakeTimeout     = 10 * time.Second
	DefaultIdleTimeout          = time.Hour
	DefaultMaxConcurrentStreams = 100
	DefaultStreamWindow         = 1 << 20
	DefaultConnWindow           = 4 << 20
	DefaultMaxFrameSize         = 16 << 10
	DefaultDialerMaxFrameSize   = 256 << 10
	DefaultPingInterval         = time.Minute
	DefaultPingTimeout          = 15 * time.Second
	DefaultWriteTimeout         = 30 * time.Second
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
	// PingInterval and PingTimeout detect dead peers: a connection whose
	// client acknowledged nothing (PING or SETTINGS acks) for PingInterval
	// gets a PING, and is closed when its ack does not come in PingTimeout.
	PingInterval, PingTimeout time.Duration
	// WriteTimeout bounds every frame write: a client that does not read
	// loses its connection after it (counted in ServerStats.WriteTimeouts).
	WriteTimeout time.Duration
	// Budget caps the connections and the receive window of this Server,
	// shared with every Server given the same Budget (the data plane gives
	// one to all pods of the node); nil: a Budget of its own with the
	// defaults.
	Budget *Budget
}

// orDefault sets a zero or negative limit to its default.
func orDefault[T int | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// Server serves HBONE for one identity on listeners it is given, with its
// own HTTP/2 engine for CONNECT streams (h2Conn; README.md, "HTTP/2
// implementation").
type Server struct {
	cfg  ServerConfig
	log  *slog.Logger
	tls  *tls.Config
	stat serverCounters
	// Rate limits of the log lines a client can cause at will.
	connLog, deliverLog logLimiter

	mu        sync.Mutex
	closed    bool
	listeners map[net.Listener]struct{}
	pending   map[net.Conn]struct{} // accepted, handshake in progress
	conns     map[*h2Conn]struct{}  // established
	connsGone chan struct{}         // closed when conns empties (during shutdown)
	wg        sync.WaitGroup        // accept loops, connections, streams

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
	orDefault(&cfg.WriteTimeout, DefaultWriteTimeout)
	if cfg.Budget == nil {
		cfg.Budget = defaultBudget()
	}
	orDefault(&cfg.MaxConcurrentStreams, DefaultMaxConcurrentStreams)
	orDefault(&cfg.StreamWindow, DefaultStreamWindow)
	orDefault(&cfg.ConnWindow, DefaultConnWindow)
	orDefault(&cfg.MaxFrameSize, DefaultMaxFrameSize)
	cfg.MaxFrameSize = min(max(cfg.MaxFrameSize, DefaultMaxFrameSize), 1<<24-1)
	cfg.StreamWindow = min(cfg.StreamWindow, maxWindow)
	cfg.ConnWindow = min(max(cfg.ConnWindow, initialWindow), maxWindow)
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{
		cfg:       cfg,
		log:       log,
		tls:       serverTLSConfig(cfg.Certs, cfg.Identity),
		listeners: map[net.Listener]struct{}{},
		pending:   map[net.Conn]struct{}{},
		conns:     map[*h2Conn]struct{}{},
	}, nil
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
		src := sourceKey(c.RemoteAddr())
		if !s.cfg.Budget.admitConn(src) {
			// Over the node's or the source's connection cap: closed
			// before the handshake costs anything.
			s.stat.connsRejected.Add(1)
			if held, ok := s.connLog.allow(); ok {
				s.log.Warn("hbone connection over the connection cap closed",
					"remote", c.RemoteAddr().String(), "max_conns", s.cfg.Budget.cfg.MaxConns,
					"max_conns_per_source", s.cfg.Budget.cfg.MaxConnsPerSource, "suppressed", held)
			}
			_ = c.Close()
			continue
		}
		if !s.track(c) {
			s.cfg.Budget.leaveConn(src)
			_ = c.Close()
			continue
		}
		go s.handshake(c, src)
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

// handshake runs the mTLS handshake under HandshakeTimeout and then serves
// the connection's HTTP/2 until it closes.
func (s *Server) handshake(c net.Conn, src string) {
	defer s.wg.Done()
	leave := func() { s.cfg.Budget.leaveConn(src) }
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
		s.untrack(c, nil)
		_ = c.Close()
		leave()
		return
	}
	_ = c.SetDeadline(time.Time{})
	s.stat.handshakes.Add(1)
	// The connection leaves pending as it is established: from then on
	// Shutdown drains it (GOAWAY) instead of closing it.
	h := newH2Conn(s, hc, hc.peer)
	h.leave = leave
	if !s.untrack(c, h) {
		h.close(nil)
		return
	}
	h.serve()
}

// untrack moves c out of pending and, when h is not nil, h into conns;
// false when the server is shutting down.
func (s *Server) untrack(c net.Conn, h *h2Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pending, c)
	if s.closed {
		return false
	}
	if h != nil {
		s.conns[h] = struct{}{}
	}
	return true
}

// removeConn forgets a closed connection.
func (s *Server) removeConn(h *h2Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, h)
	if len(s.conns) == 0 && s.connsGone != nil {
		close(s.connsGone)
		s.connsGone = nil
	}
}

// sourceKey is the Budget key of a client: its IP address (the source
// pod's: the source proxy dials from the pod's netns).
func sourceKey(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.AddrPort().Addr().Unmap().String()
	}
	return a.String()
}

type peerAddrCtx struct{}

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
	conns := make([]*h2Conn, 0, len(s.conns))
	for h := range s.conns {
		conns = append(conns, h)
	}
	var gone chan struct{}
	if len(s.conns) > 0 {
		gone = make(chan struct{})
		s.connsGone = gone
	}
	s.mu.Unlock()
	// Each connection closes once its streams are done.
	for _, h := range conns {
		h.goAway(http2.ErrCodeNo)
	}
	var err error
	if gone != nil {
		select {
		case <-gone:
		case <-ctx.Done():
			err = ctx.Err()
			for _, h := range conns {
				h.close(err)
			}
		}
	}
	s.wg.Wait()
	return err
}

type hboneAddr struct{}

func (hboneAddr) Network() string { return "hbone" }
func (hboneAddr) String() string  { return "hbone" }
