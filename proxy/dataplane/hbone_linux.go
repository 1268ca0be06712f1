package dataplane

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"aether.io/node/pkg/authz"
	"aether.io/node/proxy/hbone"
	"aether.io/node/proxy/peers"
	"aether.io/node/proxy/telemetry"
	"aether.io/node/xds/listener"
)

// HBONE in the data plane (see proxy/hbone/README.md "How the data plane uses
// it"): with Config.Certs set, every pod whose listeners carry a SPIFFE ID
// gets :HBONEPort bound in its netns and one hbone.Server delivering to the
// pod's app (DeliverInbound's path); a captured connection to a workload WDS
// marks tunnel_protocol HBONE goes through the manager's one hbone.Dialer from
// the source pod's netns.

// podHBONE is one pod's HBONE side: its identity, the :15008 listeners and
// their server.
type podHBONE struct {
	id spiffeid.ID
	// origin keeps this pod instance's pooled dialer connections apart from
	// every other pod's (and from a later instance of the same key).
	origin string
	lns    []net.Listener
	srv    *hbone.Server
	stop   chan struct{} // closed by stopHBONE: the server shuts down
	once   sync.Once
	served bool // serveHBONE ran: the server owns the listeners
}

// podCtxKey carries the dialing pod into the dialer's DialContext.
type podCtxKey struct{}

// newTunnel returns the manager's HBONE dialer; its connections are opened
// from the source pod's netns with the bypass mark.
func (m *Manager) newTunnel() (*hbone.Dialer, error) {
	budget, err := hbone.NewBudget(hbone.BudgetConfig{
		Window: m.cfg.HBONEWindowBudget, WindowPerSource: m.cfg.HBONEWindowBudgetPerSource,
		SendBufs: m.cfg.HBONESendBufs, SendBufsPerSource: m.cfg.HBONESendBufsPerSource,
		Control: m.cfg.HBONEControlBudget, ControlPerSource: m.cfg.HBONEControlBudgetPerSource,
	})
	if err != nil {
		return nil, err
	}
	return hbone.NewDialer(hbone.DialerConfig{
		Certs:            m.cfg.Certs,
		Budget:           budget,
		HandshakeTimeout: m.cfg.ConnectTimeout,
		Logger:           m.log.With("component", "hbone_dialer"),
		DialContext: func(ctx context.Context, _, address string) (net.Conn, error) {
			p, ok := ctx.Value(podCtxKey{}).(*pod)
			if !ok {
				return nil, fmt.Errorf("failed to dial hbone proxy %q: no source pod", address)
			}
			dst, err := netip.ParseAddrPort(address)
			if err != nil {
				return nil, fmt.Errorf("failed to parse hbone proxy address %q: %w", address, err)
			}
			return p.dialTCP(ctx, dst)
		},
	})
}

// bindHBONE binds the pod's HBONE listeners (0.0.0.0 and [::] per the pod's
// address families) in its netns when HBONE is on and the pod has an
// identity. On error the caller closes the pod, which closes what was bound.
func (p *pod) bindHBONE(seq uint64) error {
	if p.m.tunnel == nil || p.specs[0].SPIFFEID == "" {
		return nil
	}
	id, err := spiffeid.FromString(p.specs[0].SPIFFEID)
	if err != nil {
		return fmt.Errorf("failed to parse spiffe id %q of pod %q: %w", p.specs[0].SPIFFEID, p.key, err)
	}
	hb := &podHBONE{id: id, origin: p.key + "#" + strconv.FormatUint(seq, 10), stop: make(chan struct{})}
	p.hb = hb
	var v4, v6 bool
	for _, ip := range p.ips {
		if ip.Unmap().Is4() {
			v4 = true
		} else {
			v6 = true
		}
	}
	var binds []string
	if v4 {
		binds = append(binds, "tcp4", netip.AddrPortFrom(netip.IPv4Unspecified(), p.m.cfg.HBONEPort).String())
	}
	if v6 {
		binds = append(binds, "tcp6", netip.AddrPortFrom(netip.IPv6Unspecified(), p.m.cfg.HBONEPort).String())
	}
	var lbs []listener.Bind
	for i := 1; i < len(binds); i += 2 {
		lbs = append(lbs, listener.Bind{Addr: netip.MustParseAddrPort(binds[i])})
	}
	err = p.inNetNS(slices.Repeat([]string{hboneName}, len(lbs)), lbs, func() error {
		for i := 0; i < len(binds); i += 2 {
			ln, _, err := p.listen(listener.Spec{Name: hboneName}, listener.Bind{Addr: netip.MustParseAddrPort(binds[i+1])})
			if err != nil {
				return fmt.Errorf("failed to bind %s hbone listener on %s: %w", binds[i], binds[i+1], err)
			}
			hb.lns = append(hb.lns, ln)
		}
		return nil
	})
	if err != nil {
		return err
	}
	hb.srv, err = hbone.NewServer(hbone.ServerConfig{
		Identity: id, Certs: p.m.cfg.Certs, Deliver: p.deliverHBONE, Budget: p.m.hbBudget,
		HandshakeTimeout: p.m.cfg.ConnectTimeout, Logger: p.log.With("component", "hbone_server"),
	})
	return err
}

// hboneLoops is the number of accept loops serveHBONE starts.
func (p *pod) hboneLoops() int {
	if p.hb == nil {
		return 0
	}
	return len(p.hb.lns)
}

// serveHBONE serves the pod's HBONE listeners; the server shuts down when
// the pod stops accepting (streams may finish until the pod closes).
func (p *pod) serveHBONE() {
	hb := p.hb
	if hb == nil {
		return
	}
	hb.served = true
	p.m.addServer(hb.srv)
	for _, ln := range hb.lns {
		p.awg.Add(1)
		p.loops.Add(1)
		go func() {
			defer p.awg.Done()
			defer p.loops.Add(-1)
			if err := hb.srv.Serve(&retryListener{Listener: ln, p: p}); err != nil {
				p.log.Error("hbone listener stopped", "listener", ln.Addr().String(), "error", err.Error())
			}
		}()
	}
	// Part of the pod's connections: a drain waits for the streams, and the
	// pod's close (its ctx) cuts them.
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		select {
		case <-hb.stop:
		case <-p.ctx.Done():
		}
		if err := hb.srv.Shutdown(p.ctx); err != nil && !errors.Is(err, context.Canceled) {
			p.log.Warn("hbone server shutdown cut open streams", "error", err.Error())
		}
		p.m.retireServer(hb.srv) // Shutdown returned: its counters are final
	}()
}

// addServer counts srv in HBONEStats from now on.
func (m *Manager) addServer(srv *hbone.Server) {
	m.hbMu.Lock()
	defer m.hbMu.Unlock()
	m.servers[srv] = struct{}{}
}

// retireServer moves the final counters of a server that shut down into
// the retired sum, so the exported counters never go down when a pod goes.
func (m *Manager) retireServer(srv *hbone.Server) {
	m.hbMu.Lock()
	defer m.hbMu.Unlock()
	if _, ok := m.servers[srv]; !ok {
		return
	}
	delete(m.servers, srv)
	st := srv.Stats()
	st.StreamsActive = 0 // a gauge: nothing is active once Shutdown returned
	m.retired = addServerStats(m.retired, st)
}

// addServerStats returns the sum of two servers' counters.
func addServerStats(a, b hbone.ServerStats) hbone.ServerStats {
	a.Accepted += b.Accepted
	a.Handshakes += b.Handshakes
	a.HandshakeTimeouts += b.HandshakeTimeouts
	a.HandshakeFailures += b.HandshakeFailures
	a.StreamsOpened += b.StreamsOpened
	a.StreamsActive += b.StreamsActive
	a.StreamsBadRequest += b.StreamsBadRequest
	a.StreamsDeliverFailed += b.StreamsDeliverFailed
	a.ControlFloods += b.ControlFloods
	a.ConnsRejected += b.ConnsRejected
	a.WriteTimeouts += b.WriteTimeouts
	return a
}

// HBONEStats sums the HBONE counters of the node: every pod's server (those
// gone included) and the dialer. Zero when HBONE is off.
func (m *Manager) HBONEStats() telemetry.HBONEStats {
	var st telemetry.HBONEStats
	if m.tunnel == nil {
		return st
	}
	st.Dialer = m.tunnel.Stats()
	m.hbMu.Lock()
	defer m.hbMu.Unlock()
	st.Server = m.retired
	for srv := range m.servers {
		st.Server = addServerStats(st.Server, srv.Stats())
	}
	return st
}

// stopHBONE stops accepting HBONE connections and streams (GOAWAY); open
// streams continue until they end or the pod closes.
func (p *pod) stopHBONE() {
	hb := p.hb
	if hb == nil {
		return
	}
	hb.once.Do(func() {
		close(hb.stop)
		if !hb.served { // bound but never served: close the sockets here
			for _, ln := range hb.lns {
				_ = ln.Close()
			}
		}
	})
}

// closeHBONE closes the pooled dialer connections this pod opened.
func (p *pod) closeHBONE() {
	if p.hb != nil && p.m.tunnel != nil {
		p.m.tunnel.CloseOrigin(p.hb.origin)
	}
}

// retryListener keeps an HBONE listener accepting through transient accept
// errors (EMFILE, ECONNABORTED...) with a backoff, like the capture loop.
type retryListener struct {
	net.Listener
	p *pod
}

func (l *retryListener) Accept() (net.Conn, error) {
	var backoff time.Duration
	for {
		c, err := l.Listener.Accept()
		if err == nil || errors.Is(err, net.ErrClosed) || l.p.ctx.Err() != nil {
			return c, err
		}
		backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
		l.p.log.Warn("hbone accept failed", "listener", l.Addr().String(), "error", err.Error())
		select {
		case <-time.After(backoff):
		case <-l.p.ctx.Done():
			return nil, net.ErrClosed
		}
	}
}

// deliverHBONE is the pod's hbone.DeliverFunc: the target must be the pod's
// own address (else 502), the stream takes a connection slot of the pod's
// caps (else 503), and it reaches the app over its UDS socket or TCP
// (deliverInbound). The connection is counted with the verified source
// principal. With HBONEDeclaredPortsOnly, a port the pod does not declare
// is refused first (403: refuseUndeclaredPort).
func (p *pod) deliverHBONE(ctx context.Context, src spiffeid.ID, target netip.AddrPort) (net.Conn, error) {
	// The source pod's address (the source proxy dials from its netns):
	// the delivery binds it with a port of its own; the telemetry reports
	// the tunnel connection's address and port.
	var client, peer netip.AddrPort
	if a, ok := hbone.PeerAddr(ctx); ok {
		peer = netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
		client = netip.AddrPortFrom(peer.Addr(), 0)
	}
	target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	info := p.destinationInfo(peer, target)
	info.MTLS, info.Path, info.SourcePrincipal, info.DestinationPrincipal = true, telemetry.PathHBONE, src.String(), p.hb.id.String()
	if err := p.refuseUndeclaredPort(src, target); err != nil {
		info.Policy = telemetry.PolicyDeclaredPortsOnly
		p.m.metrics.Refused(info, telemetry.ReasonDenied, err)
		return nil, err
	}
	if !p.authorize(peer, src.String(), target, &info) {
		return nil, policyRefusal(target)
	}
	release, limit := p.admitTCP()
	if limit != "" {
		p.m.metrics.LimitHit(limit)
		p.m.metrics.Failed(limit)
		err := &hbone.StatusError{Code: http.StatusServiceUnavailable, Err: fmt.Errorf("failed to admit a stream to pod %q: %s limit", p.key, limit)}
		info.Limit = limit
		p.m.metrics.Refused(info, telemetry.ReasonLimit, err)
		return nil, err
	}
	up, err := p.deliverInbound(ctx, target, client)
	if err != nil {
		release()
		if errors.Is(err, ErrNotThisPod) {
			p.m.metrics.Misdirected(info, err)
			return nil, &hbone.StatusError{Code: http.StatusBadGateway, Err: err}
		}
		p.m.metrics.Refused(info, telemetry.ReasonConnectFailed, err)
		return nil, err
	}
	if _, ok := up.(*net.UnixConn); ok {
		info.Path = telemetry.PathUDS
	}
	c := &inboundConn{
		Conn: up, release: release, untrack: p.untrack, tc: p.m.metrics.Open(info),
		az: authz.Conn{Source: peer.Addr(), Identity: src.String(), Dest: target},
	}
	c.act.touch()
	if !p.track(c) {
		c.endWith(telemetry.ReasonPodClosed)
		c.abort()
		_ = c.Close()
		return nil, fmt.Errorf("failed to deliver to %s: pod %q: %w", target, p.key, ErrNotServing)
	}
	return c, nil
}

var (
	_ hbone.SocketConn = (*inboundConn)(nil)
	_ hbone.Abortable  = (*inboundConn)(nil)
)

// inboundConn is the app side of one HBONE stream: it counts the bytes and
// the connection, and gives the pod's slot back when the server closes it.
type inboundConn struct {
	net.Conn
	tc      *telemetry.Conn
	release func()
	untrack func(closer)
	once    sync.Once
	act     activity
	onAbort atomic.Pointer[func()] // the server's stream reset (hbone.Abortable)
	end     telemetry.End
	readErr atomic.Pointer[error] // the app side's read error (ReadDone)
	// az is what the stream was authorized on (Manager.Reauthorize).
	az authz.Conn
}

var _ hbone.ReadObserver = (*inboundConn)(nil)

func (c *inboundConn) endWith(r telemetry.CloseReason) { c.end.Force(r) }

// denied records that policy now refuses the established stream.
func (c *inboundConn) denied(policy, reason string) {
	c.end.Force(telemetry.ReasonDenied)
	c.tc.Deny(policy, reason)
}

// ReadDone records how reading the app ended (hbone.ReadObserver): EOF,
// the server (the app) closed first; an error, a reset.
func (c *inboundConn) ReadDone(err error) {
	if err != nil {
		c.readErr.Store(&err)
		c.end.Force(telemetry.ReasonReset)
		return
	}
	c.end.Finished(telemetry.ReasonServerClosed)
}

func (c *inboundConn) authorized() (authz.Conn, bool) { return c.az, true }

// OnAbort sets what abort calls after closing the app connection: the
// server resets the stream and wakes its goroutine wherever it waits
// (hbone.Abortable).
func (c *inboundConn) OnAbort(f func()) { c.onAbort.Store(&f) }

// Write carries bytes from the source to the app.
func (c *inboundConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.SocketWritten(n)
	return n, err
}

// SocketWritten counts n bytes the HBONE server wrote to the app socket
// itself (hbone.SocketConn).
func (c *inboundConn) SocketWritten(n int) {
	if n > 0 {
		c.act.touch()
		c.tc.Received(int64(n))
	}
}

// Read carries bytes from the app back to the source.
func (c *inboundConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.SocketRead(n)
	return n, err
}

// Socket returns the app connection: the HBONE server reads it directly
// (hbone.SocketConn) and reports each read to SocketRead.
func (c *inboundConn) Socket() net.Conn { return c.Conn }

// SocketRead counts n bytes carried from the app back to the source.
func (c *inboundConn) SocketRead(n int) {
	if n > 0 {
		c.act.touch()
		c.tc.Sent(int64(n))
	}
}

// idle is the time since data last moved between the stream and the app
// (and, over TCP, what the app socket's TCP_INFO says).
func (c *inboundConn) idle() time.Duration {
	idle := c.act.since()
	if tc, ok := c.Conn.(*net.TCPConn); ok {
		idle = min(idle, idleFor(tc))
	}
	return idle
}

func (c *inboundConn) String() string { return "hbone stream -> " + c.Conn.RemoteAddr().String() }

// CloseWrite passes the source's half-close on to the app.
func (c *inboundConn) CloseWrite() error {
	c.end.Finished(telemetry.ReasonClientClosed)
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// Close ends the delivery (the server calls it once the stream ends).
func (c *inboundConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.untrack(c)
		// Neither end seen finishing, no error: the source reset the
		// stream (the server closes the app side under the copy, which
		// then reports its error first in most cases).
		r := c.end.Reason(telemetry.ReasonReset)
		var err error
		if e := c.readErr.Load(); e != nil {
			err = *e
		}
		c.tc.Close(r, closeErr(r, err))
		c.release()
	})
	return err
}

// abort resets the app connection (the pod closes, the idle timeout); the
// stream handler then fails, resets the stream and closes c.
func (c *inboundConn) abort() {
	if tc, ok := c.Conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Conn.Close()
	if f := c.onAbort.Load(); f != nil {
		(*f)()
	}
}

// Values of aether_outbound_connections_total{path}.
const (
	pathHBONE       = "hbone"
	pathNotMesh     = "passthrough_not_hbone"
	pathNoIdentity  = "passthrough_no_identity"
	pathHBONEFailed = "hbone_failed"
	failedHBONEDial = "hbone_connect"
)

// tunnelTCP sends a captured connection through HBONE when its destination
// is a workload WDS marks tunnel_protocol HBONE and the pod has an identity.
// It reports false when the connection must be passed through in plain TCP
// (counted); when it returns true the connection is done with. A failed
// HBONE dial resets the client: never a silent downgrade to plaintext.
func (p *pod) tunnelTCP(down *net.TCPConn, src, dst netip.AddrPort) bool {
	if p.m.tunnel == nil {
		return false
	}
	dstPeer := p.lookup(dst.Addr())
	if !dstPeer.HBONE || dst.Port() == p.m.cfg.HBONEPort {
		// Not a mesh workload, or a client already speaking HBONE to
		// :15008 itself.
		p.m.metrics.Outbound(pathNotMesh)
		return false
	}
	if p.hb == nil {
		p.m.metrics.Outbound(pathNoIdentity)
		return false
	}
	var expected spiffeid.ID
	if dstPeer.Identity != "" {
		id, err := spiffeid.FromString(dstPeer.Identity)
		if err != nil {
			p.m.metrics.Outbound(pathHBONEFailed)
			p.m.metrics.Failed(failedHBONEDial)
			p.m.metrics.Refused(p.tunnelInfo(src, dst, dstPeer, ""), telemetry.ReasonConnectFailed, err)
			p.log.Error("destination's spiffe id is invalid; resetting the connection", "dst", dst.String(), "spiffe_id", dstPeer.Identity, "error", err.Error())
			reset(down)
			return true
		}
		expected = id
	}
	ctx, cancel := context.WithTimeout(context.WithValue(p.ctx, podCtxKey{}, p), p.m.cfg.ConnectTimeout)
	up, err := p.m.tunnel.Dial(ctx, hbone.Request{
		Source: p.hb.id, Proxy: netip.AddrPortFrom(dst.Addr(), p.m.cfg.HBONEPort), Target: dst,
		Expected: expected, Origin: p.hb.origin,
	})
	cancel()
	if err != nil {
		p.m.metrics.Outbound(pathHBONEFailed)
		p.m.metrics.Failed(failedHBONEDial)
		p.m.metrics.Refused(p.tunnelInfo(src, dst, dstPeer, ""), telemetry.ReasonConnectFailed, err)
		p.log.Debug("hbone connect failed", "src", src.String(), "dst", dst.String(), "error", err.Error())
		reset(down)
		return true
	}
	p.m.metrics.Outbound(pathHBONE)
	p.pipeStream(down, up, p.sourceInfo(src, dst, dstPeer))
	return true
}

// tunnelInfo is sourceInfo of a connection tunnelled over HBONE whose
// destination's principal is verified ("": not verified, a failed dial).
func (p *pod) tunnelInfo(src, dst netip.AddrPort, dstPeer peers.Peer, verified string) telemetry.ConnInfo {
	i := p.sourceInfo(src, dst, dstPeer)
	i.MTLS, i.Path, i.SourcePrincipal, i.DestinationPrincipal = true, telemetry.PathHBONE, p.hb.id.String(), verified
	return i
}

// pipeStream relays a captured connection and the HBONE stream opened for
// it until both are done, counted as the source side (info, made mutual TLS
// with both principals here).
func (p *pod) pipeStream(down *net.TCPConn, up *hbone.Stream, info telemetry.ConnInfo) {
	info.MTLS, info.Path = true, telemetry.PathHBONE
	info.SourcePrincipal, info.DestinationPrincipal = p.hb.id.String(), up.Peer().String()
	pair := &streamPair{down: down, up: up}
	pair.act.touch()
	if !p.track(pair) {
		pair.abort()
		p.m.metrics.Refused(info, telemetry.ReasonPodClosed, nil)
		return
	}
	defer p.untrack(pair)
	tc := p.m.metrics.Open(info)
	tc.Close(pair.pipe(tc))
}

// streamPair is one captured connection tunnelled over an HBONE stream.
type streamPair struct {
	down *net.TCPConn
	up   *hbone.Stream
	once sync.Once
	act  activity
	end  telemetry.End
	// finishing: finish ended the pair at a drain deadline (tcpPair's).
	finishing atomic.Bool
}

// finish ends the pair cleanly at a drain deadline: a FIN to the client
// and an END_STREAM to the peer at once; what the client still sends is
// discarded until its FIN or finishLinger, what the stream still carries
// until the peer's END_STREAM (the pod's close aborts a peer that sends
// none: the stream has no read deadline).
func (t *streamPair) finish() {
	t.end.Force(telemetry.ReasonDrainDeadline)
	t.finishing.Store(true)
	_ = t.down.CloseWrite()
	_ = t.up.CloseWrite()
	_ = t.down.SetReadDeadline(time.Now().Add(finishLinger))
}

func (t *streamPair) endWith(r telemetry.CloseReason) { t.end.Force(r) }

// idle is the time since data last moved through the stream (either way),
// or through the client's socket (TCP_INFO), whichever is shorter.
func (t *streamPair) idle() time.Duration {
	return min(t.act.since(), idleFor(t.down))
}

func (t *streamPair) String() string {
	return t.down.RemoteAddr().String() + " -> hbone " + t.up.RemoteAddr().String()
}

func (t *streamPair) abort() {
	t.once.Do(func() {
		reset(t.down)
		_ = t.up.Close()
	})
}

// countWriter reports every write's size and stamps the activity.
type countWriter struct {
	w   io.Writer
	add func(int64)
	act *activity
}

func (c countWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	if n > 0 {
		c.StreamWritten(n)
	}
	return n, err
}

var _ hbone.StreamWriter = countWriter{}

// HBONEStream returns the stream c writes to, if it is one
// (hbone.StreamWriter): hbone.Copy then frames its reads in place.
func (c countWriter) HBONEStream() *hbone.Stream {
	s, _ := c.w.(*hbone.Stream)
	return s
}

// StreamWritten counts n bytes written and stamps the activity.
func (c countWriter) StreamWritten(n int) {
	c.act.touch()
	c.add(int64(n))
}

// pipe copies both ways like pipe does for plain pairs: EOF → half-close
// (END_STREAM upstream, FIN downstream), an error resets both. It returns
// how the connection ended and the copy error of a reset.
func (t *streamPair) pipe(tc *telemetry.Conn) (telemetry.CloseReason, error) {
	var wg sync.WaitGroup
	var upErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		// Large raw reads of the client's socket, no buffer while idle,
		// framed in place into the stream (countWriter is an
		// hbone.StreamWriter).
		err := hbone.Copy(countWriter{t.up, tc.Received, &t.act}, t.down)
		if t.finishing.Load() {
			_, _ = io.Copy(io.Discard, t.down)
			return
		}
		if err != nil {
			upErr = err
			t.end.Force(telemetry.ReasonReset)
			t.abort()
			return
		}
		t.end.Finished(telemetry.ReasonClientClosed)
		_ = t.up.CloseWrite()
	}()
	_, downErr := io.Copy(countWriter{t.down, tc.Sent, &t.act}, t.up)
	if t.finishing.Load() {
		_, _ = io.Copy(io.Discard, t.up)
		downErr = nil
	} else if downErr != nil {
		t.end.Force(telemetry.ReasonReset)
		t.abort()
	} else {
		t.end.Finished(telemetry.ReasonServerClosed)
		_ = t.down.CloseWrite()
	}
	wg.Wait()
	t.once.Do(func() {
		_ = t.down.Close()
		_ = t.up.Close()
	})
	r := t.end.Reason(telemetry.ReasonClientClosed)
	return r, closeErr(r, errors.Join(upErr, downErr))
}
