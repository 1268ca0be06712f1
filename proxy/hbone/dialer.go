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

	"aether.io/node/pkg/meshcontract"
)

// DefaultPort is the HBONE port of every mesh pod (meshcontract.HBONEPort,
// which aether-cni's capture exempts from redirection).
const DefaultPort = meshcontract.HBONEPort

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
	// WriteTimeout bounds every frame write: a server that does not read
	// loses its connection after it (DialerStats.WriteTimeouts).
	WriteTimeout time.Duration
	// Budget bounds the receive window the Dialer's connections grant
	// beyond the initial 64 KiB, the send buffers their streams hold and
	// the control frames they queue, in total and per Request.Origin (the
	// source pod; its connection caps do not apply to the Dialer); nil: a
	// Budget of its own with the defaults.
	Budget *Budget
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
	conns   []*h2Client
	dialing chan struct{} // non-nil while a connection is being opened
}

// Dialer opens HBONE streams over pooled HTTP/2 connections of its own
// client engine (h2Client).
type Dialer struct {
	cfg  DialerConfig
	log  *slog.Logger
	stat dialerCounters
	wg   sync.WaitGroup // the connections' read and write loops

	mu      sync.Mutex
	closed  bool
	pool    map[poolKey]*poolEntry
	opening map[*h2Client]struct{} // connections waiting for the server's SETTINGS
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
	orDefault(&cfg.WriteTimeout, DefaultWriteTimeout)
	if cfg.Budget == nil {
		cfg.Budget = defaultBudget()
	}
	orDefault(&cfg.StreamWindow, DefaultStreamWindow)
	orDefault(&cfg.ConnWindow, DefaultConnWindow)
	orDefault(&cfg.MaxFrameSize, DefaultDialerMaxFrameSize)
	cfg.MaxFrameSize = min(max(cfg.MaxFrameSize, DefaultMaxFrameSize), 1<<24-1)
	cfg.StreamWindow = min(cfg.StreamWindow, maxWindow)
	cfg.ConnWindow = min(max(cfg.ConnWindow, initialWindow), maxWindow)
	if cfg.DialContext == nil {
		cfg.DialContext = (&net.Dialer{}).DialContext
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Dialer{cfg: cfg, log: log, pool: map[poolKey]*poolEntry{}, opening: map[*h2Client]struct{}{}}, nil
}

// Stats returns a snapshot of the counters.
func (d *Dialer) Stats() DialerStats { return d.stat.snapshot() }

// dialTLS opens the TCP connection and runs the mTLS handshake for key.
func (d *Dialer) dialTLS(ctx context.Context, key poolKey) (*hboneConn, error) {
	address := key.proxy.String()
	c, err := d.cfg.DialContext(context.WithValue(ctx, keyCtx{}, key), "tcp", address)
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
	var gone []*h2Client
	for k, e := range d.pool {
		if k.origin != origin {
			continue
		}
		gone = append(gone, e.conns...)
		d.stat.connsPooled.Add(-int64(len(e.conns)))
		e.conns = nil
		if e.dialing == nil {
			delete(d.pool, k)
		}
	}
	d.mu.Unlock()
	for _, cc := range gone {
		cc.close(errConnClosed)
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
		st, err := cc.openStream(ctx, req.Target)
		if err == nil {
			d.stat.streamsOpened.Add(1)
			return st, nil
		}
		// A reused connection whose server did not process the stream
		// (GOAWAY below it, REFUSED_STREAM, or no longer taking streams
		// when its HEADERS were due) is evicted and the stream retried
		// once on a new one; nothing else is retried (retryable).
		if !fresh && attempt == 0 && retryable(err) && ctx.Err() == nil {
			d.evict(key, cc)
			continue
		}
		d.stat.streamsFailed.Add(1)
		return nil, fmt.Errorf("failed to connect %q via hbone proxy %q: %w", req.Target, req.Proxy, err)
	}
}

// reserve returns a pooled connection of key with a stream slot reserved,
// opening a connection when none has a free slot. fresh reports a new one.
func (d *Dialer) reserve(ctx context.Context, key poolKey) (*h2Client, bool, error) {
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
		var found *h2Client
		for _, cc := range e.conns {
			if cc.unusable() {
				// Broken, or GOAWAY: a closing connection finishes its
				// streams and closes itself.
				d.stat.connsEvicted.Add(1)
				d.stat.connsPooled.Add(-1)
				continue
			}
			live = append(live, cc)
			if found == nil && cc.reserve() {
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
				defer cc.close(errConnClosed)
			} else if cc.reserve() {
				e.conns = append(e.conns, cc)
				d.stat.connsPooled.Add(1)
			} else {
				err = fmt.Errorf("failed to open hbone connection %q from %q: the server allows no stream", key.proxy, key.source)
				defer cc.close(errConnClosed)
			}
		}
		d.mu.Unlock()
		if err != nil {
			return nil, false, err
		}
		return cc, true, nil
	}
}

// open opens a pooled connection for key: TCP, mTLS, the HTTP/2 preface
// and the server's SETTINGS, within HandshakeTimeout.
func (d *Dialer) open(ctx context.Context, key poolKey) (*h2Client, error) {
	hctx, cancel := context.WithTimeout(ctx, d.cfg.HandshakeTimeout)
	defer cancel()
	cc, err := d.start(hctx, key)
	if err != nil {
		d.stat.connsFailed.Add(1)
		return nil, fmt.Errorf("failed to open hbone connection %q from %q: %w", key.proxy, key.source, err)
	}
	d.stat.connsOpened.Add(1)
	d.log.Debug("hbone connection opened", "source_id", key.source.String(), "proxy", key.proxy.String())
	return cc, nil
}

func (d *Dialer) start(ctx context.Context, key poolKey) (*h2Client, error) {
	hc, err := d.dialTLS(ctx, key)
	if err != nil {
		return nil, err
	}
	cc := newH2Client(&d.cfg, d.log, &d.wg, &d.stat, hc, hc.peer, key.origin)
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		_ = hc.Close()
		return nil, errors.New("dialer closed")
	}
	d.opening[cc] = struct{}{}
	d.wg.Add(2)
	d.mu.Unlock()
	err = cc.start(ctx)
	d.mu.Lock()
	delete(d.opening, cc)
	d.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return cc, nil
}

func (d *Dialer) evict(key poolKey, cc *h2Client) {
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
			// A working connection finishes its streams and closes.
			cc.drain()
			return
		}
	}
}

// Close closes every pooled connection (streams on them fail) and waits
// for their goroutines.
func (d *Dialer) Close() error {
	d.mu.Lock()
	d.closed = true
	var conns []*h2Client
	for k, e := range d.pool {
		conns = append(conns, e.conns...)
		d.stat.connsPooled.Add(-int64(len(e.conns)))
		delete(d.pool, k)
	}
	for cc := range d.opening {
		conns = append(conns, cc)
	}
	d.mu.Unlock()
	for _, cc := range conns {
		cc.close(errors.New("hbone dialer closed"))
	}
	d.wg.Wait()
	return nil
}
